//! The peers of `all` on the same cluster: a raw-SQL ceiling with `pgbench -f` (the same
//! claim and ack statements and batch sizes, no service in between) with the issue's
//! minimal reference loop beside it, and graphile-worker and pg-boss through
//! `bench/peer.js`. A peer that cannot run gets a "not run: reason"
//! row, never a figure.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use rustix::process::{Pid, WaitId, WaitIdOptions, waitid};
use serde::Deserialize;
use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use outboxd::outbox::store;

use crate::meter::{Cost, Meter};
use crate::report::{Hist, Outcome, Row};
use crate::suite::{
    AllArgs, RATE_CLAIM_MAX, RateRun, Sizes, ZERO_RETENTION_KEY, analyze, burn_down_name,
    zero_retention_name,
};

/// Enqueue batch size of every system (outboxd's largest Enqueue).
const ENQUEUE_BATCH: u64 = 1000;

const RAW: &str = "raw SQL (pgbench)";

/// The three throughput scenarios, in the order they run (the burn-down drains what the
/// two enqueue scenarios left).
fn scenarios(s: &Sizes) -> [(&'static str, String); 3] {
    [
        (
            "enqueue-batch",
            format!("enqueue, batches of {ENQUEUE_BATCH}"),
        ),
        (
            "enqueue-single",
            format!("enqueue, 1 per call, {} clients", s.single_clients),
        ),
        ("burn-down", burn_down_name(s.workers, s.claim_batch)),
    ]
}

fn find_pgbench(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_owned());
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("pgbench"));
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/pgbench"));
    on_path.chain(debian).find(|p| p.is_file())
}

/// The raw-SQL ceiling: enqueue (batched, one per transaction), burn-down (and again at
/// retention zero, with the deleting ack), and the minimal queue.
pub async fn pgbench(
    args: &AllArgs,
    meter: &Meter,
    url: &str,
    database: &str,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) {
    let Some(bin) = find_pgbench(args.pgbench.as_deref()) else {
        not_run_all(sizes, rows, "no pgbench binary found");
        return;
    };
    let scripts = args.bench_dir.join("pgbench");
    let enqueue = scripts.join("enqueue.sql");
    let claim_ack = std::env::temp_dir().join(format!(
        "outboxd-bench-claim-ack-{}.sql",
        std::process::id()
    ));
    let claim_delete = claim_ack.with_extension("delete.sql");
    if let Err(e) = std::fs::write(&claim_ack, claim_ack_script(store::ACK_CALL))
        .and_then(|()| std::fs::write(&claim_delete, claim_ack_script(store::ACK_AND_DELETE_CALL)))
    {
        not_run_all(
            sizes,
            rows,
            &format!("cannot write the pgbench scripts: {e}"),
        );
        return;
    }
    let raw = Raw {
        bin: &bin,
        meter,
        url,
        database,
        sizes,
    };
    for (key, name) in scenarios(sizes) {
        let (script, work) = match key {
            "enqueue-batch" => (
                &enqueue,
                Work::Enqueue {
                    batch: ENQUEUE_BATCH,
                    clients: sizes.batch_clients,
                    total: sizes.batched,
                },
            ),
            "enqueue-single" => (
                &enqueue,
                Work::Enqueue {
                    batch: 1,
                    clients: sizes.single_clients,
                    total: sizes.single,
                },
            ),
            _ => (&claim_ack, Work::BurnDown),
        };
        eprintln!("outboxd-bench: pgbench {name}");
        rows.push(
            raw.run(script, work, key, &name).await.unwrap_or_else(|e| {
                Row::not_run(RAW, key, &name, format!("pgbench failed: {e:#}"))
            }),
        );
    }
    // outboxd's burn-down at zero retention: the same claim, and an Ack that deletes.
    let name = zero_retention_name(sizes.workers, sizes.claim_batch);
    eprintln!("outboxd-bench: pgbench {name}");
    let refill = Work::Enqueue {
        batch: ENQUEUE_BATCH,
        clients: sizes.batch_clients,
        total: sizes.batched + sizes.single,
    };
    let run = async {
        // Fresh, as outboxd's database for it is: not behind the first burn-down's dead
        // index entries.
        let mut conn = PgConnection::connect(url).await?;
        sqlx::query("TRUNCATE outbox.intent, outbox.delivered_batch")
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        raw.run(&enqueue, refill, "refill", &name).await?;
        raw.run(&claim_delete, Work::BurnDown, ZERO_RETENTION_KEY, &name)
            .await
    };
    rows.push(run.await.unwrap_or_else(|e| {
        Row::not_run(
            RAW,
            ZERO_RETENTION_KEY,
            &name,
            format!("pgbench failed: {e:#}"),
        )
    }));
    let name = burn_down_name(sizes.workers, sizes.claim_batch);
    eprintln!("outboxd-bench: pgbench {name}, minimal queue");
    let script = scripts.join("minimal_queue.sql");
    rows.push(
        minimal_queue(&bin, meter, url, database, sizes, &script, &name)
            .await
            .unwrap_or_else(|e| {
                Row::not_run(
                    MINIMAL,
                    "burn-down",
                    &name,
                    format!("pgbench failed: {e:#}"),
                )
            }),
    );
}

