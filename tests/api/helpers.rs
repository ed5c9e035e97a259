//! Test harness: one PostgreSQL cluster per test process (the embedded one, or
//! `OUTBOX_TEST_DATABASE_URL` when set), a migrated template database, and `TestApp`, a
//! server on a fresh database with a manual clock and one method per RPC.

use std::sync::OnceLock;
use std::time::Duration;

use chrono::Utc;
use outboxd::client::Credentials;
use outboxd::config::Settings;
use outboxd::embedded::{EmbeddedConfig, EmbeddedPostgres};
use outboxd::outbox::Clock;
use outboxd::outbox::maintenance::{self, MaintenanceConfig, SweepReport};
use outboxd::outbox::store::Pools;
use outboxd::proto::v1;
use outboxd::startup::{self, Application, Runtime};
use sqlx::{Connection, PgConnection, PgPool};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;
use uuid::Uuid;

pub use outboxd::client::Client;

/// The role the test servers connect as: it owns nothing, so row-level security applies
/// exactly as in production.
pub const SERVICE_ROLE: &str = "outboxd_service";

/// The role the test servers' fleet pools connect as: a member of `outboxd_fleet`, which
/// sees every tenant (sweeps, promotion, metrics, keys bound to all tenants).
pub const FLEET_ROLE: &str = "outboxd_fleet_service";

/// The tenant of `TestApp`'s default key.
pub const TENANT: &str = "acme";

const TEMPLATE: &str = "outbox_test_template";

/// The cluster every test of this process uses: (superuser URL prefix without database).
struct Cluster {
    /// `postgres://user@host:port/` base; append a database name.
    base_url: String,
    /// Keeps the embedded cluster alive for the whole process.
    _embedded: Option<EmbeddedPostgres>,
}

fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let cluster = match std::env::var("OUTBOX_TEST_DATABASE_URL") {
            Ok(url) => Cluster {
                base_url: base_of(&url),
                _embedded: None,
            },
            Err(_) => {
                remove_clusters_of_finished_runs();
                let dir = scratch_dir().join("pgdata");
                let mut config = EmbeddedConfig::new(dir);
                // Test speed only: a crash of the OS is not simulated, so fsync buys nothing
                // here. synchronous_commit stays on as in production.
                config.settings = vec![
                    ("fsync".into(), "off".into()),
                    ("full_page_writes".into(), "off".into()),
                    ("max_connections".into(), "300".into()),
                ];
                let embedded = EmbeddedPostgres::start(config).expect("start embedded PostgreSQL");
                Cluster {
                    base_url: base_of(&embedded.url("postgres")),
                    _embedded: Some(embedded),
                }
            }
        };
        // The template is migrated once; each test copies it (cheap) instead of migrating.
        let base = cluster.base_url.clone();
        std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(async move {
                    let admin = PgPool::connect(&format!("{base}postgres")).await.unwrap();
                    sqlx::query(&format!("DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)"))
                        .execute(&admin)
                        .await
                        .unwrap();
                    sqlx::query(&format!("CREATE DATABASE {TEMPLATE}"))
                        .execute(&admin)
                        .await
                        .unwrap();
                    let template = PgPool::connect(&format!("{base}{TEMPLATE}")).await.unwrap();
                    startup::migrate(&template).await.unwrap();
                    startup::grant_service_role(&template, SERVICE_ROLE, true)
                        .await
                        .unwrap();
                    startup::grant_fleet_role(&template, FLEET_ROLE, true)
                        .await
                        .unwrap();
                    template.close().await;
                    admin.close().await;
                })
        })
        .join()
        .expect("create the template database");
        cluster
    })
}

