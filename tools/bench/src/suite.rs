//! `all`: the throughput and latency scenarios of issue 7 for outboxd (a child server
//! process on a fresh outbox database) and for the peers on the same cluster, printed as
//! one table: 1 enqueue (batched; one intent per call from many clients), 2 burn-down,
//! 3/4 producers and workers together at fixed offered rates (enqueue → claim latency,
//! and the highest sustainable rate), 5 commit → claimable (the `txn-latency`
//! measurement), 6 the fixed rate over a large finished history and with xmin pinned,
//! and the ordering keys' scenarios (`ordered`: burn-down over many keys, one hot key, a
//! blocked key's backlog), and the operator console's pages over a large outbox
//! (`console`). Peers run 1, 2 and 3/4 (pgbench 1 and 2).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use clap::Args;
use outboxd::config::Settings;
use outboxd::proto::v1;
use outboxd::startup::{self, EMBEDDED_FLEET_ROLE, EMBEDDED_SERVICE_ROLE};
use sqlx::{Connection, PgConnection};
use tokio::sync::Mutex;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::harness::{
    Bench, Cluster, ClusterArgs, connect_client, create_key, load_average, machine_info, with_login,
};
use crate::meter::{Cost, Meter};
use crate::ordered::{self, OrderedSizes};
use crate::peers;
use crate::plain_workers;
use crate::report::{Hist, Outcome, Row, print_rows};
use crate::server::ServerProcess;
use crate::txn_latency::{self, Producer, Scenario, WARMUP};
use crate::workers::{Shape, Workers};

/// Padding of every intent's JSON payload, the same for every system (bench/peer.js uses
/// 48 too): `{"n":123,"pad":"xxx…"}` is about 70 bytes.
pub const PAYLOAD_PAD: usize = 48;

/// A single Enqueue, Claim or Ack carries at most this many items (the server's default
/// `OUTBOX_LIMITS__MAX_BATCH`).
pub(crate) const MAX_BATCH: usize = 1000;

/// A rate is sustainable when this share of the offered intents was sent on time...
const SUSTAINED_SHARE: f64 = 0.95;
/// ...every one was claimed within this long after the last was sent...
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// ...and the p99 of enqueue → claim stayed below this.
const SUSTAINED_P99_MS: f64 = 50.0;

/// Most intents per Claim of the fixed-rate workers (and per fetch of the peers' workers).
pub const RATE_CLAIM_MAX: u32 = 100;

/// Most Enqueue calls in flight in the fixed-rate scenario before the producer counts
/// itself as falling behind.
const MAX_IN_FLIGHT: usize = 1024;

#[derive(Debug, Args)]
pub struct AllArgs {
    /// Small N, seconds in all: the CI smoke run (figures printed, nothing asserted).
    #[arg(long)]
    pub smoke: bool,
    /// Intents enqueued in batches of 1000 [200000; smoke 4000].
    #[arg(long, value_name = "N")]
    pub batched: Option<u64>,
    /// Intents enqueued one per call [19200; smoke 1024].
    #[arg(long, value_name = "N")]
    pub single: Option<u64>,
    /// Concurrent clients of the batched enqueue [4; smoke 2].
    #[arg(long, value_name = "N")]
    pub batch_clients: Option<usize>,
    /// Concurrent clients of the one-per-call enqueue [64; smoke 16].
    #[arg(long, value_name = "N")]
    pub single_clients: Option<usize>,
    /// Workers of the burn-down [4; smoke 2].
    #[arg(long, value_name = "N")]
    pub workers: Option<usize>,
    /// Intents per Claim (and per Ack) in the burn-down, for every system (outboxd's SDK
    /// workers: handler slots each, and a Claim waits for all of them to be free).
    #[arg(long, default_value_t = 100, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub claim_batch: u32,
    /// Seconds per offered rate in the enqueue → claim scenario [10; smoke 1].
    #[arg(long, value_name = "S")]
    pub rate_seconds: Option<f64>,
    /// Offered rates of the enqueue → claim scenario, per second, comma-separated: exactly
    /// these, for every system [100,1000, then (not smoke) outboxd alone doubling from
    /// 2000 until a rate is not sustained].
    #[arg(long, value_name = "LIST", value_delimiter = ',',
          value_parser = clap::value_parser!(u32).range(1..=256_000))]
    pub rates: Vec<u32>,
    /// Finished (delivered) rows put in the table before the large-history scenario
    /// [1000000; smoke 20000].
    #[arg(long, value_name = "N")]
    pub history: Option<u64>,
    /// Seconds of the scenario run while an idle-in-transaction session pins xmin
    /// [30; smoke 2].
    #[arg(long, value_name = "S")]
    pub pinned_seconds: Option<f64>,
    /// Iterations of the commit → claimable scenarios [200; smoke 20].
    #[arg(long, value_name = "N")]
    pub txn_iterations: Option<usize>,
    /// Ordered burn-down: intents, spread round-robin over `--ordered-keys` ordering keys
    /// [220000; smoke 4000].
    #[arg(long, value_name = "N")]
    pub ordered: Option<u64>,
    /// Ordering keys of the ordered burn-down [10000; smoke 200].
    #[arg(long, value_name = "K")]
    pub ordered_keys: Option<u64>,
    /// Intents of the one hot ordering key, delivered one at a time [2000; smoke 100].
    #[arg(long, value_name = "N")]
    pub hot_key: Option<u64>,
    /// Intents queued behind the blocked key's dead-lettered head [1000000; smoke 5000].
    #[arg(long, value_name = "N")]
    pub blocked: Option<u64>,
    /// Intents of the backlog burnt down in the fairness scenario [1000000; smoke 5000].
    #[arg(long, value_name = "N")]
    pub fairness_backlog: Option<u64>,
    /// Intents seeded (by SQL) before the console's pages are requested, at least 1000
    /// [1000000; smoke 20000].
    #[arg(long, value_name = "N")]
    pub console_intents: Option<u64>,
    /// Requests of each console page, per key [50; smoke 5].
    #[arg(long, value_name = "N")]
    pub console_requests: Option<usize>,
    /// Do not ANALYZE before the burn-downs. By default every system's database is
    /// analyzed right before its burn-down, so that each plans its claim on statistics that
    /// know the backlog: without it, whether autovacuum has analyzed the freshly filled
    /// table yet may decide a peer's plan (outboxd forces its ordered index walk).
    #[arg(long)]
    pub no_analyze: bool,
    /// Skip graphile-worker, pg-boss and pgbench.
    #[arg(long)]
    pub no_peers: bool,
    /// outboxd's burn-down workers are plain Claim(batch) → Ack(batch) loops without
    /// `request_id` instead of the SDK's managed workers: the load the benchmark offered
    /// before the SDK, for A/B runs of a server build against an older one.
    #[arg(long)]
    pub plain_workers: bool,
    /// Run only these sections (comma-separated; default all): `throughput` (enqueue and
    /// burn-down), `rates` (enqueue → claim at fixed rates), `history` (1M rows, pinned
    /// xmin), `token` (commit → claimable), `peers`; the ordering keys' `ordered-burn-down`,
    /// `hot-key`, `blocked-key`, or `ordered` for the three; `fairness` (a small tenant
    /// beside another's backlog); `console` (the operator console's pages). For iterating
    /// on one scenario.
    #[arg(long, value_enum, value_delimiter = ',', value_name = "SECTION")]
    pub only: Vec<SectionName>,
    /// Folder of the peer harnesses (package.json, peer.js, pgbench/*.sql): the
    /// repository's `bench/`, two levels above this crate.
    #[arg(long, value_name = "DIR", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench"))]
    pub bench_dir: PathBuf,
    /// pgbench binary [pgbench on PATH, else /usr/lib/postgresql/*/bin/pgbench].
    #[arg(long, value_name = "PATH")]
    pub pgbench: Option<PathBuf>,
    /// Node.js binary for the npm peers [the one `npm ci --prefix bench` installs,
    /// bench/node_modules/.bin/node (the peers need Node 22 or later), else node on PATH].
    #[arg(long, value_name = "PATH")]
    pub node: Option<PathBuf>,
    #[command(flatten)]
    pub cluster: ClusterArgs,
}

