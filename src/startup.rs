//! Wiring: the database (external or embedded), migrations, and the gRPC server with its
//! health, reflection and background tasks, served until a shutdown signal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;

use crate::admin::{self, Readiness};
use crate::auth::Authenticator;
use crate::config::Settings;
use crate::embedded::{EmbeddedConfig, EmbeddedPostgres};
use crate::grpc::OutboxHandler;
use crate::metrics::{self, Metrics, RpcMetricsLayer};
use crate::outbox::notify::PendingSignal;
use crate::outbox::{Clock, maintenance, promotion, store};
use crate::proto::v1::outbox_service_server::OutboxServiceServer;
use crate::watch::EndsAtShutdown;

/// Name of the database outboxd creates in its embedded cluster.
pub const EMBEDDED_DATABASE: &str = "outbox";

/// Opens a pool. Commits are durable: `synchronous_commit` is forced on for every session,
/// whatever the server default, because an OK must mean the intent survives a crash. JIT
/// compilation is off: outboxd's statements are short, and a plan whose cost is inflated
/// by the index-only settings (`AlsoAtBegin::IndexPlans`) was JIT-compiled on every run
/// (20 ms per lease-rescue sweep, 36 ms per metrics refresh, measured).
///
/// # Errors
/// A malformed URL or an unreachable database.
pub async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options = session_options(url, "OUTBOX_DATABASE__URL")?;
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        // A connection is pinged before use only when it sat idle for over a second (as
        // pgxpool does): pinging on every acquire is one more round trip per call, a good
        // part of a call's cost under load. A connection that broke anyway is found by the
        // BEGIN every call starts with, which store::begin retries on another connection.
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for > Duration::from_secs(1) {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
        .context("cannot connect to PostgreSQL")
}

/// Applies pending migrations. Safe with replicas starting together: sqlx holds an
/// advisory lock while it migrates.
///
/// # Errors
/// A database created by a build before 0.1.0 (`refuse_pre_baseline`), a failed or
/// modified migration.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    refuse_pre_baseline(pool).await?;
    let mut conn = pool.acquire().await.context("cannot connect to migrate")?;
    // sqlx creates its table with IF NOT EXISTS at every run, and PostgreSQL answers with
    // a NOTICE ("relation _sqlx_migrations already exists, skipping") that sqlx logs at
    // INFO on every start. Notices say nothing an operator needs here; warnings still
    // come through.
    sqlx::query("SET client_min_messages = warning")
        .execute(&mut *conn)
        .await
        .context("cannot connect to migrate")?;
    // A database a newer release migrated (a rollback, or its replicas beside this one in
    // a rolling update) holds migrations this binary does not know: they are additive
    // (docs/development.md), so it runs on them where sqlx would refuse the database.
    let migrator = sqlx::migrate::Migrator {
        migrations: crate::MIGRATOR.migrations.clone(),
        ignore_missing: true,
        locking: crate::MIGRATOR.locking,
        no_tx: crate::MIGRATOR.no_tx,
    };
    let migrated = migrator.run(&mut *conn).await.context("migrations failed");
    // The connection goes back to the pool: back to the server's default for the next user.
    if migrated.is_ok() {
        sqlx::query("RESET client_min_messages")
            .execute(&mut *conn)
            .await?;
    } else {
        conn.close_on_drop();
    }
    migrated
}

/// Refuses a database that holds migrations older than the first one this binary carries,
/// the 0.1.0 baseline: it was created by a build before 0.1.0, whose migrations were
/// squashed into that baseline, and cannot be upgraded. (sqlx alone would only report the
/// first of them as missing.)
async fn refuse_pre_baseline(pool: &PgPool) -> anyhow::Result<()> {
    let Some(baseline) = crate::MIGRATOR.iter().map(|m| m.version).min() else {
        return Ok(());
    };
    // sqlx's table, where sqlx looks for it (the first schema of the search path).
    let recorded: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(pool)
        .await
        .context("cannot read the applied migrations")?;
    if !recorded {
        return Ok(());
    }
    let oldest: Option<i64> = sqlx::query_scalar("SELECT min(version) FROM _sqlx_migrations")
        .fetch_one(pool)
        .await
        .context("cannot read the applied migrations")?;
    match oldest {
        Some(oldest) if oldest < baseline => anyhow::bail!(
            "this database was created by a pre-0.1.0 build of outboxd (it holds migration \
             {oldest}, older than the 0.1.0 baseline {baseline}) and cannot be upgraded: \
             recreate it (a new database, or drop the `outbox` schema and the \
             `_sqlx_migrations` table; for the embedded cluster, remove its data directory, \
             OUTBOX_EMBEDDED__DATA_DIR) and migrate again (see docs/operating.md)"
        ),
        _ => Ok(()),
    }
}

