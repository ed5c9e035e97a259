//! `outboxd-faults run`: the orchestrator. It starts PostgreSQL, outboxd replicas behind
//! fault proxies, producers and workers as real processes; injects faults under load for
//! `--duration`; stops the faults, restarts whatever is down and drains; then checks the
//! guarantees on the database and the journals and prints the summary table.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use outboxd::proto::v1;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::API_KEY_ENV;
use crate::checker::{self, Observations};
use crate::cluster::{Cluster, QUEUE_LIMITS};
use crate::faults::{FaultKind, Timeline};
use crate::idle::IdleTransaction;
use crate::processes::{Launch, Supervised};
use crate::proxy::Proxy;
use crate::report::Summary;
use crate::rng::Rng;
use crate::rpc::{CALL_TIMEOUT, Rpc, request};

/// Command line of `outboxd-faults run`.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// How long faults are injected under load: the CI default, or e.g. `30m` for a soak.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Longest the final drain may go without progress (the number of live intents not
    /// falling) before the run fails; a long backlog may take longer as long as it moves.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Seed of every random choice (printed; pass it again to replay the same schedule).
    #[arg(long)]
    pub seed: Option<u64>,
    /// outboxd replicas on the one database.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 6)]
    pub workers: usize,
    /// Producer processes.
    #[arg(long, default_value_t = 3)]
    pub producers: usize,
    /// OUTBOX_DATABASE__MAX_CONNECTIONS of the last replica (pool exhaustion); 0 keeps
    /// the default.
    #[arg(long, default_value_t = 2)]
    pub small_pool: u32,
    /// Lease the workers ask for (at least 1s: the SDK's worker refuses less).
    #[arg(long, default_value = "2s", value_parser = parse_lease)]
    pub lease: Duration,
    /// Mean pause between a producer's transactions, in ms (the load knob).
    #[arg(long, default_value_t = 60)]
    pub producer_pause_ms: u64,
    /// Ordering keys the producers share; half their intents take one (0: unordered only).
    #[arg(long, default_value_t = 32)]
    pub ordering_keys: u64,
    /// Intents of a second tenant enqueued before the load starts: the backlog the
    /// producers' tenant must not wait behind (0: no fairness check).
    #[arg(long, default_value_t = 4000)]
    pub backlog: u64,
    /// A fault kind not to inject (repeatable), to isolate a failure.
    #[arg(long, value_enum, value_name = "KIND")]
    pub without: Vec<FaultKind>,
    /// Mean pause between two faults.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub fault_interval: Duration,
    /// The outboxd binary [default: `outboxd` next to this one].
    #[arg(long)]
    pub outboxd: Option<PathBuf>,
    /// Directory for the cluster, logs and journals [default: a fresh one under /tmp].
    #[arg(long)]
    pub workdir: Option<PathBuf>,
    /// Keep the work directory even when the run passes.
    #[arg(long)]
    pub keep: bool,
}

mod backlog;
mod inject;
mod operator;

pub use operator::Released;

pub(crate) fn parse_duration(value: &str) -> Result<Duration, String> {
    humantime::parse_duration(value).map_err(|e| e.to_string())
}

fn parse_lease(value: &str) -> Result<Duration, String> {
    let lease = parse_duration(value)?;
    if lease < Duration::from_secs(1) {
        return Err("the SDK's worker needs a lease of at least 1s".to_owned());
    }
    Ok(lease)
}

struct Replica {
    supervised: Supervised,
    port: u16,
    proxy: Proxy,
}

/// The running system under test.
struct Suite {
    args: RunArgs,
    cluster: Cluster,
    replicas: Vec<Replica>,
    workers: Vec<Supervised>,
    producers: Vec<Supervised>,
    timeline: Timeline,
    rng: Mutex<Rng>,
    postgres_busy: Arc<tokio::sync::Mutex<()>>,
    recoveries: Mutex<Vec<JoinHandle<()>>>,
    started: Instant,
}

