//! Serves the HTTP/1 listeners (the console, the admin endpoint) with bounds a client cannot
//! outlast: so many connections at once, and each request's head within a deadline, which
//! also closes a keep-alive connection left idle. `axum::serve` has neither: a client that
//! opened connections and sent nothing held them, and their file descriptors, for good.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::serve::Listener;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

/// Connections one HTTP listener keeps open at once: browsers and scrapers need a few each;
/// past it, a new connection is closed as it is accepted.
pub const MAX_CONNECTIONS: usize = 512;

/// How long a request's head may take to arrive, counted from when the connection is ready
/// for it (accepted, or done with its last answer).
pub const HEAD_WITHIN: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` until `shutdown`, then lets the answers under way finish.
pub async fn serve<L: Listener>(mut listener: L, router: Router, shutdown: CancellationToken) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEAD_WITHIN);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let graceful = GracefulShutdown::new();
    loop {
        let (io, _) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!("HTTP connection closed: {MAX_CONNECTIONS} are open");
            continue;
        };
        let service = router
            .clone()
            .map_request(|request: hyper::Request<Incoming>| request.map(axum::body::Body::new));
        let connection = graceful
            .watch(http.serve_connection(TokioIo::new(io), TowerToHyperService::new(service)));
        tokio::spawn(async move {
            // A client that went away or was too slow: nothing to answer.
            let _ = connection.await;
            drop(slot);
        });
    }
    graceful.shutdown().await;
}