/// Role the embedded cluster's outboxd connects as: it owns nothing, so row-level
/// security applies to it.
pub const EMBEDDED_SERVICE_ROLE: &str = "outboxd_service";

/// The role granted every tenant (migration `…03_baseline_tenancy`, docs/tenancy.md): its
/// members' sessions see every tenant's rows, and the service role must not be one.
pub const FLEET_ROLE: &str = "outboxd_fleet";

/// Login role the embedded cluster's fleet pool connects as: a member of [`FLEET_ROLE`]
/// that owns nothing.
pub const EMBEDDED_FLEET_ROLE: &str = "outboxd_fleet_service";

/// Starts the embedded cluster of `settings` (blocking work, run off the runtime) and
/// makes sure its `outbox` database exists. Returns the cluster and the superuser URL of
/// that database.
///
/// # Errors
/// No PostgreSQL binaries, an unusable data directory, or a server that does not start.
pub async fn start_embedded(settings: &Settings) -> anyhow::Result<(EmbeddedPostgres, String)> {
    let mut config = EmbeddedConfig::new(&settings.embedded.data_dir);
    config.port = settings.embedded.port;
    let cluster = tokio::task::spawn_blocking(move || EmbeddedPostgres::start(config))
        .await?
        .context(
            "cannot start the embedded PostgreSQL (set OUTBOX_DATABASE__URL to use your own)",
        )?;
    let admin = connect(&cluster.url("postgres"), 2).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(EMBEDDED_DATABASE)
            .fetch_one(&admin)
            .await?;
    if !exists {
        // The name is a constant, not input: no injection through this format.
        sqlx::query(&format!("CREATE DATABASE {EMBEDDED_DATABASE}"))
            .execute(&admin)
            .await?;
    }
    admin.close().await;
    let url = cluster.url(EMBEDDED_DATABASE);
    Ok((cluster, url))
}

/// The database a server uses: the URLs to serve through, and the embedded cluster when
/// outboxd runs its own (stopped by the caller after serving).
pub struct Database {
    /// URL of the service role.
    pub service_url: String,
    /// URL of the fleet role (a member of [`FLEET_ROLE`]), for work across tenants; `None`
    /// when `OUTBOX_DATABASE__FLEET_URL` is not set, which only `outboxd migrate` accepts.
    pub fleet_url: Option<String>,
    /// The embedded cluster, if any.
    pub embedded: Option<EmbeddedPostgres>,
}

/// Gets the database ready to serve: the embedded cluster started, migrated and given its
/// service and fleet roles; or, for an external database, migrated with
/// `OUTBOX_DATABASE__MIGRATION_URL` when it is set (granting the service role of
/// `OUTBOX_DATABASE__URL` what it needs, and making the role of `OUTBOX_DATABASE__FLEET_URL`,
/// when set, a member of `outboxd_fleet` if it is not one yet).
///
/// # Errors
/// The cluster does not start, a migration fails, or the grants fail.
pub async fn prepare_database(settings: &Settings) -> anyhow::Result<Database> {
    let Some(service_url) = &settings.database.url else {
        let (cluster, owner_url) = start_embedded(settings).await?;
        let owner = connect(&owner_url, 2).await?;
        migrate(&owner).await?;
        grant_service_role(&owner, EMBEDDED_SERVICE_ROLE, true).await?;
        grant_fleet_role(&owner, EMBEDDED_FLEET_ROLE, true).await?;
        owner.close().await;
        let service_url = format!(
            "postgres://{EMBEDDED_SERVICE_ROLE}@127.0.0.1:{}/{EMBEDDED_DATABASE}",
            cluster.port()
        );
        let fleet_url = format!(
            "postgres://{EMBEDDED_FLEET_ROLE}@127.0.0.1:{}/{EMBEDDED_DATABASE}",
            cluster.port()
        );
        tracing::info!(
            data_dir = %settings.embedded.data_dir.display(),
            database.url = %service_url,
            "using the embedded PostgreSQL cluster"
        );
        return Ok(Database {
            service_url,
            fleet_url: Some(fleet_url),
            embedded: Some(cluster),
        });
    };
    if let Some(owner_url) = &settings.database.migration_url {
        let user = |url: &str, variable: &str| {
            url.parse::<PgConnectOptions>()
                .with_context(|| format!("{variable} is not a valid PostgreSQL URL"))
                .map(|o| o.get_username().to_owned())
        };
        let role = user(service_url, "OUTBOX_DATABASE__URL")?;
        let owner = connect(owner_url, 2).await?;
        migrate(&owner).await?;
        grant_service_role(&owner, &role, false).await?;
        if let Some(fleet_url) = &settings.database.fleet_url {
            let fleet_role = user(fleet_url, "OUTBOX_DATABASE__FLEET_URL")?;
            grant_fleet_role(&owner, &fleet_role, false).await?;
        }
        owner.close().await;
    }
    Ok(Database {
        service_url: service_url.clone(),
        fleet_url: settings.database.fleet_url.clone(),
        embedded: None,
    })
}

