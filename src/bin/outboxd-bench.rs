//! `outboxd-bench`: latency figures of a real outboxd server on a real, durable PostgreSQL,
//! printed as a markdown table. Benchmarks measure and report; they assert nothing (the
//! tests do that), because a latency bound depends on the machine.
//!
//! ```text
//! cargo run --release --bin outboxd-bench -- txn-latency [--iterations 500] [--database-url URL]
//! ```
//!
//! Each subcommand is one benchmark; a new one adds a [`Command`] variant and reuses
//! [`Cluster`], [`Bench`] and [`Summary`].

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::{Args, Parser, Subcommand};
use outboxd::client::{Client, Credentials};
use outboxd::config::Settings;
use outboxd::embedded::{EmbeddedConfig, EmbeddedPostgres};
use outboxd::outbox::store::{self, ApiKeyRecord};
use outboxd::proto::v1;
use outboxd::startup::{self, Application, EMBEDDED_SERVICE_ROLE, Runtime};
use sqlx::{Connection, PgConnection, PgPool};
use tonic::transport::Channel;
use uuid::Uuid;

/// The tenant the benchmark's keys act for.
const TENANT: &str = "bench";

/// Iterations run before measuring each scenario, so connection setup, prepared-statement
/// caches and the first page faults do not land in the figures.
const WARMUP: usize = 5;

/// How long a worker's Claim long-polls; far above any expected latency, so a timeout
/// means a lost wake-up rather than a slow one.
const CLAIM_WAIT: Duration = Duration::from_secs(5);

/// Producer token from the outbox database: NOTIFYs outboxd when the transaction commits.
const OUTBOX_TOKEN_SQL: &str = "SELECT outbox.txn_token()";

/// Producer token from any database of the cluster, without the outbox schema (see the
/// migration defining `outbox.txn_token()`).
const PLAIN_TOKEN_SQL: &str = "SELECT 'v1.' || system_identifier || '.' || pg_current_xact_id() \
                               FROM pg_control_system()";

#[derive(Debug, Parser)]
#[command(
    name = "outboxd-bench",
    about = "Latency benchmarks of outboxd against a durable PostgreSQL; prints a markdown table",
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
}

/// Where a benchmark runs; shared by every subcommand.
#[derive(Debug, Args)]
struct ClusterArgs {
    /// PostgreSQL cluster to run on: a URL to any database of it, for a role that may
    /// CREATE DATABASE and CREATE ROLE. The benchmark creates its own databases there and
    /// drops them at the end; outboxd serves through the role `outboxd_service`, created if
    /// missing, which must be able to log in without a password (as in the embedded
    /// cluster). Unset: a private embedded cluster in a fresh temporary directory, removed
    /// after.
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
}

#[derive(Debug, Args)]
struct TxnLatencyArgs {
    /// Measured iterations of the same-database and direct scenarios; the other-database
    /// scenario, which waits for a polling sweep, runs a fifth of them.
    #[arg(long, default_value_t = 500, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    iterations: u32,
    /// Pause before the commit (or the direct Enqueue), so the worker's Claim has surely
    /// looked, found nothing and parked: the wake-up path is what is measured.
    #[arg(long, default_value_t = 10, value_name = "MS")]
    settle_ms: u64,
    #[command(flatten)]
    cluster: ClusterArgs,
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
            runtime.block_on(txn_latency(&cluster, settings, &args))
        }
    }
}

// ---------------------------------------------------------------------------------------
// txn-latency
// ---------------------------------------------------------------------------------------

/// How the producer of a scenario makes its intent claimable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Producer {
    /// `outbox.txn_token()` inside a transaction on the outbox database; promoted at once
    /// by the NOTIFY its commit delivers.
    SameDatabase,
    /// The plain-SQL token inside a transaction on another database of the cluster, whose
    /// NOTIFYs outboxd cannot hear; promoted by the fallback sweep.
    OtherDatabase,
    /// No token: Enqueue alone makes the intent PENDING.
    Direct,
}

struct Scenario {
    name: &'static str,
    producer: Producer,
    iterations: usize,
}

