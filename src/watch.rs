//! Streams that end when the server drains: an open `grpc.health.v1.Health/Watch` would
//! otherwise hold the graceful shutdown for its whole grace period (the server waits for
//! every open stream). Each reply of the wrapped service ends with UNAVAILABLE once the
//! shutdown token is cancelled, after what it had to send; watchers saw NOT_SERVING
//! during the drain delay before that, and reconnect elsewhere.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::Frame;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Bytes, Service, http};
use tonic::server::NamedService;

/// Wraps a gRPC service whose replies end at `shutdown`; see the module documentation.
#[derive(Debug, Clone)]
pub struct EndsAtShutdown<S> {
    inner: S,
    shutdown: CancellationToken,
}

impl<S> EndsAtShutdown<S> {
    /// `inner`, its replies ended when `shutdown` is cancelled.
    pub fn new(inner: S, shutdown: CancellationToken) -> Self {
        Self { inner, shutdown }
    }
}

impl<S: NamedService> NamedService for EndsAtShutdown<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for EndsAtShutdown<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let reply = self.inner.call(request);
        let shutdown = self.shutdown.clone();
        Box::pin(async move {
            let reply = reply.await?;
            Ok(reply.map(|body| {
                Body::new(UntilShutdown {
                    inner: body,
                    shutdown: Box::pin(shutdown.cancelled_owned()),
                    ended: false,
                })
            }))
        })
    }
}

/// A reply body that ends with UNAVAILABLE trailers when the shutdown comes while it
/// waits for more.
struct UntilShutdown {
    inner: Body,
    shutdown: Pin<Box<WaitForCancellationFutureOwned>>,
    ended: bool,
}

impl http_body::Body for UntilShutdown {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        if self.shutdown.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        // A status of fixed ASCII text always converts.
        Status::unavailable("the server is shutting down")
            .add_header(&mut trailers)
            .ok();
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }
}