/// This test process's scratch directory, `outboxd-test-<pid>` in the temp dir: the shared
/// cluster's data (GBs once every test's database is in it), the clusters of tests that
/// crash PostgreSQL, certificates, logs. Deleted when the process ends, however it ends
/// (passed, failed, aborted, killed): a child shell waits for the end of its stdin, which
/// only this process holds, then for the clusters' postmasters to exit, and removes it. In
/// a process group of its own, so the Ctrl-C that stops the tests does not stop it.
pub fn scratch_dir() -> &'static std::path::Path {
    static SCRATCH: OnceLock<(std::path::PathBuf, Option<std::process::ChildStdin>)> =
        OnceLock::new();
    let (path, _remover) = SCRATCH.get_or_init(|| {
        use std::os::unix::process::CommandExt;
        let path = std::env::temp_dir().join(format!("outboxd-test-{}", std::process::id()));
        std::fs::create_dir_all(&path).expect("create the tests' scratch directory");
        const REMOVE_AT_EXIT: &str = r#"
            trap '' INT TERM HUP
            cat >/dev/null
            # PostgreSQL gets SIGQUIT as its parent dies; give it up to 30 s to exit.
            for _ in $(seq 300); do
                live=0
                for pid_file in "$1"/*/postmaster.pid "$1"/*/*/postmaster.pid; do
                    [ -f "$pid_file" ] && kill -0 "$(head -n1 "$pid_file")" 2>/dev/null && live=1
                done
                [ "$live" = 0 ] && break
                sleep 0.1
            done
            rm -rf "$1"
        "#;
        let remover = std::process::Command::new("sh")
            .args(["-c", REMOVE_AT_EXIT, "sh"])
            .arg(&path)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .process_group(0)
            .spawn()
            .ok()
            .and_then(|mut child| child.stdin.take());
        (path, remover)
    });
    path
}

/// Deletes the scratch directories earlier test processes left in the temp dir, should
/// their remover not have run (a machine that went down with them), and the certificate
/// directories of runs before there was one.
fn remove_clusters_of_finished_runs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        // Certificates of runs before the scratch directory (they were never removed); an
        // hour old, so certainly not a running test's.
        if name.to_str().is_some_and(|n| n.starts_with("outboxd-tls-")) {
            let age = entry.metadata().and_then(|m| m.modified()).ok();
            let age = age.and_then(|m| m.elapsed().ok()).unwrap_or_default();
            if age > Duration::from_secs(3600) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
            continue;
        }
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("outboxd-test-"))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn base_of(url: &str) -> String {
    let (prefix, _db) = url.rsplit_once('/').expect("URL with a database");
    format!("{prefix}/")
}

/// A fresh, migrated database for one test; returns its URL.
pub async fn fresh_database() -> String {
    create_database(Some(TEMPLATE)).await
}

/// A fresh empty database in the same cluster (a producer's own database); returns its URL.
pub async fn other_database() -> String {
    create_database(None).await
}

async fn create_database(template: Option<&str>) -> String {
    let base = &cluster().base_url;
    let name = format!("test_{}", Uuid::new_v4().simple());
    let template = template
        .map(|t| format!(" TEMPLATE {t}"))
        .unwrap_or_default();
    let admin = PgPool::connect(&format!("{base}postgres")).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}{template}"))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
    format!("{base}{name}")
}

/// The test cluster's server log, when the tests started their own cluster.
pub fn cluster_log() -> Option<std::path::PathBuf> {
    cluster()._embedded.as_ref().map(EmbeddedPostgres::log_path)
}

/// `url` (the superuser's) as the service role.
pub fn service_url(url: &str) -> String {
    url.replacen("://postgres@", &format!("://{SERVICE_ROLE}@"), 1)
}

/// `url` (the superuser's) as the fleet role.
pub fn fleet_url(url: &str) -> String {
    url.replacen("://postgres@", &format!("://{FLEET_ROLE}@"), 1)
}