/// Runs the suite; Ok(true) when every guarantee held.
pub async fn run(args: RunArgs) -> anyhow::Result<bool> {
    let seed = args.seed.unwrap_or_else(Rng::entropy);
    let dir = match &args.workdir {
        Some(dir) => dir.clone(),
        None => std::env::temp_dir().join(format!("outboxd-faults-{}", std::process::id())),
    };
    for sub in ["logs", "producers", "workers"] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let outboxd = match &args.outboxd {
        Some(path) => path.clone(),
        None => std::env::current_exe()?.with_file_name("outboxd"),
    };
    anyhow::ensure!(
        outboxd.exists(),
        "{} not found: build it first (cargo build --bin outboxd)",
        outboxd.display()
    );
    // Private copies: a concurrent `cargo build` replaces target/debug/* in place, and a
    // restarted replica must run the binary the run started with.
    std::fs::create_dir_all(dir.join("bin"))?;
    let outboxd_copy = dir.join("bin/outboxd");
    std::fs::copy(&outboxd, &outboxd_copy)
        .with_context(|| format!("copying {}", outboxd.display()))?;
    // /proc/self/exe still opens when the file it was started from has been replaced.
    std::fs::copy("/proc/self/exe", dir.join("bin/outboxd-faults"))?;
    let outboxd = outboxd_copy;
    eprintln!("outboxd-faults: seed {seed}, work dir {}", dir.display());
    let suite = Arc::new(Suite::start(args.clone(), seed, &dir, &outboxd).await?);
    let result = suite.clone().exercise(&dir, seed).await;
    suite.teardown().await;
    let passed = result?;
    if passed && !args.keep {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!(
            "logs, journals (producers/, workers/), faults.jsonl and the database are kept in {}",
            dir.display()
        );
    }
    Ok(passed)
}

impl Suite {
    async fn start(args: RunArgs, seed: u64, dir: &Path, outboxd: &Path) -> anyhow::Result<Self> {
        let mut rng = Rng::new(seed);
        let started = Instant::now();
        let mut cluster = Cluster::start(&dir.join("pgdata")).await?;
        // Before any replica: every lease of the run is under the policies and logged.
        cluster.limit_queues(QUEUE_LIMITS).await?;
        let mut replicas = Vec::new();
        for i in 1..=args.replicas {
            let port = free_port()?;
            let mut env = replica_env(&cluster, port);
            if i == args.replicas && args.replicas > 1 && args.small_pool > 0 {
                env.push((
                    "OUTBOX_DATABASE__MAX_CONNECTIONS".to_owned(),
                    args.small_pool.to_string(),
                ));
            }
            let (program, log) = (outboxd.to_path_buf(), dir.join(format!("logs/r{i}.log")));
            let supervised = Supervised::new(
                format!("r{i}"),
                Box::new(move |_name| Launch {
                    program: program.clone(),
                    args: vec!["serve".to_owned()],
                    env: env.clone(),
                    log: log.clone(),
                }),
            );
            supervised.start().await?;
            let proxy = Proxy::start(SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await?;
            replicas.push(Replica {
                supervised,
                port,
                proxy,
            });
        }
        for r in &replicas {
            wait_serving(r.port, Duration::from_secs(30))
                .await
                .with_context(|| format!("replica on port {} never served", r.port))?;
        }
        let direct: Vec<String> = replicas
            .iter()
            .map(|r| format!("127.0.0.1:{}", r.port))
            .collect();
        backlog::seed(
            &direct,
            &cluster.keys.backlog,
            args.backlog,
            &dir.join("producers/backlog.jsonl"),
        )
        .await
        .context("enqueueing the backlog")?;
        let proxied: Vec<String> = replicas
            .iter()
            .map(|r| r.proxy.listen.to_string())
            .collect();
        let me = dir.join("bin/outboxd-faults");
        let client = |role: &'static str, key: String, extra: Vec<String>, seed: u64| {
            let (me, proxied, dir) = (me.clone(), proxied.join(","), dir.to_path_buf());
            Box::new(move |name: &str| {
                let mut args = vec![
                    role.to_owned(),
                    "--name".to_owned(),
                    name.to_owned(),
                    "--endpoints".to_owned(),
                    proxied.clone(),
                    "--journal".to_owned(),
                    dir.join(format!("{role}s/{name}.jsonl"))
                        .display()
                        .to_string(),
                    "--seed".to_owned(),
                    // Every generation makes different choices.
                    (seed ^ u64::from(crc(name))).to_string(),
                ];
                args.extend(extra.iter().cloned());
                Launch {
                    program: me.clone(),
                    args,
                    env: vec![(API_KEY_ENV.to_owned(), key.clone())],
                    log: dir.join(format!("logs/{role}s.log")),
                }
            }) as crate::processes::Launcher
        };
        let mut workers = Vec::new();
        for i in 1..=args.workers {
            let extra = vec![
                "--lease-ms".to_owned(),
                args.lease.as_millis().to_string(),
                "--database-url".to_owned(),
                cluster.owner_url.clone(),
            ];
            let launcher = client("worker", cluster.keys.worker.clone(), extra, rng.next_u64());
            workers.push(Supervised::new(format!("w{i}"), launcher));
        }
        let mut producers = Vec::new();
        for i in 1..=args.producers {
            let extra = vec![
                "--database-url".to_owned(),
                cluster.owner_url.clone(),
                "--pause-ms".to_owned(),
                args.producer_pause_ms.to_string(),
                "--ordering-keys".to_owned(),
                args.ordering_keys.to_string(),
            ];
            let launcher = client(
                "producer",
                cluster.keys.producer.clone(),
                extra,
                rng.next_u64(),
            );
            producers.push(Supervised::new(format!("p{i}"), launcher));
        }
        let timeline = Timeline::create(&dir.join("faults.jsonl"))?;
        Ok(Self {
            args,
            cluster,
            replicas,
            workers,
            producers,
            timeline,
            rng: Mutex::new(rng),
            postgres_busy: Arc::default(),
            recoveries: Mutex::default(),
            started,
        })
    }