/// The service and fleet pools of `database`, each checked to be what its role must be
/// ([`verify_service_role`], [`verify_fleet_role`]), with up to `max_connections` each.
///
/// # Errors
/// No fleet URL, a pool does not connect, or its role is not fit for it.
pub async fn connect_pools(
    database: &Database,
    max_connections: u32,
) -> anyhow::Result<store::Pools> {
    let fleet_url = database.fleet_url.as_deref().context(
        "OUTBOX_DATABASE__FLEET_URL is not set: outboxd needs a second role, a member of \
         outboxd_fleet, for the work of every tenant (lease rescue, retention, promotion, queue \
         gauges, keys bound to all tenants); see \"An external PostgreSQL\" in docs/security.md",
    )?;
    let tenant = connect(&database.service_url, max_connections).await?;
    verify_service_role(&tenant).await?;
    let fleet = connect(fleet_url, max_connections)
        .await
        .context("the fleet role (OUTBOX_DATABASE__FLEET_URL)")?;
    verify_fleet_role(&fleet).await?;
    store::Pools::open(tenant, fleet)
        .await
        .context("cannot read outbox.scope_secret through the fleet pool")
}

/// Makes `role` a member of `outboxd_fleet` (`outbox.grant_fleet_role`, which does nothing
/// when it already is one), creating it as a login role first when `create` is set (the
/// embedded cluster and the tests, trust auth).
///
/// # Errors
/// A role name that is not a plain identifier, or a failed grant.
pub async fn grant_fleet_role(owner: &PgPool, role: &str, create: bool) -> anyhow::Result<()> {
    if create {
        create_login_role(owner, role).await?;
    } else {
        check_identifier(role)?;
    }
    sqlx::query("SELECT outbox.grant_fleet_role($1)")
        .bind(role)
        .execute(owner)
        .await
        .with_context(|| format!("making {role:?} a member of outboxd_fleet"))?;
    Ok(())
}

fn check_identifier(role: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !role.is_empty()
            && role
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
        "role {role:?} must be a lowercase identifier"
    );
    Ok(())
}

/// Creates `role` as a login role unless it exists.
async fn create_login_role(owner: &PgPool, role: &str) -> anyhow::Result<()> {
    check_identifier(role)?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = $1)")
            .bind(role)
            .fetch_one(owner)
            .await?;
    if !exists {
        // Checked above to be a plain identifier; CREATE ROLE takes no parameters.
        match sqlx::query(&format!("CREATE ROLE {role} LOGIN"))
            .execute(owner)
            .await
        {
            // 42710: another replica created it meanwhile (23505: at the same moment).
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("42710" | "23505")) => {}
            other => {
                other?;
            }
        }
    }
    Ok(())
}

/// Gives `role` the privileges the service needs (`outbox.grant_service_role`), creating
/// it as a login role first when `create` is set (the embedded cluster, trust auth).
///
/// # Errors
/// A role name that is not a plain identifier, or a failed grant.
pub async fn grant_service_role(owner: &PgPool, role: &str, create: bool) -> anyhow::Result<()> {
    if create {
        create_login_role(owner, role).await?;
    } else {
        check_identifier(role)?;
    }
    sqlx::query("SELECT outbox.grant_service_role($1)")
        .bind(role)
        .execute(owner)
        .await
        .with_context(|| format!("granting the service role {role:?}"))?;
    Ok(())
}