/// A server on its own database, with a manual clock and no background sweeps.
pub struct TestApp {
    /// Client with the default key: tenant `acme`, every scope.
    pub client: Client,
    /// The superuser's pool: for what a test inspects or sets up behind the server's back.
    pub pool: PgPool,
    /// The server's own pools (its service role, under row-level security and its grants
    /// only, and its fleet role): the sweeps run on them, as the server runs them.
    service_pools: Pools,
    pub clock: Clock,
    pub settings: Settings,
    pub addr: std::net::SocketAddr,
    /// The `/metrics` endpoint, when enabled.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// The console, when enabled (`OUTBOX_CONSOLE__LISTEN_ADDR`).
    pub console_addr: Option<std::net::SocketAddr>,
    /// URL of the outbox database (superuser), for producer connections.
    pub url: String,
    app: Option<Application>,
}

impl TestApp {
    pub async fn spawn() -> Self {
        Self::spawn_with(|_| {}).await
    }

    pub async fn spawn_with(configure: impl FnOnce(&mut Settings)) -> Self {
        Self::spawn_on(fresh_database().await, configure).await
    }

    /// A server on an existing, migrated database whose service role has its grants.
    pub async fn spawn_on(url: String, configure: impl FnOnce(&mut Settings)) -> Self {
        Self::spawn_on_tuned(url, configure, |_| {}).await
    }

    /// A server on a fresh database whose background tasks `tune` changes.
    pub async fn spawn_tuned(tune: impl FnOnce(&mut Runtime)) -> Self {
        Self::spawn_on_tuned(fresh_database().await, |_| {}, tune).await
    }

    /// [`Self::spawn_with`] and [`Self::spawn_tuned`] at once.
    pub async fn spawn_with_tuned(
        configure: impl FnOnce(&mut Settings),
        tune: impl FnOnce(&mut Runtime),
    ) -> Self {
        Self::spawn_on_tuned(fresh_database().await, configure, tune).await
    }