async fn txn_latency(
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
    let resolve = bench.settings.txn_resolve_interval;
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
async fn measure_txn(
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
                        settle + bench.settings.txn_resolve_interval.mul_f64(phase(i)),
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
async fn producer_connection(url: &str) -> anyhow::Result<PgConnection> {
    let mut conn = PgConnection::connect(url)
        .await
        .context("producer cannot connect")?;
    sqlx::query("SET synchronous_commit = on")
        .execute(&mut conn)
        .await?;
    Ok(conn)
}

/// One two-phase iteration: Claim waiting, then BEGIN, token, Enqueue, `pause`, COMMIT.
async fn one_txn(
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
        .enqueue(token, i, v1::IntentState::Staged)
        .await
        .context("Enqueue with a token")?;
    tokio::time::sleep(pause).await;
    tx.commit().await?;
    let t0 = Instant::now();
    bench.finish_claim(claim, &id, t0).await
}

/// One direct iteration: Claim waiting, then Enqueue without a token.
async fn one_direct(bench: &Bench, settle: Duration, i: usize) -> anyhow::Result<f64> {
    let claim = bench.spawn_claim();
    // Here the Enqueue itself makes the intent claimable, so the Claim must park before it.
    tokio::time::sleep(settle).await;
    let id = bench
        .enqueue(String::new(), i, v1::IntentState::Pending)
        .await
        .context("direct Enqueue")?;
    let t0 = Instant::now();
    bench.finish_claim(claim, &id, t0).await
}

/// The `i`th point of the golden-ratio sequence in [0, 1): consecutive points fill the
/// interval evenly, whatever the number of iterations.
fn phase(i: usize) -> f64 {
    const INVERSE_GOLDEN_RATIO: f64 = 0.618_033_988_749_894_9;
    (i as f64 * INVERSE_GOLDEN_RATIO).fract()
}

/// A worker's Claim in flight, with the instant its answer arrived.
type ClaimTask = tokio::task::JoinHandle<(Result<v1::ClaimResponse, tonic::Status>, Instant)>;

/// `t1 - t0` in milliseconds, negative when `t1` came first. Clamping to zero would hide
/// that the worker can be answered before the producer is.
fn signed_ms(t0: Instant, t1: Instant) -> f64 {
    match t1.checked_duration_since(t0) {
        Some(d) => d.as_secs_f64() * 1e3,
        None => -(t0 - t1).as_secs_f64() * 1e3,
    }
}

// ---------------------------------------------------------------------------------------
// Harness shared by the benchmarks
// ---------------------------------------------------------------------------------------

/// The PostgreSQL cluster a benchmark runs on.
enum Cluster {
    /// A private cluster with PostgreSQL's durable defaults (fsync and synchronous_commit
    /// on, unlike the test harness): the figures must include a real commit's flush.
    Embedded {
        postgres: Option<EmbeddedPostgres>,
        dir: PathBuf,
    },
    /// The user's cluster, reached through `admin_url`.
    External { admin_url: String },
}

impl Cluster {
    /// Blocking: may run initdb and start a server.
    fn start(database_url: Option<&str>) -> anyhow::Result<Self> {
        if let Some(url) = database_url {
            return Ok(Self::External {
                admin_url: url.to_owned(),
            });
        }
        // Under the temp dir: as root the server runs as `postgres`, which must be able to
        // reach the data directory (not the case under /root or a private work tree).
        let dir = std::env::temp_dir().join(format!("outboxd-bench-{}", std::process::id()));
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("removing stale {}", dir.display()))?;
        }
        eprintln!(
            "outboxd-bench: starting an embedded PostgreSQL in {}",
            dir.display()
        );
        let postgres = EmbeddedPostgres::start(EmbeddedConfig::new(dir.join("pgdata")))?;
        Ok(Self::Embedded {
            postgres: Some(postgres),
            dir,
        })
    }

    /// URL of `database` in this cluster.
    fn url(&self, database: &str) -> anyhow::Result<String> {
        match self {
            Self::Embedded { postgres, .. } => Ok(postgres
                .as_ref()
                .expect("running until dropped")
                .url(database)),
            Self::External { admin_url } => with_login(admin_url, None, database),
        }
    }

    /// URL of a database that exists before the benchmark creates its own.
    fn admin_url(&self) -> anyhow::Result<String> {
        match self {
            Self::Embedded { .. } => self.url("postgres"),
            Self::External { admin_url } => Ok(admin_url.clone()),
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Embedded { dir, .. } => format!("embedded cluster in {}", dir.display()),
            Self::External { .. } => "external cluster (--database-url)".to_owned(),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Self::Embedded { postgres, dir } = self {
            // Stop the server before deleting the files it writes.
            drop(postgres.take());
            if let Err(e) = std::fs::remove_dir_all(&*dir) {
                eprintln!("outboxd-bench: cannot remove {}: {e}", dir.display());
            }
        }
    }
}

/// Rewrites a `postgres://` URL for `database` and, when given, `user` (then without a
/// password), keeping the host and the parameters.
fn with_login(url: &str, user: Option<&str>, database: &str) -> anyhow::Result<String> {
    let (head, query) = match url.split_once('?') {
        Some((head, query)) => (head, Some(query)),
        None => (url, None),
    };
    let authority = head.find("://").context("--database-url is not a URL")? + 3;
    let path = head[authority..]
        .find('/')
        .map_or(head.len(), |i| authority + i);
    let (userinfo, host) = match head[authority..path].rsplit_once('@') {
        Some((userinfo, host)) => (Some(userinfo), host),
        None => (None, &head[authority..path]),
    };
    let login = user
        .or(userinfo)
        .map(|u| format!("{u}@"))
        .unwrap_or_default();
    let mut out = format!("{}{login}{host}/{database}", &head[..authority]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    Ok(out)
}

/// A fresh outbox database served by an in-process outboxd, a second plain database of
/// the same cluster, and one gRPC connection each for the producer and the worker (as
/// separate processes would have).
struct Bench {
    server: Application,
    pool: PgPool,
    admin_url: String,
    databases: [String; 2],
    /// Drop `databases` at the end: only on the user's cluster, since an embedded one is
    /// deleted whole (and DROP DATABASE costs a checkpoint).
    drop_databases: bool,
    outbox_url: String,
    other_url: String,
    producer: Client,
    worker: Client,
    settings: Settings,
    info: String,
    load_at_start: String,
}

impl Bench {
    async fn start(cluster: &Cluster, settings: Settings) -> anyhow::Result<Self> {
        // Fresh names: never touch an existing outbox, whose intents a worker would claim.
        let suffix = Uuid::new_v4().simple().to_string();
        let outbox_db = format!("outboxd_bench_{}", &suffix[..12]);
        let other_db = format!("{outbox_db}_producer");
        let admin_url = cluster.admin_url()?;
        let mut admin = PgConnection::connect(&admin_url)
            .await
            .context("cannot connect to the cluster")?;
        for db in [&outbox_db, &other_db] {
            // Generated names, not input: nothing to inject.
            sqlx::query(&format!("CREATE DATABASE {db}"))
                .execute(&mut admin)
                .await
                .with_context(|| format!("CREATE DATABASE {db}"))?;
        }
        let info = machine_info(&mut admin, cluster).await?;
        admin.close().await?;

        let outbox_url = cluster.url(&outbox_db)?;
        let other_url = cluster.url(&other_db)?;
        // Set up as `outboxd serve` sets up its embedded cluster (startup::prepare_database):
        // migrate as the owner, then serve through a role that owns nothing, so row-level
        // security and the per-transaction tenant settings are part of what is measured.
        let owner = startup::connect(&outbox_url, 2).await?;
        startup::migrate(&owner).await?;
        startup::grant_service_role(&owner, EMBEDDED_SERVICE_ROLE, true).await?;
        // Separate keys with the least scope each, as a producer and a worker would hold.
        let producer_key = create_key(&owner, "bench-producer", "produce").await?;
        let worker_key = create_key(&owner, "bench-worker", "consume").await?;
        owner.close().await;
        let service_url = with_login(&outbox_url, Some(EMBEDDED_SERVICE_ROLE), &outbox_db)?;
        let pool = startup::connect(&service_url, settings.max_connections)
            .await
            .with_context(|| format!("cannot log in as {EMBEDDED_SERVICE_ROLE}"))?;
        startup::verify_service_role(&pool).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let settings = Settings {
            // Still recorded as in production, but served on a free port so the benchmark
            // never collides with a running outboxd's.
            metrics_addr: Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0))),
            ..settings
        };
        // The production runtime: database clock, background sweeps, 2 s recheck.
        let server =
            Application::start(&settings, pool.clone(), listener, Runtime::default()).await?;
        let endpoint = format!("http://{}", server.local_addr());
        let producer = connect_client(&endpoint, &producer_key).await?;
        let worker = connect_client(&endpoint, &worker_key).await?;
        Ok(Self {
            server,
            pool,
            admin_url,
            databases: [outbox_db, other_db],
            drop_databases: matches!(cluster, Cluster::External { .. }),
            outbox_url,
            other_url,
            producer,
            worker,
            settings,
            info,
            load_at_start: load_average(),
        })
    }

    /// Stops the server and drops the benchmark's databases.
    async fn stop(self) -> anyhow::Result<()> {
        drop((self.producer, self.worker));
        self.server.stop().await?;
        self.pool.close().await;
        if !self.drop_databases {
            return Ok(());
        }
        let mut admin = PgConnection::connect(&self.admin_url).await?;
        for db in &self.databases {
            sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                .execute(&mut admin)
                .await?;
        }
        admin.close().await?;
        Ok(())
    }

    /// Enqueues one intent (with `token`, or directly when empty) and returns its id,
    /// checking it got `expected` state.
    async fn enqueue(
        &self,
        txn_token: String,
        i: usize,
        expected: v1::IntentState,
    ) -> anyhow::Result<String> {
        let intent = v1::NewIntent {
            kind: "bench.latency".to_owned(),
            payload: format!("{{\"i\":{i}}}").into_bytes(),
            content_type: "application/json".to_owned(),
            ..Default::default()
        };
        let results = self
            .producer
            .clone()
            .enqueue(v1::EnqueueRequest {
                intents: vec![intent],
                txn_token,
            })
            .await?
            .into_inner()
            .results;
        ensure!(results.len() == 1, "Enqueue answered {results:?}");
        let result = &results[0];
        ensure!(
            result.state() == expected,
            "Enqueue left {:?}, expected {expected:?}",
            result.state()
        );
        Ok(result.id.clone())
    }

    /// Starts a worker's long-polling Claim for one intent, timing its answer where it
    /// arrives rather than when this task gets round to awaiting it.
    fn spawn_claim(&self) -> ClaimTask {
        let mut worker = self.worker.clone();
        tokio::spawn(async move {
            let response = worker
                .claim(v1::ClaimRequest {
                    worker_id: "outboxd-bench".to_owned(),
                    max_intents: 1,
                    wait: Some(prost_types::Duration {
                        seconds: CLAIM_WAIT.as_secs() as i64,
                        nanos: 0,
                    }),
                    ..Default::default()
                })
                .await;
            (response.map(tonic::Response::into_inner), Instant::now())
        })
    }

    /// Waits for the Claim, checks it leased intent `id`, acks it so the queue is empty
    /// for the next iteration, and returns the latency from `t0`.
    async fn finish_claim(&self, claim: ClaimTask, id: &str, t0: Instant) -> anyhow::Result<f64> {
        let (response, t1) = claim.await?;
        let leases = response.context("Claim")?.leases;
        let Some(lease) = leases.first() else {
            anyhow::bail!(
                "intent {id} did not become claimable within {} s",
                CLAIM_WAIT.as_secs()
            );
        };
        let leased = lease.intent.as_ref().map(|i| i.id.as_str());
        ensure!(leased == Some(id), "claimed {leased:?}, expected {id}");
        let acked = self
            .worker
            .clone()
            .ack(v1::AckRequest {
                leases: vec![v1::LeaseRef {
                    intent_id: id.to_owned(),
                    lease_id: lease.lease_id.clone(),
                }],
            })
            .await?
            .into_inner()
            .results;
        ensure!(
            acked.iter().all(|r| r.error.is_none()),
            "Ack failed: {acked:?}"
        );
        Ok(signed_ms(t0, t1))
    }
}