/// Refuses to serve requests through a role for which row-level security would not
/// isolate tenants: one that bypasses it, owns the tables (or may become their owner), sees
/// every tenant (a member of `outboxd_fleet`), or could make itself a member (CREATEROLE,
/// which in PostgreSQL 15 grants any role that is no superuser).
///
/// # Errors
/// The role is any of those.
pub async fn verify_service_role(pool: &PgPool) -> anyhow::Result<()> {
    let (role, superuser, bypass, owner, fleet, createrole, secret): (
        String,
        bool,
        bool,
        bool,
        bool,
        bool,
        bool,
    ) = sqlx::query_as(
        r#"
            SELECT r.rolname::text, r.rolsuper, r.rolbypassrls,
                   pg_has_role(r.oid, c.relowner, 'MEMBER'),
                   pg_has_role(r.oid, 'outboxd_fleet', 'MEMBER'),
                   r.rolcreaterole,
                   has_table_privilege(r.oid, 'outbox.scope_secret', 'SELECT')
            FROM pg_roles r, pg_class c
            WHERE r.rolname = current_user
              AND c.oid = 'outbox.intent'::regclass
            "#,
    )
    .fetch_one(pool)
    .await
    .context("cannot inspect the service role (are the migrations applied?)")?;
    let problem = if superuser {
        "is a superuser"
    } else if bypass {
        "has BYPASSRLS"
    } else if owner {
        "owns the outbox tables (or is a member of their owner)"
    } else if fleet {
        "is a member of outboxd_fleet, which sees every tenant"
    } else if createrole {
        "has CREATEROLE, and so could make itself a member of outboxd_fleet"
    } else if secret {
        "may read outbox.scope_secret, and so could prove any tenant scope"
    } else {
        return Ok(());
    };
    anyhow::bail!(
        "outboxd connects as role {role:?}, which {problem}: row-level security would not isolate \
         tenants. Connect with a role that owns nothing and run \
         `SELECT outbox.grant_service_role('<role>')` as the schema owner (see docs/security.md)"
    )
}

/// Refuses a fleet pool whose role does not see every tenant: it must have the privileges
/// of `outboxd_fleet` (be a member that inherits them), or the sweeps would find nothing.
///
/// # Errors
/// The role has not the privileges of `outboxd_fleet`.
pub async fn verify_fleet_role(pool: &PgPool) -> anyhow::Result<()> {
    let (role, fleet): (String, bool) = sqlx::query_as(
        "SELECT current_user::text, pg_has_role(current_user, 'outboxd_fleet', 'USAGE')",
    )
    .fetch_one(pool)
    .await
    .context("cannot inspect the fleet role (are the migrations applied?)")?;
    anyhow::ensure!(
        fleet,
        "the fleet pool connects as role {role:?}, which is no member of outboxd_fleet (or does \
         not inherit its privileges): it would see no tenant's rows. Run \
         `SELECT outbox.grant_fleet_role('{role}')` (or `GRANT outboxd_fleet TO {role}`) as a \
         role that may grant outboxd_fleet (see docs/tenancy.md)"
    );
    Ok(())
}

/// What every session outboxd opens is set to (see [`connect`]); `variable` names the
/// setting a malformed `url` came from. `client_connection_check_interval`: a statement
/// still running when this process is gone (a call cut at the end of the shutdown grace,
/// waiting on a lock) is rolled back within a second instead of committing for nobody.
fn session_options(url: &str, variable: &str) -> anyhow::Result<PgConnectOptions> {
    let options: PgConnectOptions = url
        .parse()
        .with_context(|| format!("{variable} is not a valid PostgreSQL URL"))?;
    Ok(options
        .options([
            ("synchronous_commit", "on"),
            ("jit", "off"),
            ("client_connection_check_interval", "1s"),
        ])
        .application_name("outboxd"))
}

/// The schema owner's connection the console mints and revokes keys through, when the
/// server has one: `OUTBOX_DATABASE__MIGRATION_URL`, or the running embedded cluster's.
/// Connected on first use, one connection.
fn console_owner(settings: &Settings) -> anyhow::Result<Option<PgPool>> {
    let url =
        settings.database.migration_url.clone().or_else(|| {
            settings.database.url.is_none().then(|| {
                crate::embedded::running_url(&settings.embedded.data_dir, EMBEDDED_DATABASE)
            })?
        });
    url.map(|url| {
        // A key shown as minted or revoked must survive a crash: the same durable
        // sessions as every other pool's.
        let options = session_options(&url, "OUTBOX_DATABASE__MIGRATION_URL")?;
        Ok(PgPoolOptions::new()
            .max_connections(1)
            .connect_lazy_with(options))
    })
    .transpose()
}

