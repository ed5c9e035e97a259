//! The `txn-latency` benchmark: latency from a producer's COMMIT to a waiting worker's
//! Claim returning the intent, for the two-phase token (same and other database) and the
//! direct enqueue baseline.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use outboxd::config::Settings;
use outboxd::proto::v1;
use outboxd::startup::EMBEDDED_SERVICE_ROLE;
use sqlx::{Connection, PgConnection};

use crate::harness::{Bench, Cluster, ClusterArgs, load_average};
use crate::report::Summary;

/// Iterations run before measuring each scenario, so connection setup, prepared-statement
/// caches and the first page faults do not land in the figures.
pub const WARMUP: usize = 5;

/// How long a worker's Claim long-polls; far above any expected latency, so a timeout
/// means a lost wake-up rather than a slow one.
pub const CLAIM_WAIT: Duration = Duration::from_secs(5);

/// Producer token from the outbox database: NOTIFYs outboxd when the transaction commits.
const OUTBOX_TOKEN_SQL: &str = "SELECT outbox.txn_token()";

/// Producer token from any database of the cluster, without the outbox schema.
use outboxd::outbox::token::PLAIN_TOKEN_SQL;

#[derive(Debug, Args)]
pub struct TxnLatencyArgs {
    /// Measured iterations of the same-database and direct scenarios; the other-database
    /// scenario, which waits for a polling sweep, runs a fifth of them.
    #[arg(long, default_value_t = 500, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub iterations: u32,
    /// Pause before the commit (or the direct Enqueue), so the worker's Claim has surely
    /// looked, found nothing and parked: the wake-up path is what is measured.
    #[arg(long, default_value_t = 10, value_name = "MS")]
    pub settle_ms: u64,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// How the producer of a scenario makes its intent claimable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Producer {
    /// `outbox.txn_token()` inside a transaction on the outbox database; promoted at once
    /// by the NOTIFY its commit delivers.
    SameDatabase,
    /// The plain-SQL token inside a transaction on another database of the cluster, whose
    /// NOTIFYs outboxd cannot hear; promoted by the fallback sweep.
    OtherDatabase,
    /// No token: Enqueue alone makes the intent PENDING.
    Direct,
}

pub struct Scenario {
    pub name: &'static str,
    pub producer: Producer,
    pub iterations: usize,
}

pub async fn txn_latency(
    cluster: &Cluster,
    settings: Settings,
    args: &TxnLatencyArgs,
) -> anyhow::Result<()> {
    let n = args.iterations as usize;
    let scenarios = [
        Scenario {
            name: "same database (txn_token + NOTIFY)",
            producer: Producer::SameDatabase,
            iterations: n,
        },
        Scenario {
            name: "other database (plain token, sweep)",
            producer: Producer::OtherDatabase,
            iterations: (n / 5).max(1),
        },
        Scenario {
            name: "direct enqueue (no token, baseline)",
            producer: Producer::Direct,
            iterations: n,
        },
    ];
    let settle = Duration::from_millis(args.settle_ms);
    let bench = Bench::start(cluster, settings).await?;
    let measured = async {
        let mut rows = Vec::new();
        for scenario in &scenarios {
            eprintln!(
                "outboxd-bench: {} ({} iterations + {WARMUP} warm-up)",
                scenario.name, scenario.iterations
            );
            let samples = measure_txn(&bench, scenario, settle).await?;
            rows.push(Summary::of(scenario.name, samples));
        }
        anyhow::Ok(rows)
    }
    .await;
    let load_at_end = load_average();
    let info = bench.info.clone();
    let load_at_start = bench.load_at_start.clone();
    let resolve = bench.settings.txn.resolve_interval;
    let stopped = bench.stop().await;
    let rows = measured?;
    stopped?;

    println!("## outboxd-bench txn-latency\n");
    println!("{info}");
    // Other processes competing for the CPUs move these figures more than anything in
    // outboxd does (every process or task woken on the path may have to wait for a CPU),
    // so say how busy the machine was.
    println!("load average (1 min): {load_at_start} at start, {load_at_end} at end");
    println!(
        "server: in-process outboxd as role {EMBEDDED_SERVICE_ROLE} (row-level security), \
         API keys per producer and worker, fallback sweep every {} ms; worker Claim long-polls \
         (max_intents 1), and the producer pauses {} ms before its COMMIT (or direct Enqueue) \
         so that Claim is parked; {WARMUP} warm-up iterations per scenario not counted\n",
        resolve.as_millis(),
        args.settle_ms
    );
    Summary::print_table(&rows);
    println!();
    println!(
        "- **same database**: BEGIN; SELECT outbox.txn_token(); Enqueue(token) → STAGED; \
         COMMIT. Latency from COMMIT returning to the producer until the worker's waiting \
         Claim returns the lease: commit NOTIFY → outboxd's LISTEN connection → promoter \
         (STAGED → PENDING) → claimer woken → claim query → gRPC answer. Target p50 ≤ 5 ms."
    );
    println!(
        "- **other database**: the same transaction on another database of the cluster, with \
         the plain-SQL token. outboxd cannot hear that database's NOTIFY, so promotion waits \
         for the fallback sweep: expect about half the sweep interval at p50 and about the \
         whole interval at worst. The pause before its commit is spread evenly over one sweep \
         interval, so commits do not phase-lock with the sweep."
    );
    println!(
        "- **direct enqueue**: Enqueue without a token (PENDING at once); latency from Enqueue \
         returning until the waiting Claim returns. The floor of the wake-up path (commit NOTIFY \
         → claimer → claim query → answer); it can be negative when the worker gets its lease \
         before the producer gets its answer."
    );
    for row in &rows {
        if row.negative > 0 {
            println!(
                "- {}: {} of {} samples were negative (the Claim returned before the producer's \
                 call did).",
                row.name, row.negative, row.iterations
            );
        }
    }
    Ok(())
}

