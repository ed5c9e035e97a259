//! Harness shared by the benchmarks: the PostgreSQL cluster, an in-process outboxd with its
//! databases and clients, API keys, and facts about the machine.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, ensure};
use clap::Args;
use outboxd::client::{Client, Credentials};
use outboxd::config::Settings;
use outboxd::embedded::{EmbeddedConfig, EmbeddedPostgres};
use outboxd::outbox::store::Pools;
use outboxd::proto::v1;
use outboxd::startup::{self, Application, EMBEDDED_FLEET_ROLE, EMBEDDED_SERVICE_ROLE, Runtime};
use sqlx::{Connection, PgConnection, PgPool};
use tonic::transport::Channel;
use uuid::Uuid;

use crate::txn_latency::{CLAIM_WAIT, ClaimTask, signed_ms};

/// The tenant the benchmark's keys act for.
pub const TENANT: &str = "bench";

/// Where a benchmark runs; shared by every subcommand.
#[derive(Debug, Args)]
pub struct ClusterArgs {
    /// PostgreSQL cluster to run on: a URL to any database of it, for a role that may
    /// CREATE DATABASE and CREATE ROLE. The benchmark creates its own databases there and
    /// drops them at the end; outboxd serves through the role `outboxd_service`, created if
    /// missing, which must be able to log in without a password (as in the embedded
    /// cluster). Unset: a private embedded cluster in a fresh temporary directory, removed
    /// after.
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

/// The PostgreSQL cluster a benchmark runs on.
pub enum Cluster {
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
    pub fn start(database_url: Option<&str>) -> anyhow::Result<Self> {
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
        let mut cfg = EmbeddedConfig::new(dir.join("pgdata"));
        // For profiling: statement times of every scenario, nested statements included,
        // read from the cluster while the run goes on (docs/performance.md).
        if std::env::var_os("OUTBOXD_BENCH_PG_STAT_STATEMENTS").is_some() {
            cfg.settings.push((
                "shared_preload_libraries".into(),
                "pg_stat_statements".into(),
            ));
            cfg.settings
                .push(("pg_stat_statements.track".into(), "all".into()));
        }
        let postgres = EmbeddedPostgres::start(cfg)?;
        Ok(Self::Embedded {
            postgres: Some(postgres),
            dir,
        })
    }

    /// URL of `database` in this cluster.
    pub fn url(&self, database: &str) -> anyhow::Result<String> {
        match self {
            Self::Embedded { postgres, .. } => Ok(postgres
                .as_ref()
                .expect("running until dropped")
                .url(database)),
            Self::External { admin_url } => with_login(admin_url, None, database),
        }
    }

    /// URL of a database that exists before the benchmark creates its own.
    pub fn admin_url(&self) -> anyhow::Result<String> {
        match self {
            Self::Embedded { .. } => self.url("postgres"),
            Self::External { admin_url } => Ok(admin_url.clone()),
        }
    }

    pub fn describe(&self) -> String {
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
pub fn with_login(url: &str, user: Option<&str>, database: &str) -> anyhow::Result<String> {
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
pub struct Bench {
    pub server: Application,
    pub pool: PgPool,
    pub admin_url: String,
    pub databases: [String; 2],
    /// Drop `databases` at the end: only on the user's cluster, since an embedded one is
    /// deleted whole (and DROP DATABASE costs a checkpoint).
    pub drop_databases: bool,
    pub outbox_url: String,
    pub other_url: String,
    pub producer: Client,
    pub worker: Client,
    pub settings: Settings,
    pub info: String,
    pub load_at_start: String,
}

impl Bench {
    pub async fn start(cluster: &Cluster, settings: Settings) -> anyhow::Result<Self> {
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
        startup::grant_fleet_role(&owner, EMBEDDED_FLEET_ROLE, true).await?;
        // Separate keys with the least scope each, as a producer and a worker would hold.
        let producer_key = create_key(&owner, "bench-producer", "produce").await?;
        let worker_key = create_key(&owner, "bench-worker", "consume").await?;
        owner.close().await;
        let service_url = with_login(&outbox_url, Some(EMBEDDED_SERVICE_ROLE), &outbox_db)?;
        let pool = startup::connect(&service_url, settings.database.max_connections)
            .await
            .with_context(|| format!("cannot log in as {EMBEDDED_SERVICE_ROLE}"))?;
        startup::verify_service_role(&pool).await?;
        let fleet_url = with_login(&outbox_url, Some(EMBEDDED_FLEET_ROLE), &outbox_db)?;
        let fleet = startup::connect(&fleet_url, settings.database.max_connections)
            .await
            .with_context(|| format!("cannot log in as {EMBEDDED_FLEET_ROLE}"))?;
        startup::verify_fleet_role(&fleet).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let mut settings = settings;
        // Still recorded as in production, but served on a free port so the benchmark
        // never collides with a running outboxd's.
        settings.metrics.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        // The production runtime: database clock, background sweeps, 2 s recheck.
        let server = Application::start(
            &settings,
            Pools::open(pool.clone(), fleet).await?,
            listener,
            Runtime::default(),
        )
        .await?;
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
    pub async fn stop(self) -> anyhow::Result<()> {
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
    /// checking it got one of the `expected` states.
    pub async fn enqueue(
        &self,
        txn_token: String,
        i: usize,
        expected: &[v1::IntentState],
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
            expected.contains(&result.state()),
            "Enqueue left {:?}, expected {expected:?}",
            result.state()
        );
        Ok(result.id.clone())
    }

    /// Starts a worker's long-polling Claim for one intent, timing its answer where it
    /// arrives rather than when this task gets round to awaiting it.
    pub fn spawn_claim(&self) -> ClaimTask {
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
    pub async fn finish_claim(
        &self,
        claim: ClaimTask,
        id: &str,
        t0: Instant,
    ) -> anyhow::Result<f64> {
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
pub async fn create_key(owner: &PgPool, name: &str, scope: &str) -> anyhow::Result<String> {
    let tenants = Some(vec![TENANT.to_owned()]);
    let (_, secret) =
        outboxd::auth::issue_key(owner, name, tenants, vec![scope.to_owned()], vec![]).await?;
    Ok(secret)
}

/// A client on its own connection (HTTP/2 multiplexes one, but a producer and a worker are
/// separate processes) sending `key`.
pub async fn connect_client(endpoint: &str, key: &str) -> anyhow::Result<Client> {
    let channel = Channel::from_shared(endpoint.to_owned())?.connect().await?;
    Ok(outboxd::client::client(
        channel,
        Credentials::new(Some(key), None)?,
    ))
}

/// The 1-minute load average, or "?" where /proc/loadavg does not exist.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".to_owned())
}

/// One line naming what the figures depend on: CPUs, PostgreSQL and its durability.
pub async fn machine_info(admin: &mut PgConnection, cluster: &Cluster) -> anyhow::Result<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