    fn say(&self, message: impl AsRef<str>) {
        eprintln!(
            "[{:>6.1}s] {}",
            self.started.elapsed().as_secs_f64(),
            message.as_ref()
        );
    }

    fn rng(&self) -> std::sync::MutexGuard<'_, Rng> {
        self.rng.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn direct_endpoints(&self) -> Vec<String> {
        self.replicas
            .iter()
            .map(|r| format!("127.0.0.1:{}", r.port))
            .collect()
    }

    /// Load, faults, drain, checks. Ok(passed).
    async fn exercise(self: Arc<Self>, dir: &Path, seed: u64) -> anyhow::Result<bool> {
        let idle = IdleTransaction::spawn(
            &self.cluster.owner_url,
            self.direct_endpoints(),
            self.cluster.keys.producer.clone(),
            &dir.join("producers/idle.jsonl"),
        )?;
        for slot in self.producers.iter().chain(&self.workers) {
            slot.start().await?;
        }
        let supervision = CancellationToken::new();
        let supervisor = tokio::spawn(self.clone().supervise(supervision.clone()));
        let operating = CancellationToken::new();
        let operator = tokio::spawn(
            self.clone()
                .release_keys(dir.to_path_buf(), operating.clone()),
        );
        self.say(format!(
            "load running: {} replicas (last with a {}-connection pool), {} producers, {} workers; injecting faults for {} s",
            self.replicas.len(),
            self.args.small_pool,
            self.producers.len(),
            self.workers.len(),
            self.args.duration.as_secs()
        ));

        self.inject_for(self.args.duration).await;
        let recoveries: Vec<_> = std::mem::take(
            &mut *self
                .recoveries
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for recovery in recoveries {
            let _ = recovery.await;
        }
        self.say("faults stopped; everything restarted; stopping producers");
        for producer in &self.producers {
            producer.terminate(Duration::from_secs(15)).await;
        }
        let idle_sessions = idle.commit().await;

        let drain_started = Instant::now();
        let (drain, undrained) = self.drain().await;
        match drain {
            Some(_) => self.say(format!(
                "drained in {:.1} s",
                drain_started.elapsed().as_secs_f64()
            )),
            None => self.say(format!("drain did not finish: {undrained:?}")),
        }
        operating.cancel();
        let released = operator.await.unwrap_or_default();
        for worker in &self.workers {
            worker.terminate(Duration::from_secs(5)).await;
        }
        supervision.cancel();
        let _ = supervisor.await;

        let snapshot = self.cluster.snapshot().await?;
        let observations = Observations::load(dir)?;
        let faults = self.timeline.all();
        let mut exits = Vec::new();
        for slot in self.all_slots() {
            exits.extend(slot.unexpected_exits().await);
        }
        let verdict = checker::check(&snapshot, &observations, &faults, &exits);
        let reconciled = self.reconcile(&verdict.reconcile).await;

        let (mut connections, mut resets, mut dropped) = (0, 0, 0);
        for r in &self.replicas {
            connections += r.proxy.stats.connections.load(Ordering::Relaxed);
            resets += r.proxy.stats.resets.load(Ordering::Relaxed);
            dropped += r.proxy.stats.bytes_dropped.load(Ordering::Relaxed);
        }
        let summary = Summary {
            seed,
            duration: self.args.duration,
            drain,
            undrained,
            shape: format!(
                "{} replicas, {} workers, {} producers, lease {} ms",
                self.replicas.len(),
                self.workers.len(),
                self.producers.len(),
                self.args.lease.as_millis()
            ),
            faults: &faults,
            standing: vec![
                (
                    "idle-in-transaction session pinning xmin".to_owned(),
                    format!(
                        "{idle_sessions} session(s); each holds a STAGED intent until the drain"
                    ),
                ),
                (
                    "pool exhaustion".to_owned(),
                    format!(
                        "r{} has OUTBOX_DATABASE__MAX_CONNECTIONS={} (LISTEN holds one): calls \
                         queue for a connection, see its Ack latency; PoolTimedOut logged: {}",
                        self.replicas.len(),
                        self.args.small_pool,
                        pool_timeouts(dir)
                    ),
                ),
            ],
            proxy: (connections, resets, dropped),
            exits: &exits,
            verdict: &verdict,
            reconciled,
            released,
        };
        let mut table = summary.render();
        if !summary.passed() {
            table.push_str(&format!(
                "server logs: {}/logs/r*.log; PostgreSQL log: {}\n",
                dir.display(),
                self.cluster.log_path().display()
            ));
        }
        println!("{table}");
        std::fs::write(dir.join("summary.txt"), &table)?;
        Ok(summary.passed())
    }

    fn all_slots(&self) -> impl Iterator<Item = &Supervised> {
        self.replicas
            .iter()
            .map(|r| &r.supervised)
            .chain(&self.workers)
            .chain(&self.producers)
    }

    /// Restarts any process that exited on its own, until cancelled.
    async fn supervise(self: Arc<Self>, stop: CancellationToken) {
        while !stop.is_cancelled() {
            for slot in self.all_slots() {
                slot.supervise().await;
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            }
        }
    }

    /// Waits until no intent is STAGED, PENDING, LEASED or SUBMITTED. Returns the time it
    /// took, or None and what was left when it made no progress for `--drain-timeout`.
    async fn drain(&self) -> (Option<Duration>, Vec<(String, i64)>) {
        let started = Instant::now();
        let mut last_report = started;
        let (mut fewest, mut progress_at) = (i64::MAX, started);
        loop {
            match self.cluster.live_intents().await {
                Ok(0) => return (Some(started.elapsed()), vec![]),
                Ok(live) if live < fewest => (fewest, progress_at) = (live, Instant::now()),
                _ => {}
            }
            if progress_at.elapsed() >= self.args.drain_timeout {
                let left = self.cluster.live_breakdown().await.unwrap_or_default();
                return (None, left);
            }
            if last_report.elapsed() >= Duration::from_secs(10) {
                last_report = Instant::now();
                let left = self.cluster.live_breakdown().await.unwrap_or_default();
                self.say(format!("draining: {left:?}"));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The operator's turn, after the checks: resolves each NEEDS_RECONCILE intent by what
    /// the side-effect log says. Returns (delivered, dead, refused).
    async fn reconcile(&self, plan: &[(uuid::Uuid, bool)]) -> (u64, u64, u64) {
        let Ok(mut rpc) = Rpc::new(&self.direct_endpoints(), &self.cluster.keys.operator, 1) else {
            return (0, 0, plan.len() as u64);
        };
        let mut counts = (0, 0, 0);
        for performed in [true, false] {
            let ids: Vec<String> = plan
                .iter()
                .filter(|(_, p)| *p == performed)
                .map(|(id, _)| id.to_string())
                .collect();
            for chunk in ids.chunks(500) {
                let (decision, reason) = if performed {
                    (
                        v1::Decision::Delivered,
                        "the side-effect log shows it performed",
                    )
                } else {
                    (
                        v1::Decision::Dead,
                        "the side-effect log shows it never performed",
                    )
                };
                let message = v1::ReconcileRequest {
                    target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                        ids: chunk.to_vec(),
                        ..Default::default()
                    })),
                    decision: decision as i32,
                    actor: "outboxd-faults".to_owned(),
                    reason: reason.to_owned(),
                    limit: 0,
                };
                let called = rpc
                    .call(Duration::from_secs(20), |mut client| {
                        let request = request(message.clone(), CALL_TIMEOUT);
                        async move { client.reconcile(request).await }
                    })
                    .await;
                match called {
                    Ok(called) => {
                        for result in called.value.results {
                            match (&result.error, performed) {
                                (Some(_), _) => counts.2 += 1,
                                (None, true) => counts.0 += 1,
                                (None, false) => counts.1 += 1,
                            }
                        }
                    }
                    Err(e) => {
                        self.say(format!("Reconcile failed: {}", e.describe()));
                        counts.2 += chunk.len() as u64;
                    }
                }
            }
        }
        counts
    }

    /// Stops everything, last the database.
    async fn teardown(&self) {
        for slot in self.workers.iter().chain(&self.producers) {
            slot.terminate(Duration::from_secs(2)).await;
        }
        for r in &self.replicas {
            r.supervised.terminate(Duration::from_secs(5)).await;
            r.proxy.stop();
        }
        if let Err(e) = self.cluster.stop().await {
            eprintln!("stopping PostgreSQL: {e:#}");
        }
    }
}

/// The environment of an outboxd replica listening on `port`: the suite's database, no
/// metrics endpoint, fast rescue and short backoffs so a run sees many cycles.
pub fn replica_env(cluster: &Cluster, port: u16) -> Vec<(String, String)> {
    replica_env_on(&cluster.service_url, &cluster.fleet_url, port)
}

/// [`replica_env`] with the database at `service_url` (and `fleet_url`, its fleet role's).
pub fn replica_env_on(service_url: &str, fleet_url: &str, port: u16) -> Vec<(String, String)> {
    [
        ("OUTBOX_DATABASE__URL", service_url),
        ("OUTBOX_DATABASE__FLEET_URL", fleet_url),
        ("OUTBOX_LISTEN_ADDR", &format!("127.0.0.1:{port}")),
        ("OUTBOX_METRICS__LISTEN_ADDR", ""),
        ("OUTBOX_MAINTENANCE__RESCUE_INTERVAL", "200ms"),
        ("OUTBOX_RETRY__BASE", "200ms"),
        ("OUTBOX_RETRY__CAP", "2s"),
        ("OUTBOX_SHUTDOWN__GRACE", "2s"),
        ("OUTBOX_LOG__FILTER", "warn"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// Waits until the replica on `port` answers SERVING to a gRPC health check.
pub async fn wait_serving(port: u16, timeout: Duration) -> anyhow::Result<()> {
    use tonic_health::pb::health_client::HealthClient;
    let deadline = Instant::now() + timeout;
    loop {
        let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{port}"))?
            .connect_timeout(Duration::from_millis(500))
            .connect()
            .await;
        if let Ok(channel) = channel {
            let check = HealthClient::new(channel)
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await;
            if check.is_ok_and(|r| r.into_inner().status == 1) {
                return Ok(());
            }
        }
        anyhow::ensure!(Instant::now() < deadline, "not serving after {timeout:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `PoolTimedOut` errors in each replica's log, e.g. `r1 0, r2 0, r3 12`.
fn pool_timeouts(dir: &Path) -> String {
    let mut out = Vec::new();
    for i in 1.. {
        let Ok(log) = std::fs::read_to_string(dir.join(format!("logs/r{i}.log"))) else {
            break;
        };
        out.push(format!("r{i} {}", log.matches("PoolTimedOut").count()));
    }
    out.join(", ")
}

/// A free TCP port on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// A small stable hash of a generation name, to derive its seed.
fn crc(name: &str) -> u32 {
    name.bytes().fold(2_166_136_261u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(16_777_619)
    })
}
