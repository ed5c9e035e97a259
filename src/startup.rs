//! Wiring: the database (external or embedded), migrations, and the gRPC server with its
//! health, reflection and background tasks, served until a shutdown signal.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;

use crate::config::Settings;
use crate::embedded::{EmbeddedConfig, EmbeddedPostgres};
use crate::grpc::OutboxHandler;
use crate::outbox::notify::PendingSignal;
use crate::outbox::{Clock, maintenance, promotion, store};
use crate::proto::{FILE_DESCRIPTOR_SET, v1::outbox_service_server::OutboxServiceServer};

/// Name of the database outboxd creates in its embedded cluster.
pub const EMBEDDED_DATABASE: &str = "outbox";

/// Opens a pool. Commits are durable: `synchronous_commit` is forced on for every session,
/// whatever the server default, because an OK must mean the intent survives a crash.
///
/// # Errors
/// A malformed URL or an unreachable database.
pub async fn connect(url: &str, max_connections: u32) -> anyhow::Result<PgPool> {
    let options: PgConnectOptions = url
        .parse()
        .context("OUTBOX_DATABASE__URL is not a valid PostgreSQL URL")?;
    let options = options
        .options([("synchronous_commit", "on")])
        .application_name("outboxd");
    PgPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .context("cannot connect to PostgreSQL")
}

/// Applies pending migrations. Safe with replicas starting together: sqlx holds an
/// advisory lock while it migrates.
///
/// # Errors
/// A failed or modified migration.
pub async fn migrate(pool: &PgPool) -> anyhow::Result<()> {
    crate::MIGRATOR.run(pool).await.context("migrations failed")
}

/// Starts the embedded cluster of `settings` (blocking work, run off the runtime) and
/// makes sure its `outbox` database exists. Returns the cluster and the database URL.
///
/// # Errors
/// No PostgreSQL binaries, an unusable data directory, or a server that does not start.
pub async fn start_embedded(settings: &Settings) -> anyhow::Result<(EmbeddedPostgres, String)> {
    let mut config = EmbeddedConfig::new(&settings.embedded_data_dir);
    config.port = settings.embedded_port;
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
}

impl Default for Runtime {
    fn default() -> Self {
        Self {
            clock: Clock::Database,
            maintenance: true,
            long_poll_recheck: Duration::from_secs(2),
        }
    }
}

/// A running outboxd server.
pub struct Application {
    local_addr: SocketAddr,
    shutdown: CancellationToken,
    health: HealthReporter,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<JoinHandle<()>>,
}

impl Application {
    /// Serves on `listener` over `pool` (already migrated) until [`Application::stop`]
    /// or [`Application::run_until_stopped`] ends it.
    ///
    /// # Errors
    /// A listener without a local address or an invalid reflection descriptor.
    pub async fn start(
        settings: &Settings,
        pool: PgPool,
        listener: TcpListener,
        runtime: Runtime,
    ) -> anyhow::Result<Self> {
        let local_addr = listener.local_addr()?;
        let shutdown = CancellationToken::new();
        let pending = PendingSignal::default();
        let txn_committed = Arc::new(Notify::new());
        let cluster_id = store::cluster_identifier(&pool).await?;
        let mut background = vec![
            tokio::spawn(pending.clone().listen_until_stopped(
                pool.clone(),
                txn_committed.clone(),
                shutdown.clone(),
            )),
            tokio::spawn(promotion::run_until_stopped(
                pool.clone(),
                runtime.clock.clone(),
                txn_committed,
                settings.txn_resolve_interval,
                pending.clone(),
                shutdown.clone(),
            )),
        ];
        if runtime.maintenance {
            background.push(tokio::spawn(maintenance::run_until_stopped(
                pool.clone(),
                settings.maintenance.clone(),
                runtime.clock.clone(),
                shutdown.clone(),
            )));
        }

        let (health, health_service) = tonic_health::server::health_reporter();
        health
            .set_serving::<OutboxServiceServer<OutboxHandler>>()
            .await;
        let reflection_v1 = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_v1alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        let handler = OutboxHandler::new(
            pool,
            cluster_id,
            settings.limits.clone(),
            settings.backoff(),
            runtime.clock,
            pending,
            shutdown.clone(),
        )
        .with_long_poll_recheck(runtime.long_poll_recheck);
        let server = tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(reflection_v1)
            .add_service(reflection_v1alpha)
            .add_service(handler.into_server())
            .serve_with_incoming_shutdown(
                TcpListenerStream::new(listener),
                shutdown.clone().cancelled_owned(),
            );
        let server = tokio::spawn(server);
        tracing::info!(listen.addr = %local_addr, "outboxd serving gRPC");
        Ok(Self {
            local_addr,
            shutdown,
            health,
            server,
            background,
        })
    }

    /// Address the server listens on (port 0 resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Drains and stops: health turns NOT_SERVING, long-polls answer, in-flight calls
    /// finish, then the server and background tasks end.
    ///
    /// # Errors
    /// The server task failed.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.health
            .set_not_serving::<OutboxServiceServer<OutboxHandler>>()
            .await;
        self.shutdown.cancel();
        let served = self.server.await?;
        for task in self.background {
            let _ = task.await;
        }
        served.context("gRPC server failed")
    }

    /// Serves until Ctrl-C or SIGTERM, then stops gracefully.
    ///
    /// # Errors
    /// The server task failed.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        shutdown_signal().await;
        tracing::info!("shutdown requested; draining");
        self.stop().await
    }
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
