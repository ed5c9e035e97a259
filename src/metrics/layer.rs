//! The tower layer counting and timing every gRPC request by method and status code, and
//! the fixed set of `method` labels.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::{CLAIM_METHOD, MethodLabels, Metrics, RpcLabels};
use crate::deadline::grpc_timeout;

/// Tower layer counting and timing every gRPC request by method and status code.
#[derive(Debug, Clone)]
pub struct RpcMetricsLayer {
    metrics: Arc<Metrics>,
}

impl RpcMetricsLayer {
    /// A layer recording into `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self { metrics }
    }
}

impl<S> tower::Layer<S> for RpcMetricsLayer {
    type Service = RpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RpcMetrics {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// The service of [`RpcMetricsLayer`].
#[derive(Debug, Clone)]
pub struct RpcMetrics<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, B, R> tower::Service<http::Request<B>> for RpcMetrics<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>> + Send,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let started = Instant::now();
        let deadline = request
            .headers()
            .get("grpc-timeout")
            .and_then(|v| v.to_str().ok())
            .and_then(grpc_timeout)
            // tonic's timer starts a little before this clock, and a client enforcing the
            // same deadline resets the call at about the same moment: a drop within a
            // twentieth of the timeout (at least 1 ms) of its end is the deadline's.
            .and_then(|timeout| {
                let slack = (timeout / 20).max(Duration::from_millis(1));
                started.checked_add(timeout.saturating_sub(slack))
            });
        let mut call = CallRecord {
            metrics: self.metrics.clone(),
            method: method_label(request.uri().path()),
            started,
            deadline,
            recorded: false,
        };
        let response = self.inner.call(request);
        Box::pin(async move {
            // An error here is a broken transport, not an answered call: not counted.
            let response = response.await.inspect_err(|_| call.recorded = true)?;
            // Unary errors travel as trailers-only responses: the status is in the headers.
            // Without one, the call succeeded (its OK arrives in the trailers).
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map_or(tonic::Code::Ok, tonic::Code::from_i32);
            call.record(code);
            Ok(response)
        })
    }
}

/// One call's count and time, recorded when it is answered, or when its future is dropped
/// unanswered: tonic's enforcement of `grpc-timeout` (outside this layer) and a caller that
/// went away both drop it, and those calls count as `DEADLINE_EXCEEDED` and `CANCELLED`.
struct CallRecord {
    metrics: Arc<Metrics>,
    method: &'static str,
    started: Instant,
    deadline: Option<Instant>,
    recorded: bool,
}

impl CallRecord {
    fn record(&mut self, code: tonic::Code) {
        self.recorded = true;
        let method = self.method.to_owned();
        self.metrics
            .rpc_requests
            .get_or_create(&RpcLabels {
                method: method.clone(),
                code: crate::status::code_name(code).to_owned(),
            })
            .inc();
        self.metrics
            .rpc_duration
            .get_or_create(&MethodLabels { method })
            .observe(self.started.elapsed().as_secs_f64());
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        if !self.recorded {
            let past_deadline = self.deadline.is_some_and(|d| Instant::now() >= d);
            self.record(if past_deadline {
                tonic::Code::DeadlineExceeded
            } else {
                tonic::Code::Cancelled
            });
        }
    }
}

/// The methods served, labelled by their full gRPC name (`/package.Service/Method`): one
/// form for every service, the name gRPC itself puts on the wire (`:path`).
const METHODS: [&str; 16] = [
    "/outbox.v1.OutboxService/Enqueue",
    CLAIM_METHOD,
    "/outbox.v1.OutboxService/ExtendLease",
    "/outbox.v1.OutboxService/MarkSubmitted",
    "/outbox.v1.OutboxService/Ack",
    "/outbox.v1.OutboxService/Fail",
    "/outbox.v1.OutboxService/Reconcile",
    "/outbox.v1.OutboxService/GetIntent",
    "/outbox.v1.OutboxService/ListIntents",
    "/outbox.v1.OutboxService/GetQueueStats",
    "/outbox.v1.OutboxService/SetQueuePolicy",
    "/outbox.v1.OutboxService/ListQueuePolicies",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// The `method` label of a request's path: the path of a method served, and "unknown" for
/// anything else. A fixed set, because the path is whatever a client sent, before any
/// authentication: a label made of it grew the registry with every new path, without end,
/// and a `"` in one made the whole exposition unparseable (label values are written
/// unescaped).
fn method_label(path: &str) -> &'static str {
    METHODS
        .iter()
        .find(|m| **m == path)
        .copied()
        .unwrap_or("unknown")
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    /// The `(service, method)` pairs of an encoded descriptor set.
    fn methods_of(descriptors: &[u8]) -> Vec<(String, String)> {
        let set = prost_types::FileDescriptorSet::decode(descriptors).unwrap();
        let mut methods = Vec::new();
        for file in set.file {
            for service in &file.service {
                let service_name = format!("{}.{}", file.package(), service.name());
                for method in &service.method {
                    methods.push((service_name.clone(), method.name().to_owned()));
                }
            }
        }
        methods
    }

    #[test]
    fn every_served_method_is_labelled_by_its_full_name_and_any_other_path_is_unknown() {
        let outbox = methods_of(crate::proto::FILE_DESCRIPTOR_SET);
        assert_eq!(outbox.len(), 12);
        for descriptors in [
            crate::proto::FILE_DESCRIPTOR_SET,
            tonic_health::pb::FILE_DESCRIPTOR_SET,
            tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
            tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
        ] {
            for (service, method) in methods_of(descriptors) {
                let path = format!("/{service}/{method}");
                assert_eq!(method_label(&path), path);
            }
        }
        for path in [
            "/outbox.v1.OutboxService/DropEverything",
            "/outbox.v1.OutboxService/Claim/",
            "/outbox.v1.OutboxService/",
            "/x\"y",
            "",
        ] {
            assert_eq!(method_label(path), "unknown", "{path}");
        }
    }
}