/// The schema owner's URL, for `migrate` and key management: `OUTBOX_DATABASE__MIGRATION_URL`,
/// else `OUTBOX_DATABASE__URL`, else the embedded cluster (the running server's, or started
/// here and returned so the caller stops it).
///
/// # Errors
/// The embedded cluster does not start.
pub async fn owner_database(
    settings: &Settings,
) -> anyhow::Result<(Option<EmbeddedPostgres>, String)> {
    if let Some(url) = settings
        .database
        .migration_url
        .as_ref()
        .or(settings.database.url.as_ref())
    {
        return Ok((None, url.clone()));
    }
    if let Some(url) = crate::embedded::running_url(&settings.embedded.data_dir, EMBEDDED_DATABASE)
    {
        return Ok((None, url));
    }
    let (cluster, url) = start_embedded(settings).await?;
    Ok((Some(cluster), url))
}

/// `error` with what to do when it is PostgreSQL refusing a privilege to
/// `OUTBOX_DATABASE__URL`, taken for the owner's because `OUTBOX_DATABASE__MIGRATION_URL`
/// is unset (as [`owner_database`] does): the service role may not migrate nor mint keys.
pub fn with_owner_hint(settings: &Settings, error: anyhow::Error) -> anyhow::Error {
    let refused = error.chain().any(|cause| {
        let sqlx_error = match cause.downcast_ref::<crate::outbox::Error>() {
            Some(crate::outbox::Error::Database(e)) => Some(e),
            _ => cause.downcast_ref::<sqlx::Error>(),
        };
        sqlx_error
            .and_then(sqlx::Error::as_database_error)
            .and_then(|db| db.code())
            .is_some_and(|code| code == "42501")
    });
    if refused && settings.database.migration_url.is_none() && settings.database.url.is_some() {
        error.context(
            "OUTBOX_DATABASE__URL was used as the schema owner's, since \
             OUTBOX_DATABASE__MIGRATION_URL is unset, and PostgreSQL refused it a privilege: \
             set OUTBOX_DATABASE__MIGRATION_URL to the owner's URL",
        )
    } else {
        error
    }
}

/// How a server's time and background work run; tests use a manual clock and drive the
/// sweeps themselves.
#[derive(Debug, Clone)]
pub struct Runtime {
    /// Source of "now".
    pub clock: Clock,
    /// Run lease rescue and retention purge in the background.
    pub maintenance: bool,
    /// A long-polling Claim looks again at least this often even without a notification,
    /// in case one was lost while the LISTEN connection was down.
    pub long_poll_recheck: Duration,
    /// How often the LISTEN connection must prove it still delivers
    /// (`outbox::notify`, [`PendingSignal::listen_until_stopped`]).
    pub listener_probe_every: Duration,
}

impl Default for Runtime {
    fn default() -> Self {
        Self {
            clock: Clock::Database,
            maintenance: true,
            long_poll_recheck: Duration::from_secs(2),
            listener_probe_every: Duration::from_secs(30),
        }
    }
}

/// A running outboxd server.
pub struct Application {
    local_addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    console_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    health: HealthReporter,
    readiness: Arc<Readiness>,
    drain_delay: Duration,
    grace: Duration,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<JoinHandle<()>>,
    /// The admin listener (metrics, /livez, /readyz), stopped by `admin_stop` last.
    admin: Option<JoinHandle<()>>,
    admin_stop: CancellationToken,
    pending: PendingSignal,
    /// Closed by [`Application::run_until_stopped`] within the grace.
    pools: store::Pools,
}