/// Every row [`pgbench`] makes, not run, for `why`.
fn not_run_all(sizes: &Sizes, rows: &mut Vec<Row>, why: &str) {
    for (key, name) in scenarios(sizes) {
        rows.push(Row::not_run(RAW, key, &name, why));
    }
    let zero = zero_retention_name(sizes.workers, sizes.claim_batch);
    rows.push(Row::not_run(RAW, ZERO_RETENTION_KEY, &zero, why));
    let name = burn_down_name(sizes.workers, sizes.claim_batch);
    rows.push(Row::not_run(MINIMAL, "burn-down", &name, why));
}

/// What one pgbench run does.
#[derive(Clone, Copy)]
enum Work {
    /// `total` intents, `batch` per transaction, from `clients` clients.
    Enqueue {
        batch: u64,
        clients: usize,
        total: u64,
    },
    /// Claims and acks every pending intent, as outboxd's burn-down does.
    BurnDown,
}

/// pgbench on the raw-SQL database.
struct Raw<'a> {
    bin: &'a Path,
    meter: &'a Meter,
    url: &'a str,
    database: &'a str,
    sizes: &'a Sizes,
}

impl Raw<'_> {
    /// Runs `script` doing `work`, measured, as a row of `key`.
    async fn run(&self, script: &Path, work: Work, key: &str, name: &str) -> anyhow::Result<Row> {
        let pending_before = count(self.url, "pending").await?;
        let (batch, clients, per_client) = match work {
            Work::Enqueue {
                batch,
                clients,
                total,
            } => (batch, clients, total.div_ceil(batch * clients as u64)),
            // Whole transactions per client, sized on what is pending, with one more
            // round, whose claims come back empty, so that none is left.
            Work::BurnDown => {
                if self.sizes.analyze {
                    analyze(self.url).await?;
                }
                let (batch, clients) = (u64::from(self.sizes.claim_batch), self.sizes.workers);
                (
                    batch,
                    clients,
                    pending_before.div_ceil(batch * clients as u64) + 1,
                )
            }
        };
        let before = self.meter.begin(self.database).await?;
        let t0 = Instant::now();
        let (hist, cpu) =
            run_pgbench(self.bin, self.url, script, clients, per_client, batch).await?;
        let seconds = t0.elapsed().as_secs_f64();
        let after = self.meter.end(self.database).await?;
        let pending_after = count(self.url, "pending").await?;
        let burn_down = matches!(work, Work::BurnDown);
        let intents = if burn_down {
            ensure!(
                pending_after == 0,
                "the burn-down left {pending_after} intents pending"
            );
            pending_before
        } else {
            pending_after - pending_before
        };
        Ok(Row {
            system: RAW.to_owned(),
            key: key.to_owned(),
            scenario: name.to_owned(),
            intents,
            seconds,
            throughput: true,
            latency: Some((
                if burn_down { "claim+ack" } else { "call" }.to_owned(),
                hist,
            )),
            cost: Some(before.cost_to(&after, cpu)),
            outcome: Outcome::Ran,
        })
    }
}

const MINIMAL: &str = "raw SQL (pgbench), minimal queue: delete on ack, no history";