    async fn spawn_on_tuned(
        url: String,
        configure: impl FnOnce(&mut Settings),
        tune: impl FnOnce(&mut Runtime),
    ) -> Self {
        let mut settings = Settings::default();
        // Many servers run at once: each gets its own metrics port.
        settings.metrics.listen_addr = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
        configure(&mut settings);
        // The test's own connections ping before every use (sqlx's default), unlike the
        // server's: tests that restart PostgreSQL must not trip on a dead connection.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(20)
            .connect(&url)
            .await
            .unwrap();
        let service_pools = startup::connect_pools(
            &startup::Database {
                service_url: service_url(&url),
                fleet_url: Some(fleet_url(&url)),
                embedded: None,
            },
            20,
        )
        .await
        .unwrap();
        let clock = Clock::manual(Utc::now());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut runtime = Runtime {
            clock: clock.clone(),
            maintenance: false,
            // Only a notification may wake a long-poll in tests.
            long_poll_recheck: Duration::from_secs(3600),
            // Nor a LISTEN connection replaced after a probe missed on a busy machine.
            listener_probe_every: Duration::from_secs(3600),
        };
        tune(&mut runtime);
        let app = Application::start(&settings, service_pools.clone(), listener, runtime)
            .await
            .unwrap();
        // Its first LISTEN connection wakes every waiting claim (they may have missed
        // announcements): a test's claim must begin waiting after that, not be woken by it.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !app.is_listening() {
            assert!(
                std::time::Instant::now() < deadline,
                "the server never listened"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let key = create_key(&pool, "test", &[TENANT], &["admin"], &[]).await;
        // Lazy: a TLS test server refuses this plaintext channel, and such tests bring their own.
        let channel = Channel::from_shared(format!("http://{}", app.local_addr()))
            .unwrap()
            .connect_lazy();
        let client = outboxd::client::client(channel, Credentials::new(Some(&key), None).unwrap());
        Self {
            client,
            pool,
            service_pools,
            clock,
            settings,
            addr: app.local_addr(),
            metrics_addr: app.metrics_addr(),
            console_addr: app.console_addr(),
            url,
            app: Some(app),
        }
    }

    /// A connection of its own as the server's role (under row-level security), for tests
    /// that probe the policies in SQL.
    pub async fn service_connection(&self) -> PgConnection {
        PgConnection::connect(&service_url(&self.url))
            .await
            .unwrap()
    }

    /// The proof outboxd gives for `tenants` (the secret read as the superuser).
    pub async fn scope_proof(&self, tenants: &str) -> String {
        outboxd::outbox::store::ScopeKey::load(&self.pool)
            .await
            .unwrap()
            .proof(tenants)
    }

    /// The statement that scopes a transaction of the service role to `tenants`, with the
    /// proof outboxd would give.
    pub async fn scope_statement(&self, tenants: &str) -> String {
        let proof = self.scope_proof(tenants).await;
        format!("SELECT outbox.enter_scope('{tenants}', '{proof}')")
    }

    /// A connection of its own as the server's fleet role (every tenant).
    pub async fn fleet_connection(&self) -> PgConnection {
        PgConnection::connect(&fleet_url(&self.url)).await.unwrap()
    }

    /// A client with the default key (clones share the connection).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// A client sending `key` (and `tenant` in x-outbox-tenant), or no key at all.
    pub async fn client_with(&self, key: Option<&str>, tenant: Option<&str>) -> Client {
        let credentials = Credentials::new(key, tenant).unwrap();
        outboxd::client::client(self.client_channel().await, credentials)
    }

    /// Creates an API key directly in the database, as `outboxd keys create` does.
    pub async fn key(&self, tenants: &[&str], scopes: &[&str], regions: &[&str]) -> String {
        create_key(&self.pool, "test", tenants, scopes, regions).await
    }

    /// Revokes the key whose secret is `key`, by its id (every key of [`Self::key`] is
    /// named "test").
    pub async fn revoke(&self, key: &str) {
        let id: uuid::Uuid =
            sqlx::query_scalar("SELECT id FROM outbox.api_key WHERE key_hash = $1")
                .bind(&outboxd::auth::hash_key(key)[..])
                .fetch_one(&self.pool)
                .await
                .unwrap();
        let matched = outboxd::outbox::store::revoke_api_key(&self.pool, &id.to_string())
            .await
            .unwrap();
        assert_eq!(matched, 1);
    }

    /// A raw channel to the server, for the non-outbox services (health).
    pub async fn client_channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// A producer connection to the outbox's own database.
    pub async fn producer(&self) -> PgConnection {
        PgConnection::connect(&self.url).await.unwrap()
    }

    /// Waits, with a deadline, until the intent is in `state`.
    pub async fn wait_for_state(&self, id: &str, state: v1::IntentState) {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            let now = self.state(id).await;
            if now == state {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{id} stayed {now:?}, never {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A direct Enqueue of `intents` through a client of its own, running in the background.
    pub fn spawn_enqueue(
        &self,
        intents: Vec<v1::NewIntent>,
    ) -> tokio::task::JoinHandle<Result<Vec<v1::EnqueueResult>, Status>> {
        let mut client = self.client();
        tokio::spawn(async move {
            client
                .enqueue(v1::EnqueueRequest {
                    intents,
                    txn_token: String::new(),
                })
                .await
                .map(|r| r.into_inner().results)
        })
    }

    /// Enqueues a `charge` of 100 cents under idempotency key `key`; returns the same
    /// intent with another payload, which an Enqueue must refuse (`IDEMPOTENCY_CONFLICT`).
    pub async fn conflicting_with_a_held_key(&self, key: &str) -> v1::NewIntent {
        let mut held = intent("charge", r#"{"cents":100}"#);
        held.idempotency_key = key.into();
        self.enqueue(vec![held.clone()]).await.unwrap();
        v1::NewIntent {
            payload: br#"{"cents":999}"#.to_vec(),
            ..held
        }
    }

    /// A PENDING intent of `kind`, due now, inserted by SQL behind the server's back:
    /// nothing announces it. Its id.
    pub async fn insert_by_sql(&self, kind: &str) -> String {
        sqlx::query_scalar(
            "INSERT INTO outbox.intent (id, tenant_id, kind, payload, state, max_attempts, \
                                        available_at, created_at, updated_at, level_key) \
             VALUES (gen_random_uuid(), $1, $2, '', 'pending', 5, $3, $3, $3, \
                     hashtextextended($1 || '/' || $2, 0)) \
             RETURNING id::text",
        )
        .bind(TENANT)
        .bind(kind)
        .bind(self.clock.now())
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// A session holding a SHARE lock on `outbox.intent` in an open transaction: every
    /// insert waits behind it until `COMMIT` on that session.
    pub async fn lock_intent_table(&self) -> PgConnection {
        let mut locker = PgConnection::connect(&self.url).await.unwrap();
        sqlx::raw_sql("BEGIN; LOCK TABLE outbox.intent IN SHARE MODE")
            .execute(&mut locker)
            .await
            .unwrap();
        locker
    }

    /// A session holding intent `id`'s row locked (`FOR UPDATE`) in an open transaction:
    /// every change of that intent waits behind it until `COMMIT` on that session.
    pub async fn lock_intent_row(&self, id: &str) -> PgConnection {
        let mut locker = PgConnection::connect(&self.url).await.unwrap();
        sqlx::raw_sql("BEGIN").execute(&mut locker).await.unwrap();
        sqlx::query("SELECT 1 FROM outbox.intent WHERE id = $1::uuid FOR UPDATE")
            .bind(id)
            .execute(&mut locker)
            .await
            .unwrap();
        locker
    }

    /// How many sessions of the test database wait on a lock now.
    pub async fn lock_waiters(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    /// Waits (with a deadline) until `n` sessions of the test database wait on a lock.
    pub async fn wait_for_lock_waiters(&self, n: i64) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let waiting = self.lock_waiters().await;
            if waiting >= n {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "only {waiting} of {n} calls reached the lock"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits (with a deadline) until the metrics page has the line `line`.
    pub async fn wait_for_metric(&self, line: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let text = self.scrape().await;
            if text.lines().any(|l| l == line) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {line:?} in the metrics:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// GET /metrics, the body as text.
    pub async fn scrape(&self) -> String {
        let (status, _, body) = self.admin_get("/metrics", None).await;
        assert_eq!(status, 200, "{body}");
        body
    }

    /// GET `path` from the admin listener (`/metrics`, `/livez`, `/readyz`) with `accept`
    /// as its Accept header: the status code, the headers (lowercase names) and the body.
    pub async fn admin_get(
        &self,
        path: &str,
        accept: Option<&str>,
    ) -> (u16, Vec<(String, String)>, String) {
        let addr = self.metrics_addr.expect("metrics enabled");
        let accept = accept
            .map(|a| format!("Accept: {a}\r\n"))
            .unwrap_or_default();
        http_exchange(
            addr,
            &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n"),
        )
        .await
    }

    /// Takes the application out, to stop it from another task.
    pub fn take_application(&mut self) -> Application {
        self.app.take().expect("running")
    }

    pub async fn stop(mut self) {
        if let Some(app) = self.app.take() {
            app.stop().await.unwrap();
        }
    }

    /// Pauses `n` kinds (`kind-0`, …), each policy with a reason of 4,096 bytes (the most),
    /// so that a few fill a page; their kinds.
    pub async fn pause_with_long_reasons(&self, n: usize) -> Vec<String> {
        let kinds: Vec<String> = (0..n).map(|n| format!("kind-{n}")).collect();
        for kind in &kinds {
            let request = v1::SetQueuePolicyRequest {
                kind: kind.clone(),
                paused: true,
                actor: "ops".to_owned(),
                reason: "r".repeat(4096),
                ..Default::default()
            };
            self.client().set_queue_policy(request).await.unwrap();
        }
        kinds
    }

    /// Runs the lease rescue as the background sweep would, at the manual clock's time.
    pub async fn rescue(&self) -> SweepReport {
        maintenance::rescue_all(&self.service_pools, &self.maintenance(), &self.clock)
            .await
            .unwrap()
    }

    /// Runs a pass of the promotion of STAGED intents as the background task would.
    pub async fn promote(&self) -> outboxd::outbox::store::PromotionReport {
        outboxd::outbox::promotion::promote_all(&self.service_pools, &self.clock)
            .await
            .unwrap()
    }

    /// Runs the retention purge as the background sweep would.
    pub async fn purge(&self) -> u64 {
        maintenance::purge_all(&self.service_pools, &self.maintenance(), &self.clock)
            .await
            .unwrap()
    }

    /// Runs a pass of the sweep that forgets empty queues, at the manual clock's time.
    pub async fn forget_empty_queues(&self) -> u64 {
        maintenance::forget_empty_queues(&self.service_pools, &self.clock)
            .await
            .unwrap()
    }

    fn maintenance(&self) -> MaintenanceConfig {
        self.settings.maintenance.clone()
    }

    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    pub async fn enqueue(
        &self,
        intents: Vec<v1::NewIntent>,
    ) -> Result<Vec<v1::EnqueueResult>, Status> {
        self.client()
            .enqueue(v1::EnqueueRequest {
                intents,
                txn_token: String::new(),
            })
            .await
            .map(|r| r.into_inner().results)
    }

    /// Enqueues one intent of `kind` and returns its id.
    pub async fn enqueue_one(&self, kind: &str, payload: &str) -> String {
        let results = self.enqueue(vec![intent(kind, payload)]).await.unwrap();
        results[0].id.clone()
    }

    /// Enqueues `n` intents of `kind` and returns their ids in order.
    pub async fn enqueue_n(&self, kind: &str, n: usize) -> Vec<String> {
        let intents = (0..n)
            .map(|i| intent(kind, &format!("{{\"n\":{i}}}")))
            .collect();
        self.enqueue_ids(intents).await
    }

    /// Enqueues `n` intents with the default limit's largest payload ([`LARGEST_PAYLOAD`]
    /// bytes of `x`) and returns their ids in order.
    pub async fn enqueue_largest_payloads(&self, n: usize) -> Vec<String> {
        let intents = (0..n)
            .map(|_| v1::NewIntent {
                payload: vec![b'x'; LARGEST_PAYLOAD],
                ..intent("big", "")
            })
            .collect();
        self.enqueue_ids(intents).await
    }

    /// Enqueues `intents`, which must be accepted, and returns their ids in order.
    pub async fn enqueue_ids(&self, intents: Vec<v1::NewIntent>) -> Vec<String> {
        self.enqueue(intents)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.id)
            .collect()
    }

    pub async fn claim(&self, request: v1::ClaimRequest) -> Result<Vec<v1::Lease>, Status> {
        self.client()
            .claim(request)
            .await
            .map(|r| r.into_inner().leases)
    }

    /// Claims up to `n` intents of any kind as `worker` with the default lease.
    pub async fn claim_n(&self, worker: &str, n: i32) -> Vec<v1::Lease> {
        self.claim(claim_request(worker, n)).await.unwrap()
    }

    /// [`Self::claim_n`], the ids of the intents leased, in the order of the reply.
    pub async fn claim_ids(&self, worker: &str, n: i32) -> Vec<String> {
        let leases = self.claim_n(worker, n).await;
        leases.iter().map(|l| id_of(l).to_owned()).collect()
    }

    pub async fn ack(&self, leases: &[&v1::Lease]) -> Vec<v1::LeaseResult> {
        self.client()
            .ack(v1::AckRequest {
                leases: leases.iter().map(|l| lease_ref(l)).collect(),
            })
            .await
            .unwrap()
            .into_inner()
            .results
    }

    pub async fn fail(&self, lease: &v1::Lease, outcome: v1::FailOutcome) -> v1::LeaseResult {
        self.fail_with(failure(lease, outcome)).await
    }

    pub async fn fail_with(&self, failure: v1::Failure) -> v1::LeaseResult {
        let mut results = self
            .client()
            .fail(v1::FailRequest {
                failures: vec![failure],
            })
            .await
            .unwrap()
            .into_inner()
            .results;
        results.remove(0)
    }

    pub async fn mark_submitted(&self, leases: &[&v1::Lease]) -> Vec<v1::LeaseResult> {
        self.client()
            .mark_submitted(v1::MarkSubmittedRequest {
                leases: leases.iter().map(|l| lease_ref(l)).collect(),
            })
            .await
            .unwrap()
            .into_inner()
            .results
    }

    pub async fn extend(&self, leases: &[&v1::Lease], by: Duration) -> Vec<v1::LeaseResult> {
        self.client()
            .extend_lease(v1::ExtendLeaseRequest {
                leases: leases.iter().map(|l| lease_ref(l)).collect(),
                lease_duration: Some(duration(by)),
            })
            .await
            .unwrap()
            .into_inner()
            .results
    }

    pub async fn reconcile(
        &self,
        request: v1::ReconcileRequest,
    ) -> Result<Vec<v1::ReconcileResult>, Status> {
        self.client()
            .reconcile(request)
            .await
            .map(|r| r.into_inner().results)
    }

    pub async fn get(&self, id: &str) -> v1::GetIntentResponse {
        self.client()
            .get_intent(v1::GetIntentRequest { id: id.to_owned() })
            .await
            .unwrap()
            .into_inner()
    }

    pub async fn intent(&self, id: &str) -> v1::Intent {
        self.get(id).await.intent.unwrap()
    }

    pub async fn state(&self, id: &str) -> v1::IntentState {
        self.intent(id).await.state()
    }

    /// Every intent ListIntents shows in `states` (empty: all), with payloads, read page
    /// by page of `page_size`.
    pub async fn list_all(&self, states: &[v1::IntentState], page_size: i32) -> Vec<v1::Intent> {
        let mut listed = Vec::new();
        let mut page_token = String::new();
        loop {
            let page = self
                .client()
                .list_intents(v1::ListIntentsRequest {
                    states: states.iter().map(|s| *s as i32).collect(),
                    page_size,
                    page_token,
                    include_payload: true,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            listed.extend(page.intents);
            if page.next_page_token.is_empty() {
                return listed;
            }
            page_token = page.next_page_token;
        }
    }

    /// GetQueueStats' count of `state` in `region`, or in every region when `None`.
    pub async fn stat(&self, state: v1::IntentState, region: Option<&str>) -> i64 {
        self.client()
            .get_queue_stats(v1::GetQueueStatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .counts
            .iter()
            .filter(|c| c.state() == state && region.is_none_or(|r| c.region == r))
            .map(|c| c.count)
            .sum()
    }

    /// Every intent's row as text (delivered history included), to prove a rejected request
    /// changed nothing.
    pub async fn snapshot(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT row_to_json(i)::text FROM outbox.all_intents i ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

/// Stores a key; `tenants == ["*"]` means every tenant.
pub async fn create_key(
    pool: &PgPool,
    name: &str,
    tenants: &[&str],
    scopes: &[&str],
    regions: &[&str],
) -> String {
    let owned = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let tenants = (tenants != ["*"]).then(|| owned(tenants));
    let (_, secret) = outboxd::auth::issue_key(pool, name, tenants, owned(scopes), owned(regions))
        .await
        .unwrap();
    secret
}

/// The default limit's largest payload (`OUTBOX_LIMITS__MAX_PAYLOAD_BYTES`).
pub const LARGEST_PAYLOAD: usize = 1024 * 1024;

pub fn intent(kind: &str, payload: &str) -> v1::NewIntent {
    v1::NewIntent {
        kind: kind.to_owned(),
        payload: payload.as_bytes().to_vec(),
        content_type: "application/json".to_owned(),
        ..Default::default()
    }
}

/// An intent of `kind` that becomes claimable `by` after it is enqueued.
pub fn delayed_intent(kind: &str, by: Duration) -> v1::NewIntent {
    v1::NewIntent {
        schedule: Some(v1::new_intent::Schedule::Delay(duration(by))),
        ..intent(kind, "{}")
    }
}

pub fn claim_request(worker: &str, n: i32) -> v1::ClaimRequest {
    v1::ClaimRequest {
        worker_id: worker.to_owned(),
        max_intents: n,
        ..Default::default()
    }
}

pub fn lease_ref(lease: &v1::Lease) -> v1::LeaseRef {
    v1::LeaseRef {
        intent_id: lease.intent.as_ref().unwrap().id.clone(),
        lease_id: lease.lease_id.clone(),
    }
}

pub fn failure(lease: &v1::Lease, outcome: v1::FailOutcome) -> v1::Failure {
    v1::Failure {
        lease: Some(lease_ref(lease)),
        error: "boom".to_owned(),
        outcome: outcome as i32,
        retry_after: None,
    }
}

pub fn id_of(lease: &v1::Lease) -> &str {
    &lease.intent.as_ref().unwrap().id
}

pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub fn secs(t: &Option<prost_types::Timestamp>) -> f64 {
    let t = t.as_ref().expect("timestamp set");
    t.seconds as f64 + f64::from(t.nanos) / 1e9
}

/// Asserts a whole-call error: its code, its ErrorInfo reason and, if given, the fields
/// its BadRequest names.
pub fn assert_status(status: &Status, code: Code, reason: &str, fields: &[&str]) {
    assert_eq!(status.code(), code, "{status:?}");
    let details = status.get_error_details();
    let info = details
        .error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.reason, reason, "{status:?}");
    assert_eq!(info.domain, "outboxd");
    if !fields.is_empty() {
        let violations: Vec<&str> = details
            .bad_request()
            .map(|b| {
                b.field_violations
                    .iter()
                    .map(|v| v.field.as_str())
                    .collect()
            })
            .unwrap_or_default();
        for field in fields {
            assert!(violations.contains(field), "{field} not in {violations:?}");
        }
    }
}

/// Asserts a per-item error.
pub fn assert_item_error(result: &v1::LeaseResult, code: Code, reason: &str) {
    let error = result
        .error
        .as_ref()
        .unwrap_or_else(|| panic!("no error in {result:?}"));
    assert_eq!(error.code, code as i32, "{result:?}");
    assert_eq!(error.reason, reason, "{result:?}");
}

/// Asserts a per-item success and the state it left.
pub fn assert_item_ok(result: &v1::LeaseResult, state: v1::IntentState) {
    assert!(result.error.is_none(), "{result:?}");
    assert_eq!(result.state(), state, "{result:?}");
}

/// Tenant `globex`'s world, beside the default key's `acme`: a pending intent, a leased one (with its lease) and one awaiting a decision.
pub struct OtherTenant {
    pub pending: String,
    pub leased: v1::Lease,
    pub waiting: String,
}

pub async fn populate_globex(app: &TestApp) -> OtherTenant {
    let key = app.key(&["globex"], &["produce", "consume"], &[]).await;
    let mut b = app.client_with(Some(&key), None).await;
    let ids: Vec<String> = b
        .enqueue(v1::EnqueueRequest {
            intents: vec![intent("b", "1"), intent("b", "2"), intent("b", "3")],
            txn_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .results
        .into_iter()
        .map(|r| r.id)
        .collect();
    let leases = b
        .claim(claim_request("b-worker", 2))
        .await
        .unwrap()
        .into_inner()
        .leases;
    b.fail(v1::FailRequest {
        failures: vec![failure(&leases[1], v1::FailOutcome::Unknown)],
    })
    .await
    .unwrap();
    OtherTenant {
        pending: ids[2].clone(),
        leased: leases[0].clone(),
        waiting: id_of(&leases[1]).to_owned(),
    }
}

/// Sends `request` (one whole HTTP/1.1 request, `Connection: close`) to `addr`: the status
/// code, the headers (lowercase names) and the body.
pub async fn http_exchange(
    addr: std::net::SocketAddr,
    request: &str,
) -> (u16, Vec<(String, String)>, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    (status, headers, body.to_owned())
}