/// Runs one scenario; returns the measured latencies in milliseconds (signed: see
/// [`signed_ms`]).
pub async fn measure_txn(
    bench: &Bench,
    scenario: &Scenario,
    settle: Duration,
) -> anyhow::Result<Vec<f64>> {
    let mut producer_db = match scenario.producer {
        Producer::SameDatabase => Some(producer_connection(&bench.outbox_url).await?),
        Producer::OtherDatabase => Some(producer_connection(&bench.other_url).await?),
        Producer::Direct => None,
    };
    let mut samples = Vec::with_capacity(scenario.iterations);
    for i in 0..WARMUP + scenario.iterations {
        let latency = match producer_db.as_mut() {
            Some(conn) => {
                let (sql, pause) = match scenario.producer {
                    Producer::SameDatabase => (OUTBOX_TOKEN_SQL, settle),
                    // This loop runs in step with the sweep (each iteration starts right
                    // after a sweep promoted the last intent), so with a fixed pause every
                    // commit would land at the same phase of the sweep: a run without this
                    // gave p50 88.7 ms for a 100 ms interval. Real producers commit at any
                    // phase, so the pause spreads commits evenly over one interval (golden
                    // ratio steps: even coverage for any count, reproducible, no RNG).
                    _ => (
                        PLAIN_TOKEN_SQL,
                        settle + bench.settings.txn.resolve_interval.mul_f64(phase(i)),
                    ),
                };
                one_txn(bench, conn, sql, pause, i).await?
            }
            None => one_direct(bench, settle, i).await?,
        };
        if i >= WARMUP {
            samples.push(latency);
        }
    }
    if let Some(conn) = producer_db {
        conn.close().await?;
    }
    Ok(samples)
}

/// A producer's own connection, durable whatever the cluster's default: the commit being
/// measured must be one that survives a crash.
pub async fn producer_connection(url: &str) -> anyhow::Result<PgConnection> {
    let mut conn = PgConnection::connect(url)
        .await
        .context("producer cannot connect")?;
    sqlx::query("SET synchronous_commit = on")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// One two-phase iteration: Claim waiting, then BEGIN, token, Enqueue, `pause`, COMMIT.
pub async fn one_txn(
    bench: &Bench,
    conn: &mut PgConnection,
    token_sql: &str,
    pause: Duration,
    i: usize,
) -> anyhow::Result<f64> {
    // The Claim starts first and runs its first look concurrently with the producer: the
    // intent is STAGED until the commit, so that look finds nothing and the Claim parks.
    let claim = bench.spawn_claim();
    let mut tx = conn.begin().await?;
    let token: String = sqlx::query_scalar(token_sql)
        .fetch_one(&mut *tx)
        .await
        .context("producer cannot make a token")?;
    let id = bench
        .enqueue(token, i, &[v1::IntentState::Staged])
        .await
        .context("Enqueue with a token")?;
    tokio::time::sleep(pause).await;
    tx.commit().await?;
    let t0 = Instant::now();
    bench.finish_claim(claim, &id, t0).await
}

/// One direct iteration: Claim waiting, then Enqueue without a token.
pub async fn one_direct(bench: &Bench, settle: Duration, i: usize) -> anyhow::Result<f64> {
    let claim = bench.spawn_claim();
    // Here the Enqueue itself makes the intent claimable, so the Claim must park before it.
    tokio::time::sleep(settle).await;
    let id = bench
        .enqueue(String::new(), i, &[v1::IntentState::Pending])
        .await
        .context("direct Enqueue")?;
    let t0 = Instant::now();
    bench.finish_claim(claim, &id, t0).await
}

/// The `i`th point of the golden-ratio sequence in [0, 1): consecutive points fill the
/// interval evenly, whatever the number of iterations.
pub fn phase(i: usize) -> f64 {
    const INVERSE_GOLDEN_RATIO: f64 = 0.618_033_988_749_894_9;
    (i as f64 * INVERSE_GOLDEN_RATIO).fract()
}

/// A worker's Claim in flight, with the instant its answer arrived.
pub type ClaimTask = tokio::task::JoinHandle<(Result<v1::ClaimResponse, tonic::Status>, Instant)>;

/// `t1 - t0` in milliseconds, negative when `t1` came first. Clamping to zero would hide
/// that the worker can be answered before the producer is.
pub fn signed_ms(t0: Instant, t1: Instant) -> f64 {
    match t1.checked_duration_since(t0) {
        Some(d) => d.as_secs_f64() * 1e3,
        None => -(t0 - t1).as_secs_f64() * 1e3,
    }
}
