//! The admin listener (`OUTBOX_METRICS__LISTEN_ADDR`), plain HTTP whatever the gRPC
//! listener's TLS: `/metrics` and the health endpoints Kubernetes' HTTP probes and load
//! balancers read, `/livez` (the process serves) and `/readyz` (it takes calls: not
//! draining, and the database usable), so a TLS deployment's probes see a drain or a lost
//! database too.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Format, Metrics};

/// Whether this server should get calls: what `/readyz` answers, kept in step with the
/// gRPC health service (`crate::startup`).
#[derive(Debug)]
pub struct Readiness {
    draining: AtomicBool,
    database_usable: AtomicBool,
}

impl Default for Readiness {
    fn default() -> Self {
        Self {
            draining: AtomicBool::new(false),
            // A server starts only once its pools have connected and been checked.
            database_usable: AtomicBool::new(true),
        }
    }
}

impl Readiness {
    /// From now on, not ready: a shutdown started (for good).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether a shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Whether the database answers and the service role may use it.
    pub fn set_database_usable(&self, usable: bool) {
        self.database_usable.store(usable, Ordering::Relaxed);
    }

    /// Why not ready, if not.
    pub fn problem(&self) -> Option<&'static str> {
        if self.is_draining() {
            Some("draining: shutting down")
        } else if !self.database_usable.load(Ordering::Relaxed) {
            Some("the database is unreachable or unusable")
        } else {
            None
        }
    }
}

/// Serves `GET /metrics`, `/livez` and `/readyz` on `listener`, at most `max_connections`
/// open at once, until `shutdown`.
pub async fn serve(
    metrics: Arc<Metrics>,
    readiness: Arc<Readiness>,
    listener: tokio::net::TcpListener,
    max_connections: usize,
    shutdown: CancellationToken,
) {
    let scrape = move |headers: HeaderMap| {
        let metrics = metrics.clone();
        async move {
            let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
            let format = Format::negotiate(accept);
            (
                [(header::CONTENT_TYPE, format.content_type())],
                metrics.encode(format),
            )
        }
    };
    let ready = move || {
        let readiness = readiness.clone();
        async move {
            match readiness.problem() {
                None => (StatusCode::OK, "ready\n".to_owned()).into_response(),
                Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response(),
            }
        }
    };
    let app = axum::Router::new()
        .route("/metrics", axum::routing::get(scrape))
        .route("/livez", axum::routing::get(|| async { "ok\n" }))
        .route("/readyz", axum::routing::get(ready));
    let connections = crate::incoming::admitted(listener, max_connections, 0);
    crate::http_listener::serve(connections, app, shutdown).await;
}

/// Binds the admin listener.
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}
