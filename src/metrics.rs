//! Prometheus metrics: what happened (counters, fed by the RPC handlers and the sweeps),
//! how the queue looks (gauges, refreshed from PostgreSQL), and RPC latency by method and
//! code (a tower layer). Labels never carry tenant or intent ids: unbounded cardinality.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::outbox::IntentState;
use crate::outbox::claim::ClaimCounters;
use crate::outbox::enqueue::EnqueueCounters;
use crate::outbox::maintenance::{SweepObserver, SweepReport};
use crate::outbox::promotion::PromotionObserver;
use crate::outbox::store::{self, AlsoAtBegin, Pools, PromotionReport, TenantScope};

/// Labels of RPC metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// gRPC method, e.g. `Claim`.
    pub method: String,
    /// gRPC status code name, e.g. `OK`, `NOT_FOUND`.
    pub code: String,
}

/// Labels of per-method histograms.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    /// gRPC method.
    pub method: String,
}

/// Labels of queue-depth gauges.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DepthLabels {
    /// Intent state, lowercase.
    pub state: String,
    /// Region ('' = any).
    pub region: String,
}

/// Labels of outcome counters.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `retry`, `permanent`, `unknown`; or the state a rescued lease went to.
    pub outcome: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.25 ms … ~8 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

fn wait_histogram() -> Histogram {
    // 1 ms … ~9 h: intents may wait long when no worker runs.
    Histogram::new(exponential_buckets(0.001, 2.0, 25))
}