/// A part of `all` that `--only` can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SectionName {
    Throughput,
    Rates,
    History,
    Token,
    Peers,
    /// The three below.
    Ordered,
    OrderedBurnDown,
    HotKey,
    BlockedKey,
    /// A small tenant's latency while another tenant's backlog is burnt down.
    Fairness,
    /// The operator console's pages over a large outbox.
    Console,
}

impl AllArgs {
    pub(crate) fn runs(&self, section: SectionName) -> bool {
        let ordering = matches!(
            section,
            SectionName::OrderedBurnDown | SectionName::HotKey | SectionName::BlockedKey
        );
        self.only.is_empty()
            || self.only.contains(&section)
            || (ordering && self.only.contains(&SectionName::Ordered))
    }
}

/// The sizes of one run, from the arguments and the mode.
pub struct Sizes {
    pub batched: u64,
    pub single: u64,
    pub batch_clients: usize,
    pub single_clients: usize,
    pub workers: usize,
    pub claim_batch: u32,
    pub rate_seconds: f64,
    history: u64,
    pinned_seconds: f64,
    txn_iterations: usize,
    /// Offered rates measured always, then (full runs) doubled from the last until one
    /// is not sustainable.
    pub rates: Vec<u32>,
    search: bool,
    pub analyze: bool,
    plain_workers: bool,
    pub(crate) ordered: OrderedSizes,
    pub fairness_backlog: u64,
    pub console_intents: u64,
    pub console_requests: usize,
}

impl Sizes {
    fn of(a: &AllArgs) -> Self {
        let s = a.smoke;
        Self {
            // Multiples of what the clients take per round, so that pgbench (whole
            // transactions per client) enqueues exactly as many.
            batched: a.batched.unwrap_or(if s { 4_000 } else { 200_000 }),
            single: a.single.unwrap_or(if s { 1_024 } else { 19_200 }),
            batch_clients: a.batch_clients.unwrap_or(if s { 2 } else { 4 }).max(1),
            single_clients: a.single_clients.unwrap_or(if s { 16 } else { 64 }).max(1),
            workers: a.workers.unwrap_or(if s { 2 } else { 4 }).max(1),
            claim_batch: a.claim_batch,
            rate_seconds: a.rate_seconds.unwrap_or(if s { 1.0 } else { 10.0 }),
            history: a.history.unwrap_or(if s { 20_000 } else { 1_000_000 }),
            pinned_seconds: a.pinned_seconds.unwrap_or(if s { 2.0 } else { 30.0 }),
            txn_iterations: a.txn_iterations.unwrap_or(if s { 20 } else { 200 }).max(1),
            rates: if a.rates.is_empty() {
                vec![100, 1000]
            } else {
                a.rates.clone()
            },
            search: !s && a.rates.is_empty(),
            analyze: !a.no_analyze,
            plain_workers: a.plain_workers,
            ordered: OrderedSizes {
                intents: a.ordered.unwrap_or(if s { 4_000 } else { 220_000 }),
                keys: a
                    .ordered_keys
                    .unwrap_or(if s { 200 } else { 10_000 })
                    .max(1),
                hot: a.hot_key.unwrap_or(if s { 100 } else { 2_000 }).max(1),
                blocked: a.blocked.unwrap_or(if s { 5_000 } else { 1_000_000 }),
            },
            fairness_backlog: a
                .fairness_backlog
                .unwrap_or(if s { 5_000 } else { 1_000_000 }),
            console_intents: a
                .console_intents
                .unwrap_or(if s { 20_000 } else { 1_000_000 })
                .max(1_000),
            console_requests: a.console_requests.unwrap_or(if s { 5 } else { 50 }).max(1),
        }
    }
}

impl Sizes {
    /// Workers of the fixed-rate scenarios, for every system.
    pub fn rate_workers(&self) -> usize {
        self.workers.min(2)
    }
}