/// The reference loop on this machine, in the raw-SQL database: as many jobs as
/// outboxd's burn-down drains, in a graphile-style table (`bench/pgbench/minimal_queue.sql`
/// says what it leaves out), claimed in batches and deleted. Not a ceiling of outboxd's
/// statements: it tells how this machine compares with the one the reference
/// figures came from.
async fn minimal_queue(
    bin: &Path,
    meter: &Meter,
    url: &str,
    database: &str,
    sizes: &Sizes,
    script: &Path,
    name: &str,
) -> anyhow::Result<Row> {
    let jobs = sizes.batched + sizes.single;
    let batch = u64::from(sizes.claim_batch);
    let mut conn = PgConnection::connect(url).await?;
    for statement in [
        "DROP SCHEMA IF EXISTS minimal CASCADE",
        "CREATE SCHEMA minimal",
        "CREATE TABLE minimal.job (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            payload bytea NOT NULL,
            run_at timestamptz NOT NULL DEFAULT now(),
            attempts int NOT NULL DEFAULT 0,
            locked_at timestamptz,
            locked_by text
        )",
        "CREATE INDEX job_ready_idx ON minimal.job (run_at, id) WHERE locked_at IS NULL",
    ] {
        sqlx::query(statement).execute(&mut conn).await?;
    }
    // The payload of the other scenarios (bench/pgbench/enqueue.sql).
    sqlx::query(
        "INSERT INTO minimal.job (payload) \
         SELECT convert_to('{\"n\":' || g || ',\"pad\":\"' || repeat('x', 48) || '\"}', 'UTF8') \
         FROM generate_series(1, $1) AS g",
    )
    .bind(jobs as i64)
    .execute(&mut conn)
    .await?;
    sqlx::query("ANALYZE minimal.job")
        .execute(&mut conn)
        .await?;
    let per_client = jobs.div_ceil(batch * sizes.workers as u64) + 1;
    let before = meter.begin(database).await?;
    let t0 = Instant::now();
    let (hist, cpu) = run_pgbench(bin, url, script, sizes.workers, per_client, batch).await?;
    let seconds = t0.elapsed().as_secs_f64();
    let after = meter.end(database).await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM minimal.job")
        .fetch_one(&mut conn)
        .await?;
    ensure!(left == 0, "the minimal queue left {left} jobs");
    sqlx::query("DROP SCHEMA minimal CASCADE")
        .execute(&mut conn)
        .await?;
    conn.close().await?;
    Ok(Row {
        system: MINIMAL.to_owned(),
        key: "burn-down".to_owned(),
        scenario: name.to_owned(),
        intents: jobs,
        seconds,
        throughput: true,
        latency: Some(("claim+ack".to_owned(), hist)),
        cost: Some(before.cost_to(&after, cpu)),
        outcome: Outcome::Ran,
    })
}

/// The raw-SQL ceiling of the burn-down: one Claim and one Ack as the server runs them,
/// built from the store's own calls so that the two cannot drift apart: each one statement
/// in its own transaction, for the tenant `bench`; no kind or region filter, a 30 s lease,
/// no floor (every claim looks at the whole queue; see `outboxd::outbox::claim::floor`).
/// One difference, on purpose: the claimed rows are aggregated into two arrays (pgbench's
/// `\gset` takes one row), so payloads are not shipped to the client. Variables:
/// `-D batch=N`.
fn claim_ack_script(ack_call: &str) -> String {
    let claim = bind_literals(
        store::CLAIM_CALL,
        &[
            "'bench'",
            "'off'",
            "'pgbench'",
            "''",
            "'{}'",
            ":batch",
            "30000",
            "NULL",
            "NULL",
            "'{}'",
            "'{}'",
            "'{}'",
            "'{}'",
            "4194304",
        ],
    );
    let ack = bind_literals(
        ack_call,
        &["'bench'", "'off'", "(:ids)", "(:leases)", "NULL"],
    );
    format!(
        "SELECT coalesce(array_agg(id), '{{}}')::text AS ids, \
         coalesce(array_agg(lease_id), '{{}}')::text AS leases FROM {claim} \\gset\n\
         SELECT count(*) FROM {ack};\n"
    )
}