/// Every metric outboxd exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// RPCs by method and code.
    pub rpc_requests: Family<RpcLabels, Counter>,
    /// RPC latency by method.
    pub rpc_duration: HistogramFamily<MethodLabels>,
    /// Intents recorded (not counting deduplicated ones).
    pub enqueued: Counter,
    /// Transactions of direct-mode Enqueue calls, each carrying one call or several
    /// (group commit: calls per transaction = calls / this).
    pub enqueue_transactions: Counter,
    /// Direct-mode Enqueue calls waiting for the transaction in flight to join the next.
    pub enqueue_calls_waiting: Gauge,
    /// Claim calls long-polling: they looked, found nothing, and wait for work.
    pub claims_waiting: Gauge,
    /// Intents leased by Claim.
    pub claimed: Counter,
    /// Of those, intents a waiting Claim received from the Enqueue that inserted them.
    pub handed_off: Counter,
    /// Intents an Enqueue leased to a waiting Claim that never received them (its call
    /// ended first, or the enqueue lost its COMMIT's answer), given back to PENDING.
    pub given_back: Counter,
    /// Time from claimable (`available_at`) to claimed.
    pub enqueue_to_claim: HistogramFamily<MethodLabels>,
    /// Intents acknowledged.
    pub acked: Counter,
    /// Fail reports by outcome.
    pub failed: Family<OutcomeLabels, Counter>,
    /// Intents dead-lettered (by Fail or by rescue).
    pub dead_lettered: Counter,
    /// Expired leases rescued, by the state they went to.
    pub lease_expiries: Family<OutcomeLabels, Counter>,
    /// Staged intents promoted after their producer committed.
    pub promoted: Counter,
    /// Staged intents discarded after their producer aborted.
    pub discarded: Counter,
    /// Finished intents purged.
    pub purged: Counter,
    /// Intents by state and region (live states only; finished ones are counters).
    pub intents: Family<DepthLabels, Gauge>,
    /// Seconds the oldest claimable PENDING intent has waited.
    pub oldest_pending_age: Gauge<f64, AtomicU64>,
    /// Seconds the oldest STAGED intent has waited for its producer transaction.
    pub oldest_staged_age: Gauge<f64, AtomicU64>,
    /// Intents awaiting an operator (NEEDS_RECONCILE + DEAD_LETTERED).
    pub reconcile_backlog: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered under the `outbox_` prefix.
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("outbox"),
            rpc_requests: Family::default(),
            rpc_duration: Family::new_with_constructor(latency_histogram),
            enqueued: Counter::default(),
            enqueue_transactions: Counter::default(),
            enqueue_calls_waiting: Gauge::default(),
            claims_waiting: Gauge::default(),
            claimed: Counter::default(),
            handed_off: Counter::default(),
            given_back: Counter::default(),
            enqueue_to_claim: Family::new_with_constructor(wait_histogram),
            acked: Counter::default(),
            failed: Family::default(),
            dead_lettered: Counter::default(),
            lease_expiries: Family::default(),
            promoted: Counter::default(),
            discarded: Counter::default(),
            purged: Counter::default(),
            intents: Family::default(),
            oldest_pending_age: Gauge::default(),
            oldest_staged_age: Gauge::default(),
            reconcile_backlog: Gauge::default(),
        };
        let r = &mut m.registry;
        r.register(
            "rpc_requests",
            "gRPC requests by method and status code",
            m.rpc_requests.clone(),
        );
        r.register(
            "rpc_duration_seconds",
            "gRPC request latency by method",
            m.rpc_duration.clone(),
        );
        r.register(
            "intents_enqueued",
            "Intents recorded by Enqueue",
            m.enqueued.clone(),
        );
        r.register(
            "enqueue_transactions",
            "Transactions of direct-mode Enqueue calls (several calls share one under load)",
            m.enqueue_transactions.clone(),
        );
        r.register(
            "enqueue_calls_waiting",
            "Direct-mode Enqueue calls waiting to share the next transaction",
            m.enqueue_calls_waiting.clone(),
        );
        r.register(
            "intents_handed_off",
            "Intents an Enqueue inserted leased to a Claim of this server waiting for them \
             (counted in claimed too)",
            m.handed_off.clone(),
        );
        r.register(
            "intents_given_back",
            "Leased intents no Claim received (an Enqueue's for a claimer that had gone, or \
             past a Claim's reply limit), given back to pending with the attempt uncounted",
            m.given_back.clone(),
        );
        r.register(
            "claims_waiting",
            "Claim calls long-polling for work (idle workers)",
            m.claims_waiting.clone(),
        );
        r.register(
            "intents_claimed",
            "Intents leased by Claim",
            m.claimed.clone(),
        );
        r.register(
            "enqueue_to_claim_seconds",
            "Time from an intent becoming claimable to its claim",
            m.enqueue_to_claim.clone(),
        );
        r.register("intents_acked", "Intents acknowledged", m.acked.clone());
        r.register(
            "intents_failed",
            "Fail reports by outcome",
            m.failed.clone(),
        );
        r.register(
            "intents_dead_lettered",
            "Intents dead-lettered",
            m.dead_lettered.clone(),
        );
        r.register(
            "lease_expiries",
            "Expired leases rescued, by the state the intent went to",
            m.lease_expiries.clone(),
        );
        r.register(
            "intents_promoted",
            "Staged intents whose producer committed",
            m.promoted.clone(),
        );
        r.register(
            "intents_discarded",
            "Staged intents whose producer aborted",
            m.discarded.clone(),
        );
        r.register(
            "intents_purged",
            "Finished intents deleted after retention",
            m.purged.clone(),
        );
        r.register(
            "intents",
            "Intents by live state and region",
            m.intents.clone(),
        );
        r.register(
            "oldest_pending_age_seconds",
            "Age of the oldest claimable pending intent",
            m.oldest_pending_age.clone(),
        );
        r.register(
            "oldest_staged_age_seconds",
            "Age of the oldest staged intent (an open producer transaction)",
            m.oldest_staged_age.clone(),
        );
        r.register(
            "reconcile_backlog",
            "Intents awaiting an operator decision",
            m.reconcile_backlog.clone(),
        );
        m
    }

    /// The exposition text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Refreshes the queue gauges from the database (across tenants).
    ///
    /// # Errors
    /// [`crate::outbox::Error::Database`].
    pub async fn refresh(&self, pools: &Pools) -> crate::outbox::Result<()> {
        // Index plans: under row-level security the planner misjudges these counts by
        // orders of magnitude and would scan the table for them as it grows.
        let mut tx =
            store::begin_with(pools, &TenantScope::All, &[AlsoAtBegin::IndexPlans]).await?;
        let depth = store::queue_depth(&mut tx).await?;
        tx.commit().await?;
        self.intents.clear();
        let mut backlog = 0;
        for d in &depth.counts {
            self.intents
                .get_or_create(&DepthLabels {
                    state: d.state.as_str().to_owned(),
                    region: d.region.clone(),
                })
                .set(d.count);
            if d.state.awaits_decision() {
                backlog += d.count;
            }
        }
        self.reconcile_backlog.set(backlog);
        self.oldest_pending_age
            .set(depth.oldest_pending_age.unwrap_or(0.0));
        self.oldest_staged_age
            .set(depth.oldest_staged_age.unwrap_or(0.0));
        Ok(())
    }

    /// The counters of direct enqueues.
    pub fn enqueue_counters(&self) -> EnqueueCounters {
        EnqueueCounters {
            calls_waiting: self.enqueue_calls_waiting.clone(),
            transactions: self.enqueue_transactions.clone(),
        }
    }

    /// The counters of Claim calls.
    pub fn claim_counters(&self) -> ClaimCounters {
        ClaimCounters {
            waiting: self.claims_waiting.clone(),
            handed_off: self.handed_off.clone(),
        }
    }

    /// Records claimed intents and how long each waited while claimable.
    pub fn record_claimed(&self, waited: impl Iterator<Item = Duration>) {
        let histogram = self.enqueue_to_claim.get_or_create(&MethodLabels {
            method: "Claim".to_owned(),
        });
        for w in waited {
            self.claimed.inc();
            histogram.observe(w.as_secs_f64());
        }
    }

    /// Counts per-item results that ended in `state`.
    pub fn count_states<'a>(
        states: impl Iterator<Item = &'a Option<IntentState>>,
        state: IntentState,
    ) -> u64 {
        states.filter(|s| **s == Some(state)).count() as u64
    }
}

