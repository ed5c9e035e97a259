//! `outboxd-faults failover`: a PostgreSQL failover under load (issue 33). A primary with a
//! synchronous standby (`pg_basebackup -R`, `synchronous_standby_names`), two outboxd
//! replicas (r1 through a forwarding address, r2 straight to the primary), producers
//! (two-phase with a row, two-phase with nothing but the token, rolled back, direct) and
//! workers; then `pg_ctl stop -m immediate` of the primary, SIGTERM of r2 with its database
//! gone, promotion of the standby (and `synchronous_standby_names` cleared on it), the
//! forwarding address moved to it and r2 restarted with its URL. After a drain it checks:
//!
//! - every intent whose producer COMMIT was acknowledged is delivered, token-only too;
//! - no intent of an aborted transaction is claimed or delivered;
//! - a COMMIT whose answer was lost (it may have committed even if sent after the crash
//!   began: the old primary's backends outlive its SIGQUIT by milliseconds) is judged by
//!   the new primary's commit log, and its intents and row follow what that says;
//! - every OK answered before the crash (enqueues, Acks) is on the new primary;
//! - retried stale tokens get the README's answers (ABORTED, or the recorded intents for
//!   a replay of a committed transaction's Enqueue), and no enqueue is ever told
//!   TXN_COMMITTED;
//! - no INTERNAL answer, before, during or after the outage;
//! - r2 stops within its shutdown grace with its database gone.
//!
//! Producers and workers are tasks of this process (the outboxd replicas and PostgreSQL are
//! real processes): the checks need each call's answer, not a journal. The workers are the
//! Rust SDK's managed worker (`work.rs`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU16, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use outboxd::client::{Client, Credentials};
use outboxd::embedded::{EmbeddedConfig, EmbeddedPostgres};
use outboxd::outbox::token::TxnToken;
use outboxd::proto::v1;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::processes::{Launch, Supervised};
use crate::rng::Rng;
use crate::rpc::{CALL_TIMEOUT, reason, request};
use crate::run::{free_port, replica_env_on, wait_serving};

mod work;

const DATABASE: &str = "outbox";
const SERVICE_ROLE: &str = "outboxd_service";

/// Role the replicas' fleet pools connect as (a member of outboxd_fleet).
const FLEET_ROLE: &str = "outboxd_fleet_service";
const TENANT: &str = "failover";

/// Kinds of the producers' intents and of the sentinel's.
const EVENT_KIND: &str = "failover.event";
const SENTINEL_KIND: &str = "failover.sentinel";
/// `application_name` of the standby's walreceiver, as `synchronous_standby_names` names it.
const STANDBY_NAME: &str = "standby1";
/// The replicas' `OUTBOX_SHUTDOWN__GRACE` (see `run::replica_env_on`).
const GRACE: Duration = Duration::from_secs(2);
/// What a stop may take beyond the grace: the process's own exit.
const EXIT_SLACK: Duration = Duration::from_millis(700);

/// Command line of `outboxd-faults failover`.
#[derive(Debug, Clone, clap::Args)]
pub struct FailoverArgs {
    /// Load on the primary before it crashes.
    #[arg(long, default_value = "6s", value_parser = crate::run::parse_duration)]
    pub before: Duration,
    /// Load on the new primary after the failover.
    #[arg(long, default_value = "5s", value_parser = crate::run::parse_duration)]
    pub after: Duration,
    /// Producer tasks.
    #[arg(long, default_value_t = 4)]
    pub producers: usize,
    /// Worker tasks.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Seed of every random choice.
    #[arg(long)]
    pub seed: Option<u64>,
    /// The outboxd binary [default: `outboxd` next to this one].
    #[arg(long)]
    pub outboxd: Option<PathBuf>,
    /// Keep the work directory even when the run passes.
    #[arg(long)]
    pub keep: bool,
}

/// Phases of the run, for the answers seen in each.
const BEFORE: u8 = 0;
const OUTAGE: u8 = 1;
const AFTER: u8 = 2;
const PHASES: [&str; 3] = ["before", "outage", "after"];

/// What a producer transaction is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TxnKind {
    /// Writes a row of its own, then takes its token.
    Row,
    /// Writes nothing but its token (a notification from a read-only flow).
    TokenOnly,
}

/// How a producer transaction ended, as its producer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// COMMIT answered OK.
    Committed,
    /// COMMIT sent, no answer: either. Which one is read from the new primary's commit
    /// log once the load stops (`resolve_unknown_commits`): a COMMIT sent after the crash
    /// began may still commit, because the old primary's backends outlive its SIGQUIT by
    /// milliseconds (one committed 11 ms after "received immediate shutdown request", and
    /// reached the standby).
    CommitUnknown,
    /// Rolled back on purpose, or its connection died before COMMIT was sent.
    Aborted,
}

#[derive(Debug, Clone)]
struct Txn {
    kind: TxnKind,
    token: String,
    order: Option<i64>,
    intents: Vec<v1::NewIntent>,
    ids: Vec<Uuid>,
    /// When the Enqueue was answered OK (µs since the run began).
    enqueued_at: u64,
    ending: Ending,
    /// When COMMIT was sent (µs since the run began), if it was.
    commit_sent_at: Option<u64>,
    /// For [`Ending::CommitUnknown`]: whether it committed, as the new primary's commit log
    /// says (`resolve_unknown_commits`).
    committed_in_fact: Option<bool>,
}