/// `sql` with each placeholder `$n` replaced by `values[n - 1]`.
fn bind_literals(sql: &str, values: &[&str]) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - at - 1);
        match rest[at + 1..at + 1 + digits].parse::<usize>() {
            Ok(n) if (1..=values.len()).contains(&n) => out.push_str(values[n - 1]),
            _ => out.push_str(&rest[at..at + 1 + digits]),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// Intents in `state` in the raw-SQL database.
async fn count(url: &str, state: &str) -> anyhow::Result<u64> {
    let mut conn = PgConnection::connect(url).await?;
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox.intent WHERE state::text = $1")
        .bind(state)
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(n as u64)
}

/// Runs pgbench with per-transaction logging; returns the transaction latencies and the
/// CPU seconds pgbench used (from wait4's rusage).
async fn run_pgbench(
    bin: &Path,
    url: &str,
    script: &Path,
    clients: usize,
    transactions: u64,
    batch: u64,
) -> anyhow::Result<(Hist, Option<f64>)> {
    let logs = std::env::temp_dir().join(format!(
        "outboxd-bench-pgbench-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&logs)?;
    let threads = if clients.is_multiple_of(2) { 2 } else { 1 };
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["-n", "-M", "prepared", "-l", "--log-prefix"])
        .arg(logs.join("tx"))
        .arg("-c")
        .arg(clients.to_string())
        .arg("-j")
        .arg(threads.to_string())
        .arg("-t")
        .arg(transactions.to_string())
        .arg("-D")
        .arg(format!("batch={batch}"))
        .arg("-f")
        .arg(script)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let (status, output, cpu) = tokio::task::spawn_blocking(move || run_counting_cpu(cmd))
        .await?
        .context("cannot run pgbench")?;
    if !status.success() || output.contains("aborted") {
        bail!("{status}: {}", output.trim());
    }
    let mut hist = Hist::new();
    for entry in std::fs::read_dir(&logs)?.flatten() {
        let text = std::fs::read_to_string(entry.path())?;
        // client_id transaction_no time(µs) script_no time_epoch time_us
        for line in text.lines() {
            if let Some(us) = line.split_whitespace().nth(2).and_then(|f| f.parse().ok()) {
                hist.record_us(us);
            }
        }
    }
    std::fs::remove_dir_all(&logs)?;
    Ok((hist, Some(cpu)))
}

/// Runs `cmd` to completion, returning its status, stdout + stderr, and its CPU seconds.
fn run_counting_cpu(
    mut cmd: std::process::Command,
) -> anyhow::Result<(std::process::ExitStatus, String, f64)> {
    let mut child = cmd.spawn()?;
    let mut stderr = child.stderr.take().expect("piped");
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let mut out = String::new();
    child
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut out)?;
    let err = err_thread.join().unwrap_or_default();
    // Wait for the exit without reaping, so that /proc still holds the child's CPU times:
    // its own and its reaped children's, what wait4 would report.
    let pid = Pid::from_child(&child);
    while let Err(e) = waitid(
        WaitId::Pid(pid),
        WaitIdOptions::EXITED | WaitIdOptions::NOWAIT,
    ) {
        ensure!(e == rustix::io::Errno::INTR, "waitid: {e}");
    }
    let cpu = crate::meter::exited_cpu(child.id()).context("reading the peer's CPU time")?;
    Ok((child.wait()?, format!("{out}{err}"), cpu))
}

/// What `bench/peer.js` prints at the end of a run.
#[derive(Deserialize)]
struct PeerResult {
    n: u64,
    seconds: f64,
    cpu_seconds: f64,
    latencies_us: Vec<u64>,
    /// Fixed-rate scenario: jobs sent, and sends dropped for too many in flight.
    #[serde(default)]
    sent: u64,
    #[serde(default)]
    behind: u64,
}

/// graphile-worker or pg-boss: the three throughput scenarios, then the fixed rates,
/// through `bench/peer.js`.
pub async fn node(
    args: &AllArgs,
    meter: &Meter,
    system: &str,
    url: &str,
    database: &str,
    sizes: &Sizes,
    rows: &mut Vec<Row>,
) {
    let script = args.bench_dir.join("peer.js");
    let node_bin = node_binary(args);
    let missing = if !args.bench_dir.join("node_modules").join(system).is_dir() {
        Some(format!(
            "{system} not installed (npm ci --prefix {})",
            args.bench_dir.display()
        ))
    } else if std::process::Command::new(&node_bin)
        .arg("--version")
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        Some(format!("no Node.js at {}", node_bin.display()))
    } else {
        None
    };
    let mut failed = None;
    for (key, name) in scenarios(sizes) {
        if let Some(why) = missing.as_ref().or(failed.as_ref()) {
            rows.push(Row::not_run(system, key, &name, why.clone()));
            continue;
        }
        let (n, clients, batch) = match key {
            "enqueue-batch" => (sizes.batched, sizes.batch_clients, ENQUEUE_BATCH),
            "enqueue-single" => (sizes.single, sizes.single_clients, 1),
            _ => (
                sizes.batched + sizes.single,
                sizes.workers,
                u64::from(sizes.claim_batch),
            ),
        };
        eprintln!("outboxd-bench: {system} {name}");
        let peer_args = PeerArgs {
            node: &node_bin,
            script: &script,
            system,
            scenario: key,
            url,
            n,
            clients,
            batch,
            rate: 0,
            variant: Variant::default(),
        };
        if key == "burn-down"
            && sizes.analyze
            && let Err(e) = analyze(url).await
        {
            rows.push(Row::not_run(
                system,
                key,
                &name,
                format!("ANALYZE failed: {e:#}"),
            ));
            continue;
        }
        match run_peer(meter, database, &peer_args).await {
            Ok((result, cost)) => {
                let mut hist = Hist::new();
                for us in &result.latencies_us {
                    hist.record_us(*us);
                }
                let what = if key == "burn-down" {
                    "claim+ack"
                } else {
                    "call"
                };
                rows.push(Row {
                    system: system.to_owned(),
                    key: key.to_owned(),
                    scenario: name,
                    intents: result.n,
                    seconds: result.seconds,
                    throughput: true,
                    latency: (!result.latencies_us.is_empty()).then(|| (what.to_owned(), hist)),
                    cost: Some(cost),
                    outcome: Outcome::Ran,
                });
            }
            Err(e) => {
                // A later scenario depends on the earlier ones' intents: stop here.
                let why = format!("{system} failed: {e:#}");
                rows.push(Row::not_run(system, key, &name, why.clone()));
                failed = Some("an earlier scenario failed".to_owned());
            }
        }
    }
    // The fixed rates run on the queue the burn-down emptied, whatever it gave, twice: each
    // library has two documented ways to run its workers and neither is best at both rates.
    // graphile-worker: jobs fetched one at a time on each LISTEN/NOTIFY wake-up (its lowest
    // latency), and through its local queue (fetched in batches, as outboxd's workers claim
    // them). pg-boss: polling (its default) and LISTEN/NOTIFY (`useListenNotify` and the
    // queue's `notify`), whose NOTIFY in every send serializes concurrent commits.
    let local_queue = format!("{system}, local queue {RATE_CLAIM_MAX}");
    let listen_notify = format!("{system}, LISTEN/NOTIFY");
    let variants: [(&str, Variant); 2] = if system == "graphile-worker" {
        [
            (system, Variant::default()),
            (
                &local_queue,
                Variant {
                    local_queue: u64::from(RATE_CLAIM_MAX),
                    notify: false,
                },
            ),
        ]
    } else {
        [
            (system, Variant::default()),
            (
                &listen_notify,
                Variant {
                    local_queue: 0,
                    notify: true,
                },
            ),
        ]
    };
    for (label, variant) in variants {
        for &rate in &sizes.rates {
            let key = format!("rate-{rate}");
            let name = format!("enqueue → claim at {rate}/s offered");
            if let Some(why) = &missing {
                rows.push(Row::not_run(label, &key, &name, why.clone()));
                continue;
            }
            eprintln!("outboxd-bench: {label} {name}");
            let peer_args = PeerArgs {
                node: &node_bin,
                script: &script,
                system,
                scenario: "rate",
                url,
                n: (f64::from(rate) * sizes.rate_seconds).round() as u64,
                clients: sizes.rate_workers(),
                batch: u64::from(RATE_CLAIM_MAX),
                rate,
                variant,
            };
            match run_peer(meter, database, &peer_args).await {
                Ok((result, cost)) => {
                    let mut hist = Hist::new();
                    for us in &result.latencies_us {
                        hist.record_us(*us);
                    }
                    let run = RateRun {
                        sent: result.sent,
                        claimed: result.n,
                        seconds: result.seconds,
                        behind: result.behind,
                        hist,
                    };
                    rows.push(run.row(label, rate, sizes.rate_seconds, "", cost).0);
                }
                Err(e) => rows.push(Row::not_run(
                    label,
                    &key,
                    &name,
                    format!("{label} failed: {e:#}"),
                )),
            }
        }
    }
}