impl Application {
    /// Serves on `listener` over `pools` (already migrated: the service role's, and the
    /// fleet role's for work across tenants) until [`Application::stop`] or
    /// [`Application::run_until_stopped`] ends it.
    ///
    /// # Errors
    /// A listener without a local address, an unusable TLS or metrics configuration, or an
    /// invalid reflection descriptor.
    pub async fn start(
        settings: &Settings,
        pools: store::Pools,
        listener: TcpListener,
        runtime: Runtime,
    ) -> anyhow::Result<Self> {
        let mut metrics = Metrics::with_kinds(settings.metrics.kinds.0.clone());
        // Before anything holds a clone: every transaction's acquire is counted.
        let pools = metrics.observe_pools(pools);
        let metrics = Arc::new(metrics);
        let readiness = Arc::new(Readiness::default());
        let pool = pools.tenant().clone();
        let local_addr = listener.local_addr()?;
        // One for both listeners, read again when its files change (src/tls.rs).
        let tls = match &settings.tls {
            Some(tls) => Some(Arc::new(crate::tls::TlsFiles::load(tls)?)),
            None => None,
        };
        let shutdown = CancellationToken::new();
        let pending = PendingSignal::default();
        let cluster_id = store::cluster_identifier(&pool).await?;
        let mut background =
            spawn_background(settings, &pools, &runtime, &pending, &metrics, &shutdown);
        // The admin listener answers (/livez 200, /readyz 503) through the whole shutdown,
        // and stops after everything else.
        let admin_stop = CancellationToken::new();
        let (metrics_addr, admin) = match settings.metrics.listen_addr {
            Some(addr) => {
                let listener = admin::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen for metrics on {addr}"))?;
                let bound = listener.local_addr()?;
                let task = tokio::spawn(admin::serve(
                    metrics.clone(),
                    readiness.clone(),
                    listener,
                    settings.limits.max_http_connections,
                    admin_stop.clone(),
                ));
                (Some(bound), Some(task))
            }
            None => (None, None),
        };

        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<OutboxServiceServer<OutboxHandler>>()
            .await;
        background.push(tokio::spawn(watch_database(
            pools.clone(),
            health.clone(),
            readiness.clone(),
            shutdown.clone(),
        )));
        let auth = Arc::new(Authenticator::new(pool.clone(), settings.auth.cache_ttl));
        let handler = OutboxHandler::new(
            pools.clone(),
            auth,
            cluster_id,
            settings,
            runtime.clock.clone(),
            pending.clone(),
            shutdown.clone(),
        )
        .with_long_poll_recheck(runtime.long_poll_recheck)
        .with_metrics(metrics.clone());
        if let Some(tally) = handler.claim_tally() {
            background.push(tokio::spawn(
                crate::outbox::claim::tally::add_until_stopped(
                    tally.clone(),
                    pools.clone(),
                    shutdown.clone(),
                ),
            ));
        }
        let console_addr = match settings.console.listen_addr {
            Some(addr) => {
                let console = crate::console::Console {
                    handler: handler.clone(),
                    auth: Arc::new(Authenticator::new(pool.clone(), settings.auth.cache_ttl)),
                    pools: pools.clone(),
                    clock: runtime.clock.clone(),
                    session_ttl: settings.console.session_ttl,
                    secure: settings.tls.is_some(),
                    owner: console_owner(settings)?,
                };
                let listener = admin::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen for the console on {addr}"))?;
                let bound = listener.local_addr()?;
                background.push(tokio::spawn(crate::console::serve(
                    console,
                    listener,
                    tls.clone(),
                    settings.limits.max_http_connections,
                    shutdown.clone(),
                )));
                tracing::info!(console.addr = %bound, "outboxd serving the console");
                Some(bound)
            }
            None => None,
        };
        // hyper's guards against "rapid reset" floods: resets it must answer with errors
        // (which tonic's builder turns off unless it is given), and streams reset before
        // they were accepted, queued at once (hyper's 20 closed the connection of a client
        // cancelling a few hundred calls a second on a busy server, cutting the other
        // calls on it).
        let builder = tonic::transport::Server::builder()
            .http2_max_local_error_reset_streams(Some(RESET_STREAMS))
            .http2_max_pending_accept_reset_streams(Some(RESET_STREAMS))
            // Past it a client queues its calls; each stream holds a request being read.
            .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
            // A peer that stops answering pings (gone, or never reading) is closed.
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            // A call whose request never ends (a client stalling mid-message) would hold
            // what it received for good: cut past twice the longest a call may take.
            .timeout(2 * (settings.limits.max_wait + settings.limits.operator_timeout));
        let (reflection_v1, reflection_v1alpha) = if settings.grpc.reflection {
            let descriptors = crate::proto::reflection_descriptors()
                .context("the API's file descriptors do not decode")?;
            let configure = || {
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(&descriptors)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            };
            (
                Some(configure().build_v1()?),
                Some(configure().build_v1alpha()?),
            )
        } else {
            (None, None)
        };
        let server = builder
            .layer(RpcMetricsLayer::new(metrics))
            .add_service(EndsAtShutdown::new(health_service, shutdown.clone()))
            .add_optional_service(reflection_v1)
            .add_optional_service(reflection_v1alpha)
            .add_service(handler.into_server(settings.limits.max_message_bytes));
        let incoming = crate::incoming::admitted(
            listener,
            settings.limits.max_connections,
            crate::incoming::HTTP2_PREFACE,
        );
        let stopped = shutdown.clone().cancelled_owned();
        // tonic's own TLS reads its certificate once: outboxd does the handshakes itself.
        let server = match tls {
            Some(tls) => {
                let incoming = crate::incoming::handshaken(
                    incoming,
                    tls,
                    crate::tls::Listener::Grpc,
                    crate::incoming::HTTP2_PREFACE,
                );
                tokio::spawn(server.serve_with_incoming_shutdown(incoming, stopped))
            }
            None => tokio::spawn(server.serve_with_incoming_shutdown(incoming, stopped)),
        };
        let metrics_shown = metrics_addr.map_or_else(|| "off".to_owned(), |a| a.to_string());
        tracing::info!(listen.addr = %local_addr, metrics.addr = %metrics_shown, "outboxd serving gRPC");
        if settings.maintenance.retention.is_zero() {
            tracing::info!(
                "retention of finished intents is zero: Ack deletes the intents without an \
                 idempotency key it delivers, and a replayed Ack of one is answered NOT_FOUND"
            );
        }
        Ok(Self {
            local_addr,
            metrics_addr,
            console_addr,
            shutdown,
            health,
            readiness,
            drain_delay: settings.shutdown.drain_delay,
            grace: settings.shutdown.grace,
            server,
            background,
            admin,
            admin_stop,
            pending,
            pools: pools.clone(),
        })
    }