impl Txn {
    /// Whether the transaction committed: as its producer was told, or, when the COMMIT
    /// lost its answer, as the new primary's commit log says.
    fn committed(&self) -> bool {
        match self.ending {
            Ending::Committed => true,
            Ending::Aborted => false,
            Ending::CommitUnknown => self.committed_in_fact == Some(true),
        }
    }
}

/// Everything the tasks observed.
#[derive(Default)]
struct Seen {
    txns: Vec<Txn>,
    /// Direct enqueues answered OK: ids and when.
    direct: Vec<(Uuid, u64)>,
    /// Intents a Claim returned.
    claimed: HashSet<Uuid>,
    /// Acks answered OK per item: id and when.
    acked: Vec<(Uuid, u64)>,
    /// Every error answer, by phase and `code/reason`.
    errors: BTreeMap<(u8, String), u64>,
    /// Answers to Enqueues with a token from before the crash, made after it.
    stale: Vec<StaleAnswer>,
}

#[derive(Debug, Clone)]
struct StaleAnswer {
    /// What the README promises for it.
    expected: &'static str,
    /// What came back.
    got: String,
}

struct Shared {
    seen: Mutex<Seen>,
    phase: AtomicU8,
    started: Instant,
    clients: Vec<Client>,
}

impl Shared {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    fn record_error(&self, status: &tonic::Status) {
        let phase = self.phase.load(Ordering::Relaxed);
        let key = format!("{:?}/{}", status.code(), reason(status));
        *self.seen().errors.entry((phase, key)).or_default() += 1;
    }

    /// Calls `attempt` on the replicas in turn until a definite answer or `budget` ends;
    /// every error answer is recorded. Retries UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
    /// UNKNOWN (a connection cut) and INTERNAL (which is recorded, and fails the run).
    async fn call<T, F, Fut>(
        &self,
        rng: &mut Rng,
        budget: Duration,
        mut attempt: F,
    ) -> Result<T, Option<tonic::Status>>
    where
        F: FnMut(Client) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + budget;
        let mut index = rng.below(self.clients.len() as u64) as usize;
        loop {
            match attempt(self.clients[index].clone()).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) => {
                    self.record_error(&status);
                    use tonic::Code::*;
                    let transient = matches!(
                        status.code(),
                        Unavailable | DeadlineExceeded | Cancelled | Unknown | Internal
                    );
                    if !transient {
                        return Err(Some(status));
                    }
                    if Instant::now() + Duration::from_millis(100) >= deadline {
                        return Err(None);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    index = (index + 1) % self.clients.len();
                }
            }
        }
    }
}

/// A TCP forwarder standing for the database's address (a virtual IP, a DNS name, a
/// load balancer): moved to the new primary after the failover.
struct Forwarder {
    port: u16,
    target: Arc<AtomicU16>,
    cut: Arc<Mutex<CancellationToken>>,
    stop: CancellationToken,
}

impl Forwarder {
    async fn start(target: u16) -> anyhow::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let port = listener.local_addr()?.port();
        let (target, cut, stop) = (
            Arc::new(AtomicU16::new(target)),
            Arc::new(Mutex::new(CancellationToken::new())),
            CancellationToken::new(),
        );
        let (to, cuts, stopped) = (target.clone(), cut.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = stopped.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((mut client, _)) = accepted else {
                    continue;
                };
                let port = to.load(Ordering::Relaxed);
                let cut = cuts.lock().unwrap_or_else(PoisonError::into_inner).clone();
                tokio::spawn(async move {
                    // A dead target: the client's connection is accepted and closed, as a
                    // load balancer with no live backend does.
                    let Ok(mut server) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.cancelled() => {}
                    }
                });
            }
        });
        Ok(Self {
            port,
            target,
            cut,
            stop,
        })
    }

    /// Points new connections at `port` and cuts the ones open.
    fn move_to(&self, port: u16) {
        self.target.store(port, Ordering::Relaxed);
        let mut cut = self.cut.lock().unwrap_or_else(PoisonError::into_inner);
        cut.cancel();
        *cut = CancellationToken::new();
    }
}

fn url(port: u16, user: &str) -> String {
    format!("postgres://{user}@127.0.0.1:{port}/{DATABASE}")
}