/// The Node.js binary for `bench/peer.js`: `--node`, else the one bench/package.json
/// installs (graphile-worker and pg-boss require Node 22 or later), else `node` on PATH.
fn node_binary(args: &AllArgs) -> PathBuf {
    if let Some(node) = &args.node {
        return node.clone();
    }
    let bundled = args.bench_dir.join("node_modules/.bin/node");
    if bundled.is_file() {
        bundled
    } else {
        PathBuf::from("node")
    }
}

/// What the npm peers run on, for the report: each library's installed version and
/// Node's, or why they are unknown.
pub fn versions(args: &AllArgs) -> String {
    let installed = |package: &str| -> String {
        let manifest = args
            .bench_dir
            .join("node_modules")
            .join(package)
            .join("package.json");
        std::fs::read_to_string(manifest)
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|json| json["version"].as_str().map(|v| format!("{package} {v}")))
            .unwrap_or_else(|| format!("{package} not installed"))
    };
    let node = node_binary(args);
    let node_version = std::process::Command::new(&node)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|| "not found".to_owned());
    format!(
        "{}, {} on Node {node_version} ({})",
        installed("graphile-worker"),
        installed("pg-boss"),
        node.display()
    )
}

struct PeerArgs<'a> {
    node: &'a Path,
    script: &'a Path,
    system: &'a str,
    scenario: &'a str,
    url: &'a str,
    n: u64,
    clients: usize,
    batch: u64,
    /// Offered jobs per second of the `rate` scenario (0 for the others).
    rate: u32,
    variant: Variant,
}