    /// Address the server listens on (port 0 resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Address of the admin listener (`/metrics`, `/livez`, `/readyz`), if enabled (port 0
    /// resolved).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Whether the server hears other replicas' enqueues (its LISTEN connection is up);
    /// until then its long polls learn of them at their recheck.
    pub fn is_listening(&self) -> bool {
        self.pending.is_listening()
    }

    /// Where the console listens, if it does.
    pub fn console_addr(&self) -> Option<SocketAddr> {
        self.console_addr
    }

    /// Drains and stops: health turns NOT_SERVING (overall and per service) and stays so
    /// for the drain delay while calls are still served; then new connections are refused,
    /// waiting long-polls answer, and in-flight calls and background tasks get the grace
    /// period to finish, together: what is still running then is cut. With the database
    /// gone, a call or a sweep may be waiting for a connection (up to the pool's 5 s
    /// acquire timeout) or on a statement that never answers; the grace must bound the
    /// exit anyway (an orchestrator kills what outlives it, with no log of why).
    /// Leases held by workers are not touched: they are acked, or expire and are rescued.
    ///
    /// # Errors
    /// The server task failed.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop_with_deadline().await.0
    }

    /// [`Application::stop`], returning also when the grace ends.
    async fn stop_with_deadline(self) -> (anyhow::Result<()>, tokio::time::Instant) {
        self.readiness.drain();
        set_health(&self.health, tonic_health::ServingStatus::NotServing).await;
        tokio::time::sleep(self.drain_delay).await;
        let deadline = tokio::time::Instant::now() + self.grace;
        self.shutdown.cancel();
        let mut server = self.server;
        let served = match tokio::time::timeout_at(deadline, &mut server).await {
            Ok(joined) => joined.map_err(anyhow::Error::from),
            Err(_) => {
                tracing::warn!(grace = ?self.grace, "in-flight calls outlived the grace period; cutting them");
                server.abort();
                Ok(Ok(()))
            }
        };
        for mut task in self.background {
            // Background tasks stop at the next turn of their loop, which a sweep waiting
            // for an unreachable database may not reach before the deadline.
            if tokio::time::timeout_at(deadline, &mut task).await.is_err() {
                tracing::warn!(grace = ?self.grace, "a background task outlived the grace period; cutting it");
                task.abort();
            }
        }
        self.admin_stop.cancel();
        if let Some(mut admin) = self.admin
            && tokio::time::timeout_at(deadline, &mut admin).await.is_err()
        {
            admin.abort();
        }
        let served = served.and_then(|s| s.context("gRPC server failed"));
        (served, deadline)
    }

    /// Serves until Ctrl-C or SIGTERM, then stops gracefully and closes the pool, all
    /// within the drain delay and the grace.
    ///
    /// # Errors
    /// The server task failed.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        shutdown_signal().await;
        tracing::info!("shutdown requested; draining");
        let pools = self.pools.clone();
        let (served, deadline) = self.stop_with_deadline().await;
        // Closing waits for every connection to come back; the ones cut above were dropped.
        if tokio::time::timeout_at(deadline, pools.close())
            .await
            .is_err()
        {
            tracing::warn!("database connections still closing at the end of the grace period");
        }
        served
    }
}