impl SweepObserver for Metrics {
    fn rescued(&self, r: &SweepReport) {
        let expired = |to: &str, n: u64| {
            self.lease_expiries
                .get_or_create(&OutcomeLabels {
                    outcome: to.to_owned(),
                })
                .inc_by(n);
        };
        expired("pending", r.requeued);
        expired("dead_lettered", r.dead_lettered);
        expired("needs_reconcile", r.needs_reconcile);
        self.dead_lettered.inc_by(r.dead_lettered);
        self.purged.inc_by(r.purged);
    }

    fn purged(&self, intents: u64) {
        self.purged.inc_by(intents);
    }
}

impl PromotionObserver for Metrics {
    fn promoted(&self, r: &PromotionReport) {
        self.promoted.inc_by(r.promoted);
        self.discarded.inc_by(r.discarded);
    }
}

/// The refresh counts every live intent (by state and region), so its cost grows with the
/// backlog: 127 ms at 219k PENDING on the benchmark's machine, seconds for the millions an
/// outage leaves, on every replica, just when PostgreSQL's CPU is needed to drain them. So
/// the next refresh waits at least this many times as long as the last one took: counting
/// never takes more than 1/20 of the time, and the gauges age in proportion.
const REFRESH_SLOWDOWN: u32 = 20;

/// How long after a refresh that took `took` the next one starts.
fn next_refresh_in(interval: Duration, took: Duration) -> Duration {
    interval.max(took.saturating_mul(REFRESH_SLOWDOWN))
}

/// Refreshes the gauges every `interval` (or less often, when a refresh is slow: `REFRESH_SLOWDOWN`) until
/// `shutdown`.
pub async fn refresh_until_stopped(
    metrics: Arc<Metrics>,
    pools: Pools,
    interval: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let started = tokio::time::Instant::now();
        if let Err(e) = metrics.refresh(&pools).await {
            tracing::warn!(error.message = %e, "refreshing queue metrics failed");
        }
        let wait = next_refresh_in(interval, started.elapsed());
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown`.
pub async fn serve(
    metrics: Arc<Metrics>,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    metrics.encode(),
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// Binds the metrics listener.
///
/// # Errors
/// The address cannot be bound.
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

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
        let method = method_label(request.uri().path()).to_owned();
        let metrics = self.metrics.clone();
        let started = Instant::now();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await?;
            // Unary errors travel as trailers-only responses: the status is in the headers.
            // Without one, the call succeeded (its OK arrives in the trailers).
            let code = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<i32>().ok())
                .map_or(tonic::Code::Ok, tonic::Code::from_i32);
            metrics
                .rpc_requests
                .get_or_create(&RpcLabels {
                    method: method.clone(),
                    code: code_name(code).to_owned(),
                })
                .inc();
            metrics
                .rpc_duration
                .get_or_create(&MethodLabels { method })
                .observe(started.elapsed().as_secs_f64());
            Ok(response)
        })
    }
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Prefix of the OutboxService methods' paths.
const OUTBOX_SERVICE_PATH: &str = "/outbox.v1.OutboxService/";

/// The OutboxService methods, labelled by their name.
const OUTBOX_METHODS: [&str; 10] = [
    "Enqueue",
    "Claim",
    "ExtendLease",
    "MarkSubmitted",
    "Ack",
    "Fail",
    "Reconcile",
    "GetIntent",
    "ListIntents",
    "GetQueueStats",
];

/// The other methods served (health, reflection), labelled by their full path.
const OTHER_METHODS: [&str; 4] = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
];

/// The `method` label of a request's path: "Claim" for "/outbox.v1.OutboxService/Claim",
/// the full path of a health or reflection method, and "unknown" for anything else. A
/// fixed set, because the path is whatever a client sent, before any authentication: a
/// label made of it grew the registry with every new path, without end, and a `"` in one
/// made the whole exposition unparseable (label values are written unescaped).
fn method_label(path: &str) -> &'static str {
    let outbox = path
        .strip_prefix(OUTBOX_SERVICE_PATH)
        .and_then(|name| OUTBOX_METHODS.iter().find(|m| **m == name));
    outbox
        .or_else(|| OTHER_METHODS.iter().find(|m| **m == path))
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
    fn every_served_method_has_a_label_of_its_own_and_any_other_path_is_unknown() {
        let outbox = methods_of(crate::proto::FILE_DESCRIPTOR_SET);
        assert_eq!(outbox.len(), OUTBOX_METHODS.len());
        for (service, method) in outbox {
            assert_eq!(service, "outbox.v1.OutboxService");
            assert_eq!(method_label(&format!("/{service}/{method}")), method);
        }
        for descriptors in [
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

    #[test]
    fn a_refresh_slower_than_a_twentieth_of_the_interval_pushes_the_next_one_back() {
        let interval = Duration::from_secs(5);
        assert_eq!(
            next_refresh_in(interval, Duration::from_millis(127)),
            interval
        );
        assert_eq!(
            next_refresh_in(interval, Duration::from_millis(1200)),
            Duration::from_secs(24)
        );
        assert_eq!(next_refresh_in(interval, Duration::MAX), Duration::MAX);
    }
}
