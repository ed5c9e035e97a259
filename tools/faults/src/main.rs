//! `outboxd-faults`: the fault-injection suite (issue 6). It runs producers (two-phase and
//! direct), workers and several outboxd replicas as real processes against a real
//! PostgreSQL, injects crashes, stops, lost responses, killed sessions, a pinned xmin and
//! an exhausted pool under load, records every operation, and after a full drain checks
//! the guarantees of docs/design.md. It prints a summary table and exits non-zero if
//! any guarantee was violated.
//!
//! ```text
//! cargo build --bin outboxd --bin outboxd-faults
//! target/debug/outboxd-faults run                     # CI: 60 s of faults, drain, checks
//! target/debug/outboxd-faults run --duration 30m      # soak, same checks
//! target/debug/outboxd-faults repro xid-reuse         # a bug the suite found, exit 1 while present
//! target/debug/outboxd-faults failover                # primary crash, standby promoted, checks
//! ```
//!
//! Modules: `cluster` (PostgreSQL), `processes` (children and their supervision), `proxy`
//! (lost responses), `rpc` (clients that retry the same request), `producer`, `worker` and
//! `idle` (the load and the pinned xmin), `journal` (what they observed), `faults` (kinds
//! and timeline), `run` (orchestration; `run::inject` the fault scheduler, `run::operator`
//! the operator who releases blocked ordering keys), `checker` (the guarantees; ordering
//! keys in `checker::ordering`), `report` (the table), `repro` (deterministic reproductions of found bugs), `failover` (a PostgreSQL failover
//! under load, issue 33).

mod checker;
mod cluster;
mod failover;
mod faults;
mod idle;
mod journal;
mod processes;
mod producer;
mod proxy;
mod read_back;
mod report;
mod repro;
mod rng;
mod rpc;
mod run;
mod storm;
mod witness;
mod worker;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

/// Environment variable carrying the API key to child processes (not their command line).
pub const API_KEY_ENV: &str = "OUTBOXD_FAULTS_API_KEY";

/// Kind of intents workers deliver to an idempotent target (no MarkSubmitted).
pub const IDEMPOTENT_KIND: &str = "fault.email";

/// Kind of intents workers deliver to a non-idempotent target (MarkSubmitted first).
pub const PAYMENT_KIND: &str = "fault.payment";

/// Kind of intents workers deliver to an idempotent target, with no queue limit and no
/// ordering key: how long they wait is the claim's fairness alone (`checker::fairness`).
pub const NOTICE_KIND: &str = "fault.notice";

#[derive(Debug, Parser)]
#[command(
    name = "outboxd-faults",
    about = "Fault-injection suite: proves outboxd's guarantees under crashes, lost responses and load"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the suite and print the summary table (exit 1 if a guarantee was violated).
    Run(run::RunArgs),
    /// Deterministic reproduction of a bug the suite found (exit 1 while outboxd has it).
    Repro(repro::ReproArgs),
    /// A PostgreSQL failover under load: primary, synchronous standby, immediate stop,
    /// promotion, servers moved (exit 1 if a check failed).
    Failover(failover::FailoverArgs),
    /// A worker process (started by `run`).
    #[command(hide = true)]
    Worker(worker::WorkerArgs),
    /// A producer process (started by `run`).
    #[command(hide = true)]
    Producer(producer::ProducerArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match &cli.command {
        // The orchestrator forks children from its worker threads, which must outlive
        // them (PR_SET_PDEATHSIG follows the forking thread): a fixed multi-thread pool.
        Command::Run(_) | Command::Repro(_) | Command::Failover(_) => {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
        }
        _ => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    };
    let runtime = match runtime {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("outboxd-faults: {e}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Repro(args) => repro::run(args).await,
            Command::Failover(args) => failover::run(args).await,
            Command::Worker(args) => worker::run(args).await.map(|()| true),
            Command::Producer(args) => producer::run(args).await.map(|()| true),
        }
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("outboxd-faults: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A token cancelled on SIGTERM: children finish what they hold, then exit.
fn stop_on_sigterm() -> anyhow::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        term.recv().await;
        cancel.cancel();
    });
    Ok(token)
}