/// An API key for [`TENANT`] with one scope; returns its secret.
async fn create_key(owner: &PgPool, name: &str, scope: &str) -> anyhow::Result<String> {
    let key = outboxd::auth::generate_key()?;
    let record = ApiKeyRecord {
        id: Uuid::now_v7(),
        name: name.to_owned(),
        prefix: key.prefix.clone(),
        tenants: vec![TENANT.to_owned()],
        all_tenants: false,
        scopes: vec![scope.to_owned()],
        regions: Vec::new(),
        created_at: chrono::Utc::now(),
        revoked_at: None,
    };
    store::insert_api_key(owner, &record, &key.hash).await?;
    Ok(key.secret)
}

/// A client on its own connection (HTTP/2 multiplexes one, but a producer and a worker are
/// separate processes) sending `key`.
async fn connect_client(endpoint: &str, key: &str) -> anyhow::Result<Client> {
    let channel = Channel::from_shared(endpoint.to_owned())?.connect().await?;
    Ok(outboxd::client::client(
        channel,
        Credentials::new(Some(key), None)?,
    ))
}

/// The 1-minute load average, or "?" where /proc/loadavg does not exist.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// One line naming what the figures depend on: CPUs, PostgreSQL and its durability.
async fn machine_info(admin: &mut PgConnection, cluster: &Cluster) -> anyhow::Result<String> {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    // Best effort: the model helps compare runs, and its absence (non-Linux) is harmless.
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let mut show = async |name: &str| -> anyhow::Result<String> {
        Ok(sqlx::query_scalar(&format!("SHOW {name}"))
            .fetch_one(&mut *admin)
            .await?)
    };
    let version = show("server_version").await?;
    let fsync = show("fsync").await?;
    let synchronous_commit = show("synchronous_commit").await?;
    let wal_sync_method = show("wal_sync_method").await?;
    Ok(format!(
        "machine: nproc {cpus} ({model}); PostgreSQL {version}, {}; fsync={fsync}, \
         synchronous_commit={synchronous_commit}, wal_sync_method={wal_sync_method}",
        cluster.describe()
    ))
}

