//! Serves the HTTP/1 listeners (the console, the admin endpoint): each request's head must
//! arrive within a deadline, which also closes a keep-alive connection left idle. (Their
//! number is bounded where they are accepted, `incoming::admitted`.) `axum::serve` has no
//! such deadline: a client that opened connections and sent nothing held them for good.

use std::io;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_stream::{Stream, StreamExt as _};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

/// How long a request's head may take to arrive, counted from when the connection is ready
/// for it (accepted, or done with its last answer).
const HEAD_WITHIN: Duration = Duration::from_secs(10);

/// Serves `router` on `connections` until `shutdown`, then closes the listener and lets
/// the answers under way finish.
pub async fn serve<IO>(
    connections: impl Stream<Item = io::Result<IO>>,
    router: Router,
    shutdown: CancellationToken,
) where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(HEAD_WITHIN);
    let graceful = GracefulShutdown::new();
    // Owned, so that dropping it closes the listener.
    let mut connections = Box::pin(connections);
    loop {
        let io = tokio::select! {
            next = connections.next() => match next {
                Some(Ok(io)) => io,
                Some(Err(_)) => continue,
                None => break,
            },
            () = shutdown.cancelled() => break,
        };
        let service = router
            .clone()
            .map_request(|request: hyper::Request<Incoming>| request.map(axum::body::Body::new));
        let connection = graceful
            .watch(http.serve_connection(TokioIo::new(io), TowerToHyperService::new(service)));
        // A client that went away or was too slow: nothing to answer.
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
    drop(connections);
    graceful.shutdown().await;
}
