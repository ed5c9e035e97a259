//! `outboxd-bench`: figures of a real outboxd server on a real, durable PostgreSQL,
//! printed as a markdown table. Benchmarks measure and report; they assert nothing (the
//! tests do that), because a bound depends on the machine.
//!
//! ```text
//! cargo run --release --bin outboxd-bench -- txn-latency [--iterations 500] [--database-url URL]
//! cargo run --release --bin outboxd-bench -- all [--smoke] [--database-url URL]
//! ```
//!
//! Each subcommand is one benchmark; a new one adds a [`Command`] variant and reuses the
//! modules under `outboxd-bench/`: `harness` (cluster, in-process server, keys), `server`
//! (outboxd as a child process), `meter` (CPU, commits, WAL), `report` (percentiles,
//! histograms, the table), `suite` (`all`), `ordered` (its ordering-key scenarios),
//! `console` (the operator console's pages), `peers` (pgbench, graphile-worker, pg-boss).

/// mimalloc, not glibc's malloc: the server allocates per row and per message, and glibc's
/// arenas spent ~4% of the machine on it in a burn-down (see README, Performance).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod console;
mod fairness;
mod harness;
mod meter;
mod ordered;
mod peers;
mod plain_workers;
mod report;
mod server;
mod suite;
mod txn_latency;
mod workers;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outboxd::config::Settings;

use crate::harness::Cluster;
use crate::server::ServeChildArgs;
use crate::suite::AllArgs;
use crate::txn_latency::TxnLatencyArgs;

#[derive(Debug, Parser)]
#[command(
    name = "outboxd-bench",
    about = "Benchmarks of outboxd against a durable PostgreSQL; prints a markdown table",
    after_help = "Server tuning is read from the OUTBOX_* variables as by `outboxd serve` \
                  (e.g. OUTBOX_TXN__RESOLVE_INTERVAL); its database and listen address are the \
                  benchmark's own. Logs: OUTBOX_LOG__FILTER (default warn)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Two-phase token: latency from the producer's COMMIT to a waiting worker's Claim
    /// returning the intent, with the direct enqueue as a baseline.
    TxnLatency(TxnLatencyArgs),
    /// Enqueue throughput, burn-down, enqueue → claim latency at fixed rates and commit →
    /// claimable, for outboxd and (same cluster, same run) a raw-SQL ceiling with pgbench,
    /// graphile-worker and pg-boss: one table with ratios, CPU, commits and WAL per 1k;
    /// and ordering keys: burn-down over many keys, one hot key, a blocked key's backlog;
    /// and the operator console's pages over a large outbox.
    All(Box<AllArgs>),
    /// Internal: serve outboxd in this process for `all` (which runs the server as a
    /// child process to measure its CPU apart from the load generator's).
    #[command(hide = true)]
    ServeChild(ServeChildArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Quiet by default: the figures go to stdout, and sqlx's slow-statement warnings for
    // CREATE/DROP DATABASE (each forces a checkpoint) are setup noise, not findings.
    let filter =
        std::env::var("OUTBOX_LOG__FILTER").unwrap_or_else(|_| "warn,sqlx::query=error".to_owned());
    outboxd::telemetry::install(outboxd::config::LogFormat::Text, &filter, None);
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outboxd-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    match cli.command {
        Command::TxnLatency(args) => {
            // Declared before the runtime so it is dropped after it: the cluster (blocking
            // stop, directory removal) outlives every connection.
            let cluster = Cluster::start(args.cluster.database_url.as_deref())?;
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(txn_latency::txn_latency(&cluster, settings, &args))
        }
        Command::All(args) => {
            let cluster = Cluster::start(args.cluster.database_url.as_deref())?;
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(suite::all(&cluster, settings, &args))
        }
        Command::ServeChild(args) => {
            let runtime = tokio::runtime::Runtime::new()?;
            runtime.block_on(server::serve_child(&args, settings))
        }
    }
}