/// Where outboxd's scenarios run: a migrated database and keys for it.
pub(crate) struct Target {
    pub owner_url: String,
    pub database: String,
    pub service_url: String,
    pub fleet_url: String,
    pub producer_key: String,
    pub worker_key: String,
}

pub async fn all(cluster: &Cluster, settings: Settings, args: &AllArgs) -> anyhow::Result<()> {
    let sizes = Sizes::of(args);
    let admin_url = cluster.admin_url()?;
    let mut admin = PgConnection::connect(&admin_url)
        .await
        .context("cannot connect to the cluster")?;
    let info = machine_info(&mut admin, cluster).await?;
    let base = format!(
        "outboxd_bench_{}",
        &Uuid::new_v4().simple().to_string()[..12]
    );
    let meter = Meter::new(&admin_url).await?;
    let load_at_start = load_average();
    let started = Instant::now();

    let mut rows = Vec::new();
    let target = prepare_outbox(cluster, &mut admin, &base).await?;
    eprintln!("outboxd-bench: outboxd scenarios on {}", target.database);
    if args.runs(SectionName::Throughput) {
        outboxd_throughput(&meter, &target, &sizes, &mut rows).await?;
        let zero = prepare_outbox(cluster, &mut admin, &format!("{base}_zero")).await?;
        outboxd_burn_down_at_zero_retention(&meter, &zero, &sizes, &mut rows).await?;
        // Next to the unlimited burn-down, so that the ratio of the two sees the same load.
        let db = format!("{base}_limited");
        crate::fairness::limited_burn_down(cluster, &mut admin, &db, &meter, &sizes, &mut rows)
            .await?;
    }
    // Ordered intents need commit times, which only a cluster with track_commit_timestamp
    // records (the embedded one does; a --database-url cluster may not).
    let commit_times = ordered::commit_times(&mut admin).await?;
    if args.runs(SectionName::OrderedBurnDown) {
        // Next to the unordered burn-down, so that the ratio of the two sees the same load.
        let db = format!("{base}_ordered");
        ordered::burn_down(
            cluster,
            &mut admin,
            &db,
            &meter,
            &sizes,
            commit_times,
            &mut rows,
        )
        .await?;
    }
    if args.runs(SectionName::Rates) {
        outboxd_rates(&meter, &target, &sizes, &mut rows).await?;
    }
    if args.runs(SectionName::History) {
        history_and_pinned_xmin(cluster, &meter, &target, &sizes, &mut rows).await?;
    }
    if args.runs(SectionName::HotKey) {
        let db = format!("{base}_hot");
        ordered::hot_key(
            cluster,
            &mut admin,
            &db,
            &meter,
            &sizes,
            commit_times,
            &mut rows,
        )
        .await?;
    }
    if args.runs(SectionName::BlockedKey) {
        let db = format!("{base}_blocked");
        ordered::blocked_key(
            cluster,
            &mut admin,
            &db,
            &meter,
            &sizes,
            commit_times,
            &mut rows,
        )
        .await?;
    }
    if args.runs(SectionName::Fairness) {
        let db = format!("{base}_fairness");
        crate::fairness::fairness(cluster, &mut admin, &db, &meter, &sizes, &mut rows).await?;
    }
    if args.runs(SectionName::Console) {
        let db = format!("{base}_console");
        crate::console::console(cluster, &mut admin, &db, &meter, &sizes, &mut rows).await?;
    }
    if args.runs(SectionName::Token) {
        commit_to_claimable(cluster, &settings, &sizes, &mut rows).await?;
    }

    if args.no_peers {
        rows.push(Row::not_run("peers", "-", "all", "--no-peers"));
    } else if args.runs(SectionName::Peers) {
        // The raw-SQL ceiling runs on its own migrated outbox database, fresh as outboxd's.
        let raw_db = format!("{base}_raw");
        create_database(&mut admin, &raw_db).await?;
        let raw_url = cluster.url(&raw_db)?;
        let owner = startup::connect(&raw_url, 2).await?;
        startup::migrate(&owner).await?;
        owner.close().await;
        peers::pgbench(args, &meter, &raw_url, &raw_db, &sizes, &mut rows).await;
        for system in ["graphile-worker", "pg-boss"] {
            let db = format!("{base}_{}", system.replace('-', "_"));
            create_database(&mut admin, &db).await?;
            let url = cluster.url(&db)?;
            peers::node(args, &meter, system, &url, &db, &sizes, &mut rows).await;
        }
    }
    let load_at_end = load_average();
    if matches!(cluster, Cluster::External { .. }) {
        for db in [
            target.database.clone(),
            format!("{base}_zero"),
            format!("{base}_limited"),
            format!("{base}_ordered"),
            format!("{base}_hot"),
            format!("{base}_blocked"),
            format!("{base}_fairness"),
            format!("{base}_console"),
            format!("{base}_raw"),
            format!("{base}_graphile_worker"),
            format!("{base}_pg_boss"),
        ] {
            sqlx::query(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                .execute(&mut admin)
                .await?;
        }
    }
    admin.close().await?;

    println!(
        "## outboxd-bench all{}\n",
        if args.smoke { " --smoke" } else { "" }
    );
    println!("{info}");
    if args.runs(SectionName::Peers) && !args.no_peers {
        println!("npm peers: {}", peers::versions(args));
    }
    println!(
        "load average (1 min): {load_at_start} at start, {load_at_end} at end; {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
    println!(
        "statistics: {}; outboxd's database VACUUMed (ANALYZE too) after its burn-down, before the \
         fixed rates\nsizes: {} intents batched ({} per call, {} clients), {} one per call ({} clients); \
         burn-down of all of them by {} workers, {} per Claim and per Ack (outboxd: at most); {} s per offered \
         rate; {} commit → claimable iterations\n",
        if sizes.analyze {
            "each database ANALYZEd right before its burn-down"
        } else {
            "not refreshed before the burn-downs (--no-analyze): autovacuum's timing decides"
        },
        sizes.batched,
        MAX_BATCH,
        sizes.batch_clients,
        sizes.single,
        sizes.single_clients,
        sizes.workers,
        sizes.claim_batch,
        sizes.rate_seconds,
        sizes.txn_iterations
    );
    if [
        SectionName::OrderedBurnDown,
        SectionName::HotKey,
        SectionName::BlockedKey,
    ]
    .into_iter()
    .any(|s| args.runs(s))
    {
        println!("{}\n", ordered::describe(&sizes));
    }
    if args.runs(SectionName::Console) {
        println!("{}\n", crate::console::describe(&sizes));
    }
    print_rows(&rows);
    println!();
    print_notes();
    Ok(())
}

fn print_notes() {
    for note in [
        "**outboxd** runs in a child process (`serve-child`: the same `Application` as \
         `outboxd serve`, as the non-owner role with row-level security, API keys), a fresh \
         one per section; the load generator is this process, over gRPC on loopback. Its \
         workers are the Rust SDK's managed worker (`outboxd-client`): each Claim asks for its \
         free handler slots (at most the claim batch), Acks are batched by the SDK (2 ms), and \
         the fixed rates' workers send plain long polls (no `request_id`: the hand-off).",
        "**raw SQL (pgbench)**: `pgbench -M prepared` as a superuser, no service in between: \
         the burn-down makes the store's own claim and ack calls (`CLAIM_CALL`, `ACK_CALL`: \
         the functions `outbox.claim` and `outbox.ack_into_batches`; at retention 0 `ACK_AND_DELETE_CALL`, \
         `outbox.ack_and_delete`), one statement each as the server makes them; enqueue is \
         `bench/pgbench/enqueue.sql`, a plain INSERT … SELECT of the batch (no idempotency \
         probe). Its latency is one pgbench transaction: enqueue one batch, or claim + ack one \
         batch.",
        "**retention 0: Ack deletes**: the burn-down again, on a database of its own filled as \
         the first, by a server with `OUTBOX_RETENTION__FINISHED=0s`, whose Ack deletes the \
         rows it delivers instead of keeping them DELIVERED for the purge.",
        "**graphile-worker, pg-boss**: `bench/peer.js` (versions pinned in \
         `bench/package.json`, each configured as its documentation advises for throughput: \
         bench/README.md), batched add (`addJobs`, `insert`) and one job per call \
         (`addJob`, `send`); burn-down by as many graphile-worker runners as outboxd's \
         workers (24 concurrent jobs each, a local queue of the claim batch, batched \
         completion) and as many pg-boss `work()` workers (`batchSize` of the claim batch, \
         `burstWhenBatchFull`, the batch completed in one call); the fixed rates with as many \
         of each library's workers as outboxd's, each library two ways: graphile-worker's \
         runners woken by LISTEN/NOTIFY without and with a local queue of 100, pg-boss \
         polling (every 0.5 s, its shortest; up to 100 jobs per fetch) and with LISTEN/NOTIFY \
         (`useListenNotify`, the queue's `notify`). graphile-worker's runner gives no \
         per-batch latency; pg-boss's claim+ack is a worker's cycle, from one batch handed to \
         its handler to the next.",
        "**latency of**: `call` is one Enqueue (or add/insert/send) call; `claim+ack` one \
         Claim of a batch plus its Ack; `enqueue OK → claim` the time from the producer's \
         Enqueue returning to a long-polling worker's Claim returning the intent (negative \
         samples, the worker first, count as 0); for outboxd's SDK workers `claim+ack` is per \
         intent, from its Claim sent to its Ack answered; `COMMIT → claim` the two-phase token's \
         latency as in `txn-latency`.",
        "**× outboxd**: the row's throughput divided by outboxd's for the same scenario. \
         **app CPU**: the outboxd server process (not the load generator), pgbench, or the \
         Node process (library and load generator together). **PG CPU**: every process of \
         the cluster. **commits**: `pg_stat_database.xact_commit` of the database (read-only transactions \
         included); **write txns**: transaction ids assigned in the cluster, each a commit \
         that flushes WAL; **WAL**: \
         `pg_current_wal_lsn` difference (cluster-wide). Each section starts after a \
         CHECKPOINT. Per 1k intents of the row.",
        ordered::NOTE,
        crate::console::NOTE,
    ] {
        println!("- {note}");
    }
}

/// VACUUM ANALYZE every table of the database at `url`.
pub(crate) async fn vacuum(url: &str) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::query("VACUUM ANALYZE").execute(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// ANALYZE every table of the database at `url` (see `AllArgs::no_analyze`).
pub async fn analyze(url: &str) -> anyhow::Result<()> {
    let mut conn = PgConnection::connect(url).await?;
    sqlx::query("ANALYZE").execute(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

async fn create_database(admin: &mut PgConnection, name: &str) -> anyhow::Result<()> {
    // Generated names, not input: nothing to inject.
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut *admin)
        .await
        .with_context(|| format!("CREATE DATABASE {name}"))?;
    Ok(())
}

/// A migrated outbox database with the service role and one producer and one worker key.
pub(crate) async fn prepare_outbox(
    cluster: &Cluster,
    admin: &mut PgConnection,
    base: &str,
) -> anyhow::Result<Target> {
    let database = base.to_owned();
    create_database(admin, &database).await?;
    let url = cluster.url(&database)?;
    let owner = startup::connect(&url, 2).await?;
    startup::migrate(&owner).await?;
    startup::grant_service_role(&owner, EMBEDDED_SERVICE_ROLE, true).await?;
    startup::grant_fleet_role(&owner, EMBEDDED_FLEET_ROLE, true).await?;
    let producer_key = create_key(&owner, "bench-producer", "produce").await?;
    let worker_key = create_key(&owner, "bench-worker", "consume").await?;
    owner.close().await;
    Ok(Target {
        owner_url: url.clone(),
        service_url: with_login(&url, Some(EMBEDDED_SERVICE_ROLE), &database)?,
        fleet_url: with_login(&url, Some(EMBEDDED_FLEET_ROLE), &database)?,
        database,
        producer_key,
        worker_key,
    })
}

/// One measured section against a fresh outboxd child: its figures, cost and row.
pub(crate) struct Section<'a> {
    meter: &'a Meter,
    target: &'a Target,
    server: ServerProcess,
    before: crate::meter::Snapshot,
    cpu_before: Option<f64>,
}

impl<'a> Section<'a> {
    /// Starts a server with `env` (see [`ServerProcess::spawn`]) and the meter.
    pub(crate) async fn start(
        meter: &'a Meter,
        target: &'a Target,
        env: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        let server = ServerProcess::spawn(&target.service_url, &target.fleet_url, env).await?;
        let before = meter.begin(&target.database).await?;
        let cpu_before = server.cpu();
        Ok(Self {
            meter,
            target,
            server,
            before,
            cpu_before,
        })
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.server.endpoint
    }

    /// Stops the server and returns the cost of the section.
    pub(crate) async fn finish(self) -> anyhow::Result<crate::meter::Cost> {
        let cpu = self.cpu_before.zip(self.server.cpu()).map(|(a, b)| b - a);
        self.server.stop().await?;
        let after = self.meter.end(&self.target.database).await?;
        Ok(self.before.cost_to(&after, cpu))
    }
}

/// Kind of every intent outboxd's scenarios enqueue.
pub(crate) const THROUGHPUT_KIND: &str = "bench.throughput";

/// Makes the `n`th intent a scenario enqueues.
pub(crate) type IntentMaker = dyn Fn(u64) -> v1::NewIntent + Send + Sync;

pub(crate) fn new_intent(n: u64) -> v1::NewIntent {
    v1::NewIntent {
        kind: THROUGHPUT_KIND.to_owned(),
        payload: format!("{{\"n\":{n},\"pad\":\"{}\"}}", "x".repeat(PAYLOAD_PAD)).into_bytes(),
        content_type: "application/json".to_owned(),
        ..Default::default()
    }
}

/// Scenarios 1 and 2: batched enqueue, one-per-call enqueue, then the burn-down of all.
async fn outboxd_throughput(
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    for (key, scenario, total, per_call, clients) in [
        (
            "enqueue-batch",
            format!("enqueue, batches of {MAX_BATCH}"),
            sizes.batched,
            MAX_BATCH as u64,
            sizes.batch_clients,
        ),
        (
            "enqueue-single",
            format!("enqueue, 1 per call, {} clients", sizes.single_clients),
            sizes.single,
            1,
            sizes.single_clients,
        ),
    ] {
        eprintln!("outboxd-bench: outboxd {scenario}");
        let section = Section::start(meter, target, &[]).await?;
        let t0 = Instant::now();
        let hist = enqueue_closed_loop(
            section.endpoint(),
            &target.producer_key,
            total,
            per_call,
            clients,
        )
        .await?;
        let seconds = t0.elapsed().as_secs_f64();
        let cost = section.finish().await?;
        rows.push(Row {
            system: "outboxd".to_owned(),
            key: key.to_owned(),
            scenario,
            intents: total,
            seconds,
            throughput: true,
            latency: Some(("call".to_owned(), hist)),
            cost: Some(cost),
            outcome: Outcome::Ran,
        });
    }

    let name = burn_down_name(sizes.workers, sizes.claim_batch);
    let total = sizes.batched + sizes.single;
    rows.push(outboxd_burn_down(meter, target, sizes, total, &[], "burn-down", name).await?);
    Ok(())
}

/// The burn-down again, on a database of its own filled as the first was, by a server
/// whose retention of finished intents is zero: its Ack deletes what it delivers
/// (`DeliveredRows::Deleted`).
async fn outboxd_burn_down_at_zero_retention(
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let total = sizes.batched + sizes.single;
    eprintln!("outboxd-bench: outboxd filling {total} for the burn-down at zero retention");
    let server = ServerProcess::spawn(&target.service_url, &target.fleet_url, &[]).await?;
    enqueue_closed_loop(
        &server.endpoint,
        &target.producer_key,
        total,
        MAX_BATCH as u64,
        sizes.batch_clients,
    )
    .await?;
    server.stop().await?;
    let name = zero_retention_name(sizes.workers, sizes.claim_batch);
    let env = [("OUTBOX_RETENTION__FINISHED", "0s")];
    let row =
        outboxd_burn_down(meter, target, sizes, total, &env, ZERO_RETENTION_KEY, name).await?;
    let mut owner = PgConnection::connect(&target.owner_url).await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.all_intents")
        .fetch_one(&mut owner)
        .await?;
    owner.close().await?;
    ensure!(left == 0, "the Acks at zero retention left {left} rows");
    rows.push(row);
    Ok(())
}

/// Row key of the burn-down at zero retention.
pub const ZERO_RETENTION_KEY: &str = "burn-down-zero-retention";

/// Drains the `total` pending intents of `target` through a server started with `env`.
pub(crate) async fn outboxd_burn_down(
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    total: u64,
    env: &[(&str, &str)],
    key: &str,
    scenario: String,
) -> anyhow::Result<Row> {
    if sizes.analyze {
        analyze(&target.owner_url).await?;
    }
    eprintln!("outboxd-bench: outboxd {scenario}");
    let section = Section::start(meter, target, env).await?;
    let t0 = Instant::now();
    let (endpoint, worker_key) = (section.endpoint(), &target.worker_key);
    let (drained, hist) = if sizes.plain_workers {
        let (workers, batch) = (sizes.workers, sizes.claim_batch);
        plain_workers::burn_down(endpoint, worker_key, THROUGHPUT_KIND, total, workers, batch)
            .await?
    } else {
        burn_down(
            endpoint,
            worker_key,
            total,
            sizes.workers,
            sizes.claim_batch,
        )
        .await?
    };
    let scenario = if sizes.plain_workers {
        format!("{scenario}, plain Claim → Ack workers")
    } else {
        scenario
    };
    let seconds = t0.elapsed().as_secs_f64();
    let cost = section.finish().await?;
    ensure!(
        drained == total,
        "burn-down acked {drained} of {total} intents"
    );
    Ok(Row {
        system: "outboxd".to_owned(),
        key: key.to_owned(),
        scenario,
        intents: drained,
        seconds,
        throughput: true,
        latency: Some(("claim+ack".to_owned(), hist)),
        cost: Some(cost),
        outcome: Outcome::Ran,
    })
}

pub fn burn_down_name(workers: usize, batch: u32) -> String {
    format!("burn-down, {workers} workers, batch {batch}")
}

pub fn zero_retention_name(workers: usize, batch: u32) -> String {
    format!(
        "{}, retention 0: Ack deletes",
        burn_down_name(workers, batch)
    )
}

/// `total` intents in calls of `per_call`, from `clients` closed loops each on its own
/// connection; returns the latency of the calls.
async fn enqueue_closed_loop(
    endpoint: &str,
    key: &str,
    total: u64,
    per_call: u64,
    clients: usize,
) -> anyhow::Result<Hist> {
    enqueue_closed_loop_of(
        endpoint,
        key,
        total,
        per_call,
        clients,
        Arc::new(new_intent),
    )
    .await
}

/// [`enqueue_closed_loop`] of the intents `make` makes.
pub(crate) async fn enqueue_closed_loop_of(
    endpoint: &str,
    key: &str,
    total: u64,
    per_call: u64,
    clients: usize,
    make: Arc<IntentMaker>,
) -> anyhow::Result<Hist> {
    let next = Arc::new(AtomicU64::new(0));
    let calls = total.div_ceil(per_call);
    let mut tasks = JoinSet::new();
    for _ in 0..clients {
        let mut client = connect_client(endpoint, key).await?;
        let (next, make) = (Arc::clone(&next), Arc::clone(&make));
        tasks.spawn(async move {
            let mut hist = Hist::new();
            loop {
                let call = next.fetch_add(1, Ordering::Relaxed);
                if call >= calls {
                    return anyhow::Ok(hist);
                }
                let first = call * per_call;
                let intents = (first..(first + per_call).min(total))
                    .map(|n| make(n))
                    .collect::<Vec<_>>();
                let n = intents.len();
                let t = Instant::now();
                let results = client
                    .enqueue(v1::EnqueueRequest {
                        intents,
                        txn_token: String::new(),
                    })
                    .await
                    .context("Enqueue")?
                    .into_inner()
                    .results;
                hist.record(t.elapsed());
                ensure!(
                    results.len() == n,
                    "Enqueue answered {} results",
                    results.len()
                );
            }
        });
    }
    merge(tasks).await
}

async fn merge(mut tasks: JoinSet<anyhow::Result<Hist>>) -> anyhow::Result<Hist> {
    let mut all = Hist::new();
    while let Some(h) = tasks.join_next().await {
        all.merge(&h??);
    }
    Ok(all)
}

/// Scenario 2: `workers` SDK workers with `batch` handler slots each, claiming `batch` at a
/// time, ack intents until `total` are acked (or none was for 10 s). Returns the acked
/// count and the latency from a Claim sent to the Ack of each of its intents.
async fn burn_down(
    endpoint: &str,
    key: &str,
    total: u64,
    workers: usize,
    batch: u32,
) -> anyhow::Result<(u64, Hist)> {
    let shape = Shape {
        workers,
        // Each Claim waits for the whole batch of free slots while the backlog lasts, as
        // the hand-written Claim(batch) → Ack(batch) loops before the SDK did.
        concurrency: batch as usize,
        claim_batch: batch as usize,
        wait: Duration::from_secs(1),
        replay_claims: true,
    };
    let (acked, _, cycles) = drain(endpoint, key, total, &shape).await?;
    Ok((acked, cycles))
}

/// Workers of `shape` ack intents until `total` are acked (or none was for 10 s). Returns
/// the acked count, when each intent was claimed, and the Claim + Ack cycles.
pub(crate) async fn drain(
    endpoint: &str,
    key: &str,
    total: u64,
    shape: &Shape,
) -> anyhow::Result<(u64, HashMap<String, Instant>, Hist)> {
    let running = Workers::start(endpoint, key, THROUGHPUT_KIND, shape)?;
    let (mut acked, mut progress) = (0, Instant::now());
    while acked < total && progress.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let now = running.acked();
        if now > acked {
            (acked, progress) = (now, Instant::now());
        }
    }
    let (claims, asked, got) = running.fill();
    eprintln!("outboxd-bench: {claims} Claims with leases, {asked:.1} asked and {got:.1} got each");
    let (claimed, cycles) = running.stop().await?;
    Ok((acked, claimed, cycles))
}

/// What one offered rate gave.
pub struct RateRun {
    pub sent: u64,
    pub claimed: u64,
    pub seconds: f64,
    pub behind: u64,
    pub hist: Hist,
}

impl RateRun {
    /// Whether the sends of a `window`-second run kept up: the last was answered within
    /// the window stretched by `1 / SUSTAINED_SHARE` (a producer that none dropped can still
    /// have sent at a fraction of the rate, each send waiting for the one before).
    fn on_time(&self, window: f64) -> bool {
        self.seconds * SUSTAINED_SHARE <= window
    }

    fn sustainable(&self, offered: u64, window: f64) -> bool {
        self.behind == 0
            && self.on_time(window)
            && self.sent as f64 >= SUSTAINED_SHARE * offered as f64
            && self.claimed == self.sent
            && self.hist.ms(0.99) <= SUSTAINED_P99_MS
    }

    /// The table row of `system` at `rate`/s for `seconds` (`context` says what else was
    /// going on), and whether the rate was sustained; the same judgement for every system.
    pub fn row(
        self,
        system: &str,
        rate: u32,
        seconds: f64,
        context: &str,
        cost: Cost,
    ) -> (Row, bool) {
        let offered = (f64::from(rate) * seconds).round() as u64;
        let ok = self.sustainable(offered, seconds);
        let late = if self.behind > 0 {
            format!(", {} sends dropped: {MAX_IN_FLIGHT} in flight", self.behind)
        } else if !self.on_time(seconds) {
            format!(", {seconds} s of sends took {:.1} s", self.seconds)
        } else {
            String::new()
        };
        let row = Row {
            system: system.to_owned(),
            key: format!("rate-{rate}"),
            scenario: format!(
                "enqueue → claim at {rate}/s offered{context} ({}{late})",
                if ok { "sustained" } else { "NOT sustained" },
            ),
            intents: self.claimed,
            seconds: self.seconds,
            throughput: true,
            latency: Some(("enqueue OK → claim".to_owned(), self.hist)),
            cost: Some(cost),
            outcome: Outcome::Ran,
        };
        (row, ok)
    }
}

/// Scenario 4 at the fixed rates, then (full runs) doubling from 2000/s until a rate is
/// not sustainable; the highest sustainable one of the search gets its own row.
async fn outboxd_rates(
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    // A steady state, not the aftermath of the burn-down: otherwise autovacuum cleans up
    // its 200k updated rows during the first rates and takes a core from them.
    vacuum(&target.owner_url).await?;
    for &rate in &sizes.rates {
        let (row, _) = rate_row(meter, target, sizes, rate, sizes.rate_seconds, "").await?;
        rows.push(row);
    }
    if !sizes.search {
        return Ok(());
    }
    let mut best = None;
    let mut rate = 2000;
    while rate <= 256_000 {
        let (mut row, ok) = rate_row(meter, target, sizes, rate, sizes.rate_seconds, "").await?;
        if !ok {
            row.key = "rate-fail".to_owned();
            rows.push(best.take().unwrap_or_else(|| {
                Row::not_run(
                    "outboxd",
                    "rate-max",
                    "highest sustainable rate",
                    format!("{rate}/s was not sustained"),
                )
            }));
            rows.push(row);
            return Ok(());
        }
        row.key = "rate-max".to_owned();
        row.scenario = format!("highest sustainable: {}", row.scenario);
        best = Some(row);
        rate *= 2;
    }
    rows.extend(best);
    Ok(())
}

/// One offered rate on a fresh server: its row, and whether it was sustained.
async fn rate_row(
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    rate: u32,
    seconds: f64,
    context: &str,
) -> anyhow::Result<(Row, bool)> {
    eprintln!("outboxd-bench: outboxd enqueue → claim at {rate}/s{context}");
    let section = Section::start(meter, target, &[]).await?;
    let run = fixed_rate(
        section.endpoint(),
        target,
        rate,
        seconds,
        sizes.rate_workers(),
    )
    .await?;
    let cost = section.finish().await?;
    Ok(run.row("outboxd", rate, seconds, context, cost))
}

/// Scenario 6: the 1000/s enqueue → claim run again with a large finished history in the
/// table, then again while an idle-in-transaction session pins xmin (so no row version the
/// run makes dead can be pruned or vacuumed): the claim must not fall off a cliff.
async fn history_and_pinned_xmin(
    cluster: &Cluster,
    meter: &Meter,
    target: &Target,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let url = cluster.url(&target.database)?;
    let mut owner = PgConnection::connect(&url).await?;
    eprintln!(
        "outboxd-bench: inserting {} finished intents",
        sizes.history
    );
    sqlx::query(
        r#"
        INSERT INTO outbox.intent (id, tenant_id, kind, payload, content_type, state, attempts,
                                   max_attempts, available_at, created_at, updated_at,
                                   finished_at, lease_id, worker_id, level_key)
        SELECT gen_random_uuid(), 'bench', 'bench.history',
               convert_to('{"n":' || g || ',"pad":"' || repeat('x', 48) || '"}', 'UTF8'),
               'application/json', 'delivered', 1, 5, t, t, t, t, gen_random_uuid(), 'history',
               hashtextextended('bench/bench.history', 0)
        FROM generate_series(1, $1::bigint) AS g,
             LATERAL (SELECT now() - interval '1 hour' AS t) AS at
        "#,
    )
    .bind(sizes.history as i64)
    .execute(&mut owner)
    .await
    .context("inserting the finished history")?;
    // As autovacuum would have left a table that grew this way.
    sqlx::query("VACUUM ANALYZE outbox.intent")
        .execute(&mut owner)
        .await?;
    let history = format!(", {} finished rows", sizes.history);
    owner.close().await?;
    let (mut row, _) = rate_row(meter, target, sizes, 1000, sizes.rate_seconds, &history).await?;
    row.key = "history".to_owned();
    rows.push(row);

    // A REPEATABLE READ snapshot taken and held: the session sits idle in transaction.
    // Named, so that the meter does not wait for it to leave (see `Meter::quiesce`).
    let options: sqlx::postgres::PgConnectOptions = url.parse()?;
    let mut pin =
        PgConnection::connect_with(&options.application_name(crate::meter::OWN_SESSIONS)).await?;
    sqlx::query("BEGIN ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut pin)
        .await?;
    sqlx::query("SELECT count(*) FROM outbox.intent WHERE false")
        .execute(&mut pin)
        .await?;
    let context = format!("{history} + xmin pinned by an idle transaction");
    let result = rate_row(meter, target, sizes, 1000, sizes.pinned_seconds, &context).await;
    sqlx::query("ROLLBACK").execute(&mut pin).await?;
    pin.close().await?;
    let (mut row, _) = result?;
    row.key = "pinned".to_owned();
    rows.push(row);
    Ok(())
}

/// Producers send one intent per Enqueue at `rate`/s (open loop: each send at its
/// scheduled instant, whatever the previous answers) for `seconds`; `workers` long-poll
/// Claim (up to 100) and ack in the background. Latency: Enqueue returned → Claim
/// returned, joined by intent id.
async fn fixed_rate(
    endpoint: &str,
    target: &Target,
    rate: u32,
    seconds: f64,
    workers: usize,
) -> anyhow::Result<RateRun> {
    let (run, _) = fixed_rate_of(endpoint, target, rate, seconds, workers, &new_intent).await?;
    Ok(run)
}

/// [`fixed_rate`] of the intents `make` makes; also returns the latencies of the intents
/// without an ordering key and of those with one, apart.
pub(crate) async fn fixed_rate_of(
    endpoint: &str,
    target: &Target,
    rate: u32,
    seconds: f64,
    workers: usize,
    make: &IntentMaker,
) -> anyhow::Result<(RateRun, [Hist; 2])> {
    // Plain long polls, as a latency-minded worker would run: an Enqueue hands its
    // intents to a waiting Claim.
    let shape = Shape {
        workers,
        concurrency: RATE_CLAIM_MAX as usize,
        claim_batch: RATE_CLAIM_MAX as usize,
        wait: Duration::from_millis(200),
        replay_claims: false,
    };
    let running = Workers::start(endpoint, &target.worker_key, THROUGHPUT_KIND, &shape)?;
    let mut producers = Vec::new();
    for _ in 0..8 {
        producers.push(connect_client(endpoint, &target.producer_key).await?);
    }
    let offered = (f64::from(rate) * seconds).round() as u64;
    let sent: Arc<Mutex<Vec<(String, Instant, bool)>>> = Arc::default();
    let in_flight = Arc::new(AtomicU64::new(0));
    let mut behind = 0;
    let mut sends = JoinSet::new();
    let start = Instant::now();
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    for k in 0..offered {
        let due = start + period.mul_f64(k as f64);
        tokio::time::sleep_until(due.into()).await;
        if in_flight.load(Ordering::Relaxed) >= MAX_IN_FLIGHT as u64 {
            behind += 1;
            continue;
        }
        in_flight.fetch_add(1, Ordering::Relaxed);
        let mut client = producers[k as usize % producers.len()].clone();
        let (sent, in_flight) = (Arc::clone(&sent), Arc::clone(&in_flight));
        let intent = make(k);
        let ordered = !intent.ordering_key.is_empty();
        sends.spawn(async move {
            let result = client
                .enqueue(v1::EnqueueRequest {
                    intents: vec![intent],
                    txn_token: String::new(),
                })
                .await;
            let t = Instant::now();
            in_flight.fetch_sub(1, Ordering::Relaxed);
            let id = result
                .context("Enqueue")?
                .into_inner()
                .results
                .first()
                .map(|r| r.id.clone())
                .context("Enqueue answered no result")?;
            sent.lock().await.push((id, t, ordered));
            anyhow::Ok(())
        });
    }
    while let Some(r) = sends.join_next().await {
        r??;
    }
    let seconds = start.elapsed().as_secs_f64();
    let sent_count = sent.lock().await.len() as u64;
    let deadline = Instant::now() + DRAIN_TIMEOUT;
    while (running.claimed() as u64) < sent_count && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (claimed, _) = running.stop().await?;
    let mut hist = Hist::new();
    let mut apart = [Hist::new(), Hist::new()];
    let mut matched = 0;
    for (id, t_ok, ordered) in sent.lock().await.iter() {
        if let Some(t_claim) = claimed.get(id) {
            let ms = txn_latency::signed_ms(*t_ok, *t_claim);
            hist.record_signed_ms(ms);
            apart[usize::from(*ordered)].record_signed_ms(ms);
            matched += 1;
        }
    }
    let run = RateRun {
        sent: sent_count,
        claimed: matched,
        seconds,
        behind,
        hist,
    };
    Ok((run, apart))
}

/// Scenario 5: the `txn-latency` measurement (in-process server, as that command runs
/// it), same database and direct baseline, as rows of the table.
async fn commit_to_claimable(
    cluster: &Cluster,
    settings: &Settings,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) -> anyhow::Result<()> {
    let bench = Bench::start(cluster, settings.clone()).await?;
    let settle = Duration::from_millis(10);
    let measured = async {
        for (key, name, producer, what) in [
            (
                "txn-same",
                "commit → claimable, two-phase token, same database",
                Producer::SameDatabase,
                "COMMIT → claim",
            ),
            (
                "txn-direct",
                "enqueue → claim, direct, one at a time (baseline)",
                Producer::Direct,
                "enqueue OK → claim",
            ),
        ] {
            eprintln!(
                "outboxd-bench: outboxd {name} ({} + {WARMUP} warm-up)",
                sizes.txn_iterations
            );
            let scenario = Scenario {
                name,
                producer,
                iterations: sizes.txn_iterations,
            };
            let samples = txn_latency::measure_txn(&bench, &scenario, settle).await?;
            let mut hist = Hist::new();
            for s in &samples {
                hist.record_signed_ms(*s);
            }
            rows.push(Row {
                system: "outboxd".to_owned(),
                key: key.to_owned(),
                scenario: name.to_owned(),
                intents: samples.len() as u64,
                seconds: 0.0,
                throughput: false,
                latency: Some((what.to_owned(), hist)),
                cost: None,
                outcome: Outcome::Ran,
            });
        }
        anyhow::Ok(())
    }
    .await;
    let stopped = bench.stop().await;
    measured?;
    stopped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(sent: u64, seconds: f64, behind: u64) -> RateRun {
        let mut hist = Hist::new();
        for _ in 0..sent {
            hist.record_us(2_000);
        }
        RateRun {
            sent,
            claimed: sent,
            seconds,
            behind,
            hist,
        }
    }

    #[test]
    fn a_rate_sent_on_time_and_claimed_quickly_is_sustained() {
        assert!(run(10_000, 10.02, 0).sustainable(10_000, 10.0));
    }

    #[test]
    fn a_rate_whose_sends_took_five_times_the_window_is_not_sustained_though_none_dropped() {
        let slow = run(1_000, 5.0, 0);
        assert!(!slow.sustainable(1_000, 1.0));
        let cost = Cost::default();
        let (row, ok) = slow.row("peer", 1000, 1.0, "", cost);
        assert!(!ok);
        assert!(
            row.scenario.contains("1 s of sends took 5.0 s"),
            "{}",
            row.scenario
        );
    }

    #[test]
    fn a_rate_with_dropped_sends_is_not_sustained() {
        assert!(!run(9_000, 10.0, 1_000).sustainable(10_000, 10.0));
    }
}