// ---------------------------------------------------------------------------------------
// Reporting
// ---------------------------------------------------------------------------------------

/// Percentiles of one scenario, nearest-rank over the sorted samples (exact, and the
/// sample counts here are small enough that no histogram is needed).
struct Summary {
    name: &'static str,
    iterations: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
    /// Samples below zero (see [`signed_ms`]).
    negative: usize,
}

impl Summary {
    fn of(name: &'static str, mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let rank = |p: f64| samples[((p / 100.0 * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            name,
            iterations: n,
            p50: rank(50.0),
            p90: rank(90.0),
            p99: rank(99.0),
            max: samples[n - 1],
            negative: samples.iter().filter(|&&s| s < 0.0).count(),
        }
    }

    fn print_table(rows: &[Self]) {
        println!("| scenario | iterations | p50 ms | p90 ms | p99 ms | max ms |");
        println!("|---|---:|---:|---:|---:|---:|");
        for r in rows {
            println!(
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
                r.name, r.iterations, r.p50, r.p90, r.p99, r.max
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s = Summary::of("x", (1..=100).rev().map(f64::from).collect());
        assert_eq!((s.p50, s.p90, s.p99, s.max), (50.0, 90.0, 99.0, 100.0));
        let one = Summary::of("x", vec![3.0]);
        assert_eq!((one.p50, one.p99, one.max), (3.0, 3.0, 3.0));
    }

    #[test]
    fn login_is_replaced_keeping_host_and_parameters() {
        let url = with_login("postgres://u:p@h:5432/app?sslmode=require", None, "b").unwrap();
        assert_eq!(url, "postgres://u:p@h:5432/b?sslmode=require");
        assert_eq!(
            with_login("postgres://h", None, "b").unwrap(),
            "postgres://h/b"
        );
        let url = with_login("postgres://u:p@h/app?x=1", Some("svc"), "b").unwrap();
        assert_eq!(url, "postgres://svc@h/b?x=1");
    }
}