/// How often readiness re-checks that the database answers and the service role may use it.
const DATABASE_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// The limit of each of hyper's guards against reset floods on one HTTP/2 connection (see
/// where the gRPC server is built).
const RESET_STREAMS: usize = 1024;

/// Most calls at once on one HTTP/2 connection (hyper's own default for servers).
const MAX_STREAMS_PER_CONNECTION: u32 = 200;

/// How long a connection may be silent before it is pinged, and how long it then has to
/// answer before it is closed.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Sets the status of the whole server ("") and of the outbox service.
async fn set_health(health: &HealthReporter, status: tonic_health::ServingStatus) {
    health.set_service_status("", status).await;
    health
        .set_service_status(
            <OutboxServiceServer<OutboxHandler> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
}

/// Keeps health in step with the database: NOT_SERVING while PostgreSQL is unreachable or
/// the service role lacks its grants (every call would fail), SERVING again once it is
/// back, until shutdown (which owns the status from then on).
async fn watch_database(
    pools: store::Pools,
    health: HealthReporter,
    readiness: Arc<Readiness>,
    shutdown: CancellationToken,
) {
    let mut serving = true;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(DATABASE_CHECK_INTERVAL) => {}
        }
        let probe = match store::probe(pools.tenant()).await {
            Ok(()) => store::probe(pools.fleet()).await,
            failed => failed,
        };
        // A shutdown owns the status from its first moment (the drain delay included).
        if shutdown.is_cancelled() || readiness.is_draining() || probe.is_ok() == serving {
            continue;
        }
        serving = probe.is_ok();
        readiness.set_database_usable(serving);
        let status = match &probe {
            Ok(()) => {
                tracing::info!("database reachable again; serving");
                tonic_health::ServingStatus::Serving
            }
            Err(e) => {
                tracing::error!(error.message = %e, "database unusable; health NOT_SERVING");
                tonic_health::ServingStatus::NotServing
            }
        };
        // A shutdown that began meanwhile set NOT_SERVING before or after this: it wins.
        let status = if readiness.is_draining() {
            tonic_health::ServingStatus::NotServing
        } else {
            status
        };
        set_health(&health, status).await;
        if readiness.is_draining() {
            set_health(&health, tonic_health::ServingStatus::NotServing).await;
        }
    }
}

/// The server's background tasks: LISTEN wake-ups, staged promotion, the sweeps (unless
/// the runtime drives them itself) and the metrics gauges.
fn spawn_background(
    settings: &Settings,
    pools: &store::Pools,
    runtime: &Runtime,
    pending: &PendingSignal,
    metrics: &Arc<Metrics>,
    shutdown: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let pool = pools.tenant();
    let txn_committed = Arc::new(Notify::new());
    let mut tasks = vec![
        tokio::spawn(pending.clone().listen_until_stopped(
            pool.clone(),
            txn_committed.clone(),
            runtime.listener_probe_every,
            shutdown.clone(),
        )),
        tokio::spawn(
            pending
                .clone()
                .announce_until_stopped(pool.clone(), shutdown.clone()),
        ),
        tokio::spawn(promotion::run_until_stopped(
            pools.clone(),
            runtime.clock.clone(),
            txn_committed,
            settings.txn.resolve_interval,
            pending.clone(),
            metrics.clone(),
            shutdown.clone(),
        )),
        tokio::spawn(metrics::refresh_until_stopped(
            metrics.clone(),
            pools.clone(),
            settings.metrics.refresh_interval,
            shutdown.clone(),
        )),
    ];
    if runtime.maintenance {
        tasks.push(tokio::spawn(maintenance::run_until_stopped(
            pools.clone(),
            settings.maintenance.clone(),
            runtime.clock.clone(),
            metrics.clone(),
            shutdown.clone(),
        )));
    }
    tasks
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