/// Runs the scenario; Ok(true) when every check held.
pub async fn run(args: FailoverArgs) -> anyhow::Result<bool> {
    let seed = args.seed.unwrap_or_else(Rng::entropy);
    let dir = std::env::temp_dir().join(format!("outboxd-failover-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("logs"))?;
    let outboxd = match &args.outboxd {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("outboxd"),
    };
    anyhow::ensure!(outboxd.exists(), "{} not found", outboxd.display());
    std::fs::copy(&outboxd, dir.join("outboxd")).context("copying outboxd")?;
    eprintln!(
        "outboxd-faults failover: seed {seed}, work dir {}",
        dir.display()
    );
    // Producer and worker tasks run on this thread (spawn_local): sqlx's executor futures
    // are not Send for every lifetime the spawn of a multi-thread runtime requires.
    let result = tokio::task::LocalSet::new()
        .run_until(scenario(&args, seed, &dir))
        .await;
    let passed = match result {
        Ok(passed) => passed,
        Err(e) => {
            eprintln!("outboxd-faults failover: {e:#}");
            false
        }
    };
    if passed && !args.keep {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!(
            "logs and both data directories are kept in {}",
            dir.display()
        );
    }
    Ok(passed)
}

/// The primary, its standby (once started) and what the run needs of them.
struct Clusters {
    primary: Arc<Mutex<EmbeddedPostgres>>,
    standby: Arc<Mutex<EmbeddedPostgres>>,
    primary_port: u16,
    standby_port: u16,
}

fn settings() -> Vec<(String, String)> {
    // A crash of the postmaster, not of the kernel: WAL in the page cache survives it.
    [("fsync", "off"), ("max_connections", "100")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    tokio::task::spawn_blocking(f).await?
}

/// Primary, outbox database and keys, standby streaming synchronously.
async fn clusters(dir: &Path) -> anyhow::Result<(Clusters, String, String)> {
    let mut config = EmbeddedConfig::new(dir.join("primary"));
    config.settings = settings();
    let primary = blocking(move || Ok(EmbeddedPostgres::start(config)?)).await?;
    let primary_port = primary.port();
    let mut setup = PgConnection::connect(&primary.url("postgres")).await?;
    sqlx::query(&format!("CREATE DATABASE {DATABASE}"))
        .execute(&mut setup)
        .await?;
    let owner = PgPool::connect(&url(primary_port, "postgres")).await?;
    outboxd::startup::migrate(&owner).await?;
    outboxd::startup::grant_service_role(&owner, SERVICE_ROLE, true).await?;
    outboxd::startup::grant_fleet_role(&owner, FLEET_ROLE, true).await?;
    sqlx::raw_sql(
        "CREATE SCHEMA failover; CREATE TABLE failover.producer_order \
         (id bigserial PRIMARY KEY, producer text NOT NULL)",
    )
    .execute(&owner)
    .await?;
    let tenants = Some(vec![TENANT.to_owned()]);
    let (_, producer_key) = outboxd::auth::issue_key(
        &owner,
        "failover-producer",
        tenants.clone(),
        vec!["produce".to_owned(), "consume".to_owned()],
        vec![],
    )
    .await?;
    owner.close().await;

    // The standby is a copy of the primary, configuration included: it names itself as
    // the synchronous standby, as a copied postgresql.auto.conf would.
    let standby_dir = dir.join("standby");
    let primary = Arc::new(Mutex::new(primary));
    let from = primary.clone();
    let backup_dir = standby_dir.clone();
    blocking(move || {
        let primary = from.lock().unwrap_or_else(PoisonError::into_inner);
        let extra = [format!("synchronous_standby_names = '{STANDBY_NAME}'")];
        Ok(primary.base_backup_standby(&backup_dir, STANDBY_NAME, &extra)?)
    })
    .await
    .context("pg_basebackup")?;
    let mut config = EmbeddedConfig::new(standby_dir);
    config.settings = settings();
    let standby = blocking(move || Ok(EmbeddedPostgres::start(config)?))
        .await
        .context("starting the standby")?;
    let standby_port = standby.port();
    // One statement each: several in one simple query form a transaction block.
    sqlx::raw_sql(&format!(
        "ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"
    ))
    .execute(&mut setup)
    .await?;
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(&mut setup)
        .await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let sync: Option<String> = sqlx::query_scalar(
            "SELECT sync_state FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(STANDBY_NAME)
        .fetch_optional(&mut setup)
        .await?;
        if sync.as_deref() == Some("sync") {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the standby never became synchronous"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok((
        Clusters {
            primary,
            standby: Arc::new(Mutex::new(standby)),
            primary_port,
            standby_port,
        },
        producer_key,
        url(primary_port, "postgres"),
    ))
}

fn replica(dir: &Path, name: &str, port: u16, db_url: Arc<Mutex<String>>) -> Supervised {
    let (program, log) = (dir.join("outboxd"), dir.join(format!("logs/{name}.log")));
    Supervised::new(
        name.to_owned(),
        Box::new(move |_| Launch {
            program: program.clone(),
            args: vec!["serve".to_owned()],
            env: {
                let service_url = db_url
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clone();
                let fleet_url = service_url.replacen(SERVICE_ROLE, FLEET_ROLE, 1);
                replica_env_on(&service_url, &fleet_url, port)
            },
            log: log.clone(),
        }),
    )
}

async fn scenario(args: &FailoverArgs, seed: u64, dir: &Path) -> anyhow::Result<bool> {
    let (clusters, key, _) = clusters(dir).await?;
    let forwarder = Forwarder::start(clusters.primary_port).await?;
    let (p1, p2) = (free_port()?, free_port()?);
    let r1_url = Arc::new(Mutex::new(url(forwarder.port, SERVICE_ROLE)));
    let r2_url = Arc::new(Mutex::new(url(clusters.primary_port, SERVICE_ROLE)));
    let r1 = replica(dir, "r1", p1, r1_url);
    let r2 = replica(dir, "r2", p2, r2_url.clone());
    r1.start().await?;
    r2.start().await?;
    for port in [p1, p2] {
        wait_serving(port, Duration::from_secs(30)).await?;
    }
    let credentials = Credentials::new(Some(&key), Some(TENANT))?;
    let clients = [p1, p2]
        .iter()
        .map(|port| {
            let channel =
                tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))?
                    .connect_timeout(Duration::from_secs(1))
                    .connect_lazy();
            Ok(outboxd::client::client(channel, credentials.clone()))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let shared = Arc::new(Shared {
        seen: Mutex::default(),
        phase: AtomicU8::new(BEFORE),
        started: Instant::now(),
        clients,
    });
    let say = |what: &str| eprintln!("[{:>5.1}s] {what}", shared.started.elapsed().as_secs_f64());
    let mut rng = Rng::new(seed);
    let (stop_producers, stop_workers) = (CancellationToken::new(), CancellationToken::new());
    let producer_url = url(forwarder.port, "postgres");
    let mut producers = Vec::new();
    for i in 0..args.producers {
        producers.push(tokio::task::spawn_local(produce(
            shared.clone(),
            format!("p{i}"),
            producer_url.clone(),
            rng.next_u64(),
            stop_producers.clone(),
        )));
    }
    let mut workers = Vec::new();
    for _ in 0..args.workers {
        // Each starts on a replica of its own choosing (the SDK stays where it is answered).
        let mut endpoints: Vec<String> = [p1, p2].map(|p| format!("127.0.0.1:{p}")).into();
        endpoints.rotate_left(rng.below(2) as usize);
        workers.push(tokio::task::spawn_local(work::work(
            shared.clone(),
            endpoints,
            key.clone(),
            stop_workers.clone(),
        )));
    }
    say(&format!(
        "load on the primary (port {}) with a synchronous standby (port {}): {} producers, {} workers",
        clusters.primary_port, clusters.standby_port, args.producers, args.workers
    ));
    tokio::time::sleep(args.before).await;

    // The failover, right after the COMMIT of a token-only transaction is acknowledged:
    // with a commit that is not flushed (and not replicated) before its answer, only
    // another commit's flush within that instant would save it.
    let sentinel = sentinel(&shared, &mut rng, clusters.primary_port).await?;
    shared.phase.store(OUTAGE, Ordering::Relaxed);
    let crashed_at = shared.now();
    let primary = clusters.primary.clone();
    blocking(move || {
        Ok(primary
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .crash()?)
    })
    .await?;
    say("primary crashed (immediate stop); load goes on");
    tokio::time::sleep(Duration::from_secs(1)).await;
    let r2_stop = r2.terminate(GRACE * 3).await;
    say(&format!(
        "r2 stopped on SIGTERM with its database gone: {r2_stop:?}"
    ));
    let mut promote = PgConnection::connect(&url(clusters.standby_port, "postgres")).await?;
    let promoted: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
        .fetch_one(&mut promote)
        .await?;
    anyhow::ensure!(promoted, "the standby was not promoted");
    // Its synchronous_standby_names names the standby it was: left so, every commit on
    // it would wait for ever.
    for statement in [
        "ALTER SYSTEM RESET synchronous_standby_names",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::raw_sql(statement).execute(&mut promote).await?;
    }
    // The first transaction id of the new primary's life, taken before anything else can
    // write to it (r1's forwarding address still leads to the dead primary, r2 is down):
    // replay moved the next id past every id in the WAL it received, so an old primary's
    // transaction at or above this one left nothing on the new primary, and one below it
    // reads as it ended there (see resolve_unknown_commits). Should autovacuum take an id
    // first, an old id at or above that one could read as its commit: a false failure
    // (intents of an aborted transaction expected delivered), never a false pass.
    let first_new_xid: String = sqlx::query_scalar("SELECT pg_current_xact_id()::text")
        .fetch_one(&mut promote)
        .await?;
    let first_new_xid: u64 = first_new_xid.parse()?;
    forwarder.move_to(clusters.standby_port);
    *r2_url.lock().unwrap_or_else(PoisonError::into_inner) =
        url(clusters.standby_port, SERVICE_ROLE);
    r2.start().await?;
    wait_serving(p2, Duration::from_secs(30)).await?;
    shared.phase.store(AFTER, Ordering::Relaxed);
    say("standby promoted; forwarding address moved to it; r2 restarted with its URL");
    tokio::time::sleep(args.after).await;
    stop_producers.cancel();
    for producer in producers {
        let _ = producer.await;
    }

    let admin = PgPool::connect(&url(clusters.standby_port, "postgres")).await?;
    let unknown = resolve_unknown_commits(&shared, &admin, first_new_xid, crashed_at).await?;
    say(&format!(
        "COMMITs without an answer, by the new primary's commit log: {unknown}"
    ));
    retry_stale_tokens(&shared, &mut rng, crashed_at).await;

    // Drain: nothing live left on the new primary.
    let drained = drain(&admin).await?;
    say(&format!("drained: {drained}"));
    stop_workers.cancel();
    for worker in workers {
        let _ = worker.await;
    }
    let r1_stop = r1.terminate(GRACE * 3).await;
    let r2_final = r2.terminate(GRACE * 3).await;
    forwarder.stop.cancel();

    let verdict = check(&shared, &admin, crashed_at, drained, r2_stop, &sentinel).await?;
    println!(
        "{}",
        verdict.render(seed, r1_stop, r2_final, &shared.seen().errors)
    );
    admin.close().await;
    let standby = clusters.standby.clone();
    let _ = blocking(move || {
        Ok(standby
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stop()?)
    })
    .await;
    Ok(verdict.passed())
}

/// One producer: transactions (with a row, with nothing but the token, rolled back) and
/// direct enqueues, until `stop`.
async fn produce(
    shared: Arc<Shared>,
    name: String,
    database_url: String,
    seed: u64,
    stop: CancellationToken,
) {
    let mut rng = Rng::new(seed);
    let mut connection: Option<PgConnection> = None;
    let mut seq = 0u64;
    while !stop.is_cancelled() {
        seq += 1;
        let intents: Vec<v1::NewIntent> = (0..1 + rng.below(2))
            .map(|i| v1::NewIntent {
                kind: EVENT_KIND.to_owned(),
                payload: format!("{{\"producer\":\"{name}\",\"seq\":{seq},\"i\":{i}}}")
                    .into_bytes(),
                content_type: "application/json".to_owned(),
                idempotency_key: format!("{name}/{seq}/{i}"),
                ..Default::default()
            })
            .collect();
        let roll = rng.below(100);
        if roll < 20 {
            let message = v1::EnqueueRequest {
                intents,
                txn_token: String::new(),
            };
            let answered = shared
                .call(&mut rng, Duration::from_secs(3), |mut c| {
                    let r = request(message.clone(), CALL_TIMEOUT);
                    async move { c.enqueue(r).await }
                })
                .await;
            if let Ok(answer) = answered {
                let at = shared.now();
                let mut seen = shared.seen();
                for r in answer.results {
                    if let Ok(id) = r.id.parse() {
                        seen.direct.push((id, at));
                    }
                }
            }
        } else {
            let kind = if roll < 50 {
                TxnKind::TokenOnly
            } else {
                TxnKind::Row
            };
            let commit = rng.below(100) < 85;
            let mut conn = match connection.take() {
                Some(conn) => conn,
                None => match PgConnection::connect(&database_url).await {
                    Ok(conn) => conn,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let healthy =
                transaction(&shared, &mut rng, &mut conn, &name, kind, intents, commit).await;
            if healthy {
                connection = Some(conn);
            }
        }
        tokio::time::sleep(rng.millis(5, 30)).await;
    }
}

/// One producer transaction; returns whether its connection is still usable.
async fn transaction(
    shared: &Shared,
    rng: &mut Rng,
    conn: &mut PgConnection,
    name: &str,
    kind: TxnKind,
    intents: Vec<v1::NewIntent>,
    commit: bool,
) -> bool {
    if sqlx::raw_sql("BEGIN").execute(&mut *conn).await.is_err() {
        return false;
    }
    let mut order = None;
    if kind == TxnKind::Row {
        match sqlx::query_scalar(
            "INSERT INTO failover.producer_order (producer) VALUES ($1) RETURNING id",
        )
        .bind(name)
        .fetch_one(&mut *conn)
        .await
        {
            Ok(id) => order = Some(id),
            Err(_) => return false,
        }
    }
    let Ok(token) = sqlx::query_scalar::<_, String>("SELECT outbox.txn_token()")
        .fetch_one(&mut *conn)
        .await
    else {
        return false;
    };
    let message = v1::EnqueueRequest {
        intents: intents.clone(),
        txn_token: token.clone(),
    };
    let answered = shared
        .call(rng, Duration::from_secs(3), |mut c| {
            let r = request(message.clone(), CALL_TIMEOUT);
            async move { c.enqueue(r).await }
        })
        .await;
    let Ok(answer) = answered else {
        return sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.is_ok();
    };
    let mut txn = Txn {
        kind,
        token,
        order,
        intents,
        ids: answer
            .results
            .iter()
            .filter_map(|r| r.id.parse().ok())
            .collect(),
        enqueued_at: shared.now(),
        ending: Ending::Aborted,
        commit_sent_at: None,
        committed_in_fact: None,
    };
    // The rest of the producer's transaction: the window a crash may hit.
    tokio::time::sleep(rng.millis(2, 20)).await;
    let healthy = if commit {
        txn.commit_sent_at = Some(shared.now());
        match sqlx::raw_sql("COMMIT").execute(&mut *conn).await {
            Ok(_) => {
                txn.ending = Ending::Committed;
                true
            }
            Err(_) => {
                txn.ending = Ending::CommitUnknown;
                false
            }
        }
    } else {
        sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.is_ok()
    };
    shared.seen().txns.push(txn);
    healthy
}

/// A token-only transaction on the primary, committed; returns its intents once the
/// COMMIT is acknowledged.
async fn sentinel(shared: &Shared, rng: &mut Rng, primary_port: u16) -> anyhow::Result<Vec<Uuid>> {
    let mut conn = PgConnection::connect(&url(primary_port, "postgres")).await?;
    let intents = vec![v1::NewIntent {
        kind: SENTINEL_KIND.to_owned(),
        payload: b"{}".to_vec(),
        content_type: "application/json".to_owned(),
        idempotency_key: "sentinel".to_owned(),
        ..Default::default()
    }];
    let committed = transaction(
        shared,
        rng,
        &mut conn,
        "sentinel",
        TxnKind::TokenOnly,
        intents,
        true,
    )
    .await;
    let seen = shared.seen();
    let txn = seen
        .txns
        .last()
        .filter(|t| t.ending == Ending::Committed && committed);
    txn.map(|t| t.ids.clone())
        .context("the sentinel transaction did not commit")
}

/// Settles every COMMIT that lost its answer by the new primary's commit log; returns a
/// summary. Neither the producer nor the instant of the crash can tell: the old primary's
/// backends go on for milliseconds after its SIGQUIT, and a commit made then reaches the
/// synchronous standby although its answer never reaches the producer.
///
/// A token of the new primary's life reads as it is (`pg_xact_status`). One of the old
/// primary's life reads so when its id is below `first_new_xid`: the standby replayed every
/// record of the old primary it received, so its commit log says which of those ids
/// committed, and the new primary has handed no id below that one to anyone. An id at or
/// above it wrote nothing the standby received, its commit record included: aborted
/// (`pg_xact_status` would answer for whatever stranger the new primary gave the id to).
async fn resolve_unknown_commits(
    shared: &Shared,
    admin: &PgPool,
    first_new_xid: u64,
    crashed_at: u64,
) -> anyhow::Result<String> {
    let life: i64 = sqlx::query_scalar("SELECT outbox.server_incarnation()")
        .fetch_one(admin)
        .await?;
    let unknown: Vec<(usize, String, bool)> = shared
        .seen()
        .txns
        .iter()
        .enumerate()
        .filter(|(_, t)| t.ending == Ending::CommitUnknown)
        .map(|(index, t)| {
            let late = t.commit_sent_at.is_some_and(|at| at > crashed_at);
            (index, t.token.clone(), late)
        })
        .collect();
    let mut settled = Vec::new();
    for (index, token, late) in unknown {
        let parsed: TxnToken = token
            .parse()
            .map_err(|e| anyhow::anyhow!("the producer's token {token} {e}"))?;
        let committed = if parsed.incarnation != life as u64 && parsed.xid >= first_new_xid {
            false
        } else {
            let status: Option<String> =
                sqlx::query_scalar("SELECT pg_xact_status($1::text::xid8)")
                    .bind(parsed.xid.to_string())
                    .fetch_one(admin)
                    .await?;
            match status.as_deref() {
                Some("committed") => true,
                Some("aborted") => false,
                other => anyhow::bail!(
                    "transaction {} (token {token}) reads {other:?} on the new primary after the load",
                    parsed.xid
                ),
            }
        };
        settled.push((index, committed, late));
    }
    let mut seen = shared.seen();
    for &(index, committed, _) in &settled {
        seen.txns[index].committed_in_fact = Some(committed);
    }
    let committed = settled.iter().filter(|(_, c, _)| *c).count();
    let late = settled.iter().filter(|(_, c, late)| *c && *late).count();
    Ok(format!(
        "{} transactions: {committed} committed ({late} of them sent after the crash began), {} aborted",
        settled.len(),
        settled.len() - committed
    ))
}

/// Retries, on the new primary, the Enqueues of transactions from before the crash: a
/// committed one's (a replay: the recorded intents) and those of transactions that did not
/// commit (ABORTED). Every COMMIT that lost its answer is retried, by what the new
/// primary's commit log says it did (`resolve_unknown_commits`); then the last 10 others
/// of each kind.
async fn retry_stale_tokens(shared: &Shared, rng: &mut Rng, crashed_at: u64) {
    let txns = shared.seen().txns.clone();
    let before: Vec<&Txn> = txns.iter().filter(|t| t.enqueued_at < crashed_at).collect();
    let unknown = before.iter().filter(|t| t.ending == Ending::CommitUnknown);
    let committed = before
        .iter()
        .filter(|t| t.ending == Ending::Committed)
        .rev()
        .take(10);
    let dead = before
        .iter()
        .filter(|t| t.ending == Ending::Aborted)
        .rev()
        .take(10);
    for txn in unknown.chain(committed).chain(dead) {
        let expected = if txn.committed() {
            "OK (replay)"
        } else {
            "Aborted/TXN_ABORTED"
        };
        let message = v1::EnqueueRequest {
            intents: txn.intents.clone(),
            txn_token: txn.token.clone(),
        };
        let answered = shared
            .call(rng, Duration::from_secs(5), |mut c| {
                let r = request(message.clone(), CALL_TIMEOUT);
                async move { c.enqueue(r).await }
            })
            .await;
        let got = match answered {
            Ok(answer) => {
                let ids: Vec<Uuid> = answer
                    .results
                    .iter()
                    .filter_map(|r| r.id.parse().ok())
                    .collect();
                if ids == txn.ids {
                    "OK (replay)".to_owned()
                } else {
                    format!("OK with other intents {ids:?}")
                }
            }
            Err(Some(status)) => format!("{:?}/{}", status.code(), reason(&status)),
            Err(None) => "no answer".to_owned(),
        };
        shared.seen().stale.push(StaleAnswer { expected, got });
    }
}

/// Waits until no intent is live on the new primary; returns a description.
async fn drain(admin: &PgPool) -> anyhow::Result<String> {
    let started = Instant::now();
    loop {
        let live: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM outbox.intent \
             WHERE state IN ('staged', 'pending', 'leased', 'submitted')",
        )
        .fetch_one(admin)
        .await?;
        if live == 0 {
            return Ok(format!("in {:.1} s", started.elapsed().as_secs_f64()));
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Ok(format!("NOT drained: {live} live intents after 60 s"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

struct Verdict {
    rows: Vec<(String, String, bool)>,
}

impl Verdict {
    fn passed(&self) -> bool {
        self.rows.iter().all(|(_, _, ok)| *ok)
    }

    fn render(
        &self,
        seed: u64,
        r1_stop: Option<Duration>,
        r2_stop: Option<Duration>,
        errors: &BTreeMap<(u8, String), u64>,
    ) -> String {
        let mut out = format!(
            "\n## outboxd-faults failover (seed {seed})\n\n| check | observed | |\n|---|---|---|\n"
        );
        for (check, observed, ok) in &self.rows {
            let mark = if *ok { "ok" } else { "FAILED" };
            out.push_str(&format!("| {check} | {observed} | {mark} |\n"));
        }
        let answers: Vec<String> = errors
            .iter()
            .map(|((phase, code), n)| format!("{} {code} ×{n}", PHASES[*phase as usize]))
            .collect();
        out.push_str(&format!(
            "\nerror answers seen: {}\nfinal stops on SIGTERM (database up): r1 {r1_stop:?}, r2 {r2_stop:?}\n",
            if answers.is_empty() {
                "none".to_owned()
            } else {
                answers.join(", ")
            }
        ));
        out.push_str(if self.passed() {
            "\nPASSED\n"
        } else {
            "\nFAILED\n"
        });
        out
    }
}

async fn check(
    shared: &Shared,
    admin: &PgPool,
    crashed_at: u64,
    drained: String,
    r2_stop: Option<Duration>,
    sentinel: &[Uuid],
) -> anyhow::Result<Verdict> {
    let states: HashMap<Uuid, String> =
        sqlx::query_as::<_, (Uuid, String)>("SELECT id, state::text FROM outbox.all_intents")
            .fetch_all(admin)
            .await?
            .into_iter()
            .collect();
    let orders: HashSet<i64> = sqlx::query_scalar("SELECT id FROM failover.producer_order")
        .fetch_all(admin)
        .await?
        .into_iter()
        .collect();
    let seen = shared.seen();
    let state = |id: &Uuid| states.get(id).map_or("absent", String::as_str);
    let mut rows = Vec::new();
    rows.push((
        "drain".to_owned(),
        drained.clone(),
        !drained.starts_with("NOT"),
    ));

    // Every acknowledged COMMIT delivered, token-only too.
    for kind in [TxnKind::Row, TxnKind::TokenOnly] {
        let committed: Vec<&Txn> = seen
            .txns
            .iter()
            .filter(|t| t.kind == kind && t.ending == Ending::Committed)
            .collect();
        let near = committed
            .iter()
            .filter(|t| {
                t.commit_sent_at
                    .is_some_and(|at| at + 2_000_000 > crashed_at && at < crashed_at)
            })
            .count();
        let lost: Vec<String> = committed
            .iter()
            .flat_map(|t| &t.ids)
            .filter(|id| state(id) != "delivered")
            .map(|id| format!("{id} {}", state(id)))
            .collect();
        let what = match kind {
            TxnKind::Row => "committed transactions with a row: intents delivered",
            TxnKind::TokenOnly => "committed token-only transactions: intents delivered",
        };
        rows.push((
            what.to_owned(),
            format!(
                "{} transactions ({near} committed in the 2 s before the crash), {} not delivered {:?}",
                committed.len(),
                lost.len(),
                lost.iter().take(5).collect::<Vec<_>>()
            ),
            lost.is_empty() && !committed.is_empty(),
        ));
    }

    let sentinel_states: Vec<&str> = sentinel.iter().map(state).collect();
    rows.push((
        "token-only COMMIT acknowledged just before the crash: delivered".to_owned(),
        format!("{sentinel_states:?}"),
        !sentinel.is_empty() && sentinel_states.iter().all(|s| *s == "delivered"),
    ));

    // Aborted transactions (COMMITs without an answer by the new primary's commit log):
    // nothing claimed or delivered.
    let aborted: Vec<&Txn> = seen.txns.iter().filter(|t| !t.committed()).collect();
    let leaked: Vec<String> = aborted
        .iter()
        .flat_map(|t| &t.ids)
        .filter(|id| seen.claimed.contains(id) || state(id) == "delivered")
        .map(|id| format!("{id} {}", state(id)))
        .collect();
    rows.push((
        "aborted transactions: intents never claimed nor delivered".to_owned(),
        format!(
            "{} transactions, {} leaked {:?}",
            aborted.len(),
            leaked.len(),
            leaked.iter().take(5).collect::<Vec<_>>()
        ),
        leaked.is_empty(),
    ));

    // A COMMIT whose answer was lost: its intents delivered iff the new primary's commit
    // log says it committed, and its row (if it wrote one) there iff so too; the row
    // checks that reading of the commit log.
    let unknown: Vec<&Txn> = seen
        .txns
        .iter()
        .filter(|t| t.ending == Ending::CommitUnknown)
        .collect();
    let split: Vec<String> = unknown
        .iter()
        .filter_map(|t| {
            let committed = t.committed();
            let delivered = t.ids.iter().all(|id| state(id) == "delivered");
            let gone = t
                .ids
                .iter()
                .all(|id| state(id) != "delivered" && !seen.claimed.contains(id));
            let row_follows = t
                .order
                .is_none_or(|order| orders.contains(&order) == committed);
            let consistent = row_follows && if committed { delivered } else { gone };
            (!consistent).then(|| {
                let states: Vec<&str> = t.ids.iter().map(state).collect();
                format!(
                    "{:?} {states:?} order {:?}, committed: {committed}",
                    t.ids, t.order
                )
            })
        })
        .collect();
    let unknown_committed = unknown.iter().filter(|t| t.committed()).count();
    rows.push((
        "COMMITs without an answer: intents follow the transaction".to_owned(),
        format!(
            "{} transactions ({unknown_committed} committed), {} split {:?}",
            unknown.len(),
            split.len(),
            split.iter().take(3).collect::<Vec<_>>()
        ),
        split.is_empty(),
    ));

    // Every OK answered before the crash is on the new primary.
    let staged_before: Vec<&Uuid> = seen
        .txns
        .iter()
        .filter(|t| t.enqueued_at < crashed_at)
        .flat_map(|t| &t.ids)
        .collect();
    let missing_staged = staged_before
        .iter()
        .filter(|id| state(id) == "absent")
        .count();
    let direct_before: Vec<&Uuid> = seen
        .direct
        .iter()
        .filter(|(_, at)| *at < crashed_at)
        .map(|(id, _)| id)
        .collect();
    let direct_lost = direct_before
        .iter()
        .filter(|id| state(id) != "delivered")
        .count();
    let acked_before: Vec<&Uuid> = seen
        .acked
        .iter()
        .filter(|(_, at)| *at < crashed_at)
        .map(|(id, _)| id)
        .collect();
    let acks_lost = acked_before
        .iter()
        .filter(|id| state(id) != "delivered")
        .count();
    let direct_after_lost = seen
        .direct
        .iter()
        .filter(|(id, at)| *at >= crashed_at && state(id) != "delivered")
        .count();
    rows.push((
        "OKs before the crash on the new primary".to_owned(),
        format!(
            "staged enqueues {} ({missing_staged} absent), direct enqueues {} ({direct_lost} not delivered), acks {} ({acks_lost} not delivered); direct enqueues after: {direct_after_lost} not delivered",
            staged_before.len(),
            direct_before.len(),
            acked_before.len()
        ),
        missing_staged == 0 && direct_lost == 0 && acks_lost == 0 && direct_after_lost == 0,
    ));

    // Stale tokens.
    let wrong: Vec<String> = seen
        .stale
        .iter()
        .filter(|a| a.got != a.expected)
        .map(|a| format!("expected {}, got {}", a.expected, a.got))
        .collect();
    let committed_answers: u64 = seen
        .errors
        .iter()
        .filter(|((_, code), _)| code.ends_with("TXN_COMMITTED"))
        .map(|(_, n)| n)
        .sum();
    let count = |expected: &str| seen.stale.iter().filter(|a| a.expected == expected).count();
    rows.push((
        "stale tokens retried after the failover: the README's answers".to_owned(),
        format!(
            "{} replays of committed enqueues, {} tokens of transactions that did not commit; {} wrong {:?}; TXN_COMMITTED answers: {committed_answers}",
            count("OK (replay)"),
            count("Aborted/TXN_ABORTED"),
            wrong.len(),
            wrong.iter().take(3).collect::<Vec<_>>()
        ),
        wrong.is_empty() && committed_answers == 0 && count("Aborted/TXN_ABORTED") + count("OK (replay)") > 0,
    ));

    // No INTERNAL.
    let internal: u64 = seen
        .errors
        .iter()
        .filter(|((_, code), _)| code.starts_with("Internal"))
        .map(|(_, n)| n)
        .sum();
    let outage: u64 = seen
        .errors
        .iter()
        .filter(|((phase, _), _)| *phase == OUTAGE)
        .map(|(_, n)| n)
        .sum();
    rows.push((
        "no INTERNAL answer".to_owned(),
        format!("{internal} INTERNAL; {outage} error answers during the outage"),
        internal == 0,
    ));

    // Shutdown with the database gone.
    rows.push((
        format!("r2 stops on SIGTERM within its grace ({GRACE:?}) with its database gone"),
        format!("{r2_stop:?}"),
        r2_stop.is_some_and(|took| took <= GRACE + EXIT_SLACK),
    ));
    Ok(Verdict { rows })
}
