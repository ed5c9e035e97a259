//! The commands that run outboxd itself: `serve` and `migrate`.

use anyhow::Context;

use crate::config::Settings;
use crate::startup::{self, Application, Runtime};
use crate::telemetry;

pub(super) async fn serve(settings: Settings) -> anyhow::Result<()> {
    let _telemetry = telemetry::init(
        settings.log.format,
        &settings.log.filter,
        settings.otel.endpoint.as_deref(),
    )?;
    let database = startup::prepare_database(&settings).await?;
    let pools = startup::connect_pools(&database, settings.database.max_connections).await?;
    let listener = tokio::net::TcpListener::bind(settings.listen_addr)
        .await
        .with_context(|| format!("cannot listen on {}", settings.listen_addr))?;
    let app = Application::start(&settings, pools, listener, Runtime::default()).await?;
    // Closes the pools too, within the grace (waiting here for a connection stuck on a
    // database that is gone would outlive it).
    let served = app.run_until_stopped().await;
    stop_embedded(database.embedded).await?;
    served
}

pub(super) async fn stop_embedded(
    cluster: Option<crate::embedded::EmbeddedPostgres>,
) -> anyhow::Result<()> {
    if let Some(mut cluster) = cluster {
        tokio::task::spawn_blocking(move || cluster.stop()).await??;
        tracing::info!("embedded PostgreSQL stopped");
    }
    Ok(())
}

pub(super) async fn migrate(settings: Settings) -> anyhow::Result<()> {
    telemetry::install(settings.log.format, &settings.log.filter, None);
    let both_or_neither =
        settings.database.url.is_some() == settings.database.migration_url.is_some();
    if both_or_neither {
        // As a server start does: the embedded cluster, or the owner's URL, is migrated and
        // the service role (of OUTBOX_DATABASE__URL) granted what it needs.
        let database = startup::prepare_database(&settings).await?;
        stop_embedded(database.embedded).await?;
    } else {
        let (embedded, url) = startup::owner_database(&settings).await?;
        let pool = startup::connect(&url, 2).await?;
        let migrated = startup::migrate(&pool).await;
        pool.close().await;
        stop_embedded(embedded).await?;
        migrated.map_err(|e| startup::with_owner_hint(&settings, e))?;
    }
    println!("migrations applied");
    Ok(())
}