/// How a peer runs its workers in the `rate` scenario, where it has two documented ways.
#[derive(Clone, Copy, Default)]
struct Variant {
    /// graphile-worker's local queue size (0: none).
    local_queue: u64,
    /// pg-boss with LISTEN/NOTIFY instead of polling alone.
    notify: bool,
}

async fn run_peer(
    meter: &Meter,
    database: &str,
    a: &PeerArgs<'_>,
) -> anyhow::Result<(PeerResult, Cost)> {
    let mut child = tokio::process::Command::new(a.node)
        .arg(a.script)
        .args([a.system, a.scenario, "--url", a.url])
        .args(["--n", &a.n.to_string()])
        .args(["--concurrency", &a.clients.to_string()])
        .args(["--batch", &a.batch.to_string()])
        .args(["--rate", &a.rate.to_string()])
        .args(["--local-queue", &a.variant.local_queue.to_string()])
        .args(["--notify", if a.variant.notify { "1" } else { "0" }])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("cannot start node")?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let mut next_line = async || -> anyhow::Result<String> {
        tokio::time::timeout(Duration::from_secs(600), lines.next_line())
            .await
            .context("peer.js silent for 10 minutes")??
            .context("peer.js exited early")
    };
    let ready = next_line().await?;
    ensure!(ready.contains("\"ready\""), "peer.js said {ready:?}");
    let before = meter.begin(database).await?;
    let mut stdin = child.stdin.take().expect("piped");
    stdin.write_all(b"go\n").await?;
    stdin.flush().await?;
    let result: PeerResult = serde_json::from_str(&next_line().await?).context("peer.js result")?;
    let status = child.wait().await?;
    ensure!(status.success(), "peer.js exited with {status}");
    let after = meter.end(database).await?;
    let cost = before.cost_to(&after, Some(result.cpu_seconds));
    Ok((result, cost))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_run_reports_its_exit_status_its_output_and_the_cpu_of_its_children() {
        let mut cmd = std::process::Command::new("sh");
        // The busy loop runs in a grandchild the peer reaps, as a Node worker would.
        let busy = "sh -c 'i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done'";
        cmd.args(["-c", &format!("{busy}; echo done; echo err >&2; exit 3")])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let (status, output, cpu) = run_counting_cpu(cmd).unwrap();
        assert_eq!(status.code(), Some(3));
        assert_eq!(output, "done\nerr\n");
        assert!(
            cpu > 0.05,
            "the busy loop's CPU time went uncounted: {cpu}s"
        );
    }

    #[test]
    fn placeholders_are_replaced_by_number_not_by_prefix() {
        assert_eq!(
            bind_literals(
                "a = $1 AND b = $10 AND c = $2::int AND d = '$'",
                &["x", "y", "", "", "", "", "", "", "", "z"]
            ),
            "a = x AND b = z AND c = y::int AND d = '$'"
        );
    }

    #[test]
    fn the_burn_down_script_makes_the_store_calls_with_every_placeholder_bound() {
        let script = claim_ack_script(store::ACK_CALL);
        assert!(!script.contains('$'), "{script}");
        assert!(script.contains("FROM outbox.claim('bench', 'off', 'pgbench', '', '{}', :batch, 30000, NULL, NULL, '{}', '{}', '{}', '{}', 4194304) \\gset"), "{script}");
        assert!(
            script
                .contains("FROM outbox.ack_into_batches('bench', 'off', (:ids), (:leases), NULL);"),
            "{script}"
        );
        let deleting = claim_ack_script(store::ACK_AND_DELETE_CALL);
        assert!(
            deleting
                .contains("FROM outbox.ack_and_delete('bench', 'off', (:ids), (:leases), NULL);"),
            "{deleting}"
        );
    }
}
