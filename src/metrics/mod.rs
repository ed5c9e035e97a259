//! The Prometheus registry: every outboxd metric and its labels, what happened (counters,
//! fed by the RPC handlers, the sweeps and promotion), how the queue looks (gauges,
//! refreshed from PostgreSQL) and the refresh's timing; the exposition format, the
//! process, the pools and the RPC layer have a file each below.
//! Labels never carry tenant or intent ids: unbounded cardinality.

mod format;
mod layer;
mod pool;
mod process;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

pub use self::format::Format;
use self::format::text_004;
pub use self::layer::RpcMetricsLayer;
use self::pool::PoolCollector;
use self::process::ProcessCollector;
use crate::outbox::claim::ClaimCounters;
use crate::outbox::enqueue::EnqueueCounters;
use crate::outbox::maintenance::{SweepObserver, SweepReport};
use crate::outbox::promotion::PromotionObserver;
use crate::outbox::store::{
    self, AcquireCounters, AlsoAtBegin, Pools, PromotionReport, TenantScope,
};
use crate::outbox::{FailOutcome, IntentState};

/// Labels of RPC metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RpcLabels {
    /// Full gRPC method name, e.g. `/outbox.v1.OutboxService/Claim`.
    pub method: String,
    /// gRPC status code name, e.g. `OK`, `NOT_FOUND`.
    pub code: String,
}

/// Labels of per-method histograms.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    /// Full gRPC method name.
    pub method: String,
}

/// Labels of counters by intent kind.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// The intent's kind when `OUTBOX_METRICS__KINDS` lists it, else `other`.
    pub kind: String,
}

/// Labels of connection-pool metrics.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// `tenant` (requests for named tenants) or `fleet` (work across tenants).
    pub pool: String,
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
    /// Kinds that get a `kind` label of their own (`OUTBOX_METRICS__KINDS`); the rest count
    /// as `other`, so the label's cardinality is the list's length plus one.
    kinds: Vec<String>,
    /// Regions whose `outbox_intents` series exist: once seen, a region's states read 0
    /// rather than vanish when they empty (an alert on an absent series would misfire).
    /// At most [`MAX_REGION_LABELS`] and "" (none); later regions count as `(other)`.
    regions_seen: Mutex<BTreeSet<String>>,
    /// RPCs by method and code.
    pub rpc_requests: Family<RpcLabels, Counter>,
    /// RPC latency by method.
    pub rpc_duration: HistogramFamily<MethodLabels>,
    /// Intents recorded (not counting deduplicated ones), by kind.
    pub enqueued: Family<KindLabels, Counter>,
    /// Transactions of direct-mode Enqueue calls, each carrying one call or several
    /// (group commit: calls per transaction = calls / this).
    pub enqueue_transactions: Counter,
    /// Direct-mode Enqueue calls waiting for the transaction in flight to join the next.
    pub enqueue_calls_waiting: Gauge,
    /// Claim calls long-polling: they looked, found nothing, and wait for work.
    pub claims_waiting: Gauge,
    /// Intents leased by Claim, by kind.
    pub claimed: Family<KindLabels, Counter>,
    /// Of those, intents a waiting Claim received from the Enqueue that inserted them.
    pub handed_off: Counter,
    /// Leases a queue's concurrency or rate limit refused to claims while it had due
    /// intents.
    pub refused_by_limit: Counter,
    /// Queues paused by their policy, by kind.
    pub queues_paused: Family<KindLabels, Gauge>,
    /// Queues with a limit at that limit now (in flight at the maximum, or no token), by
    /// kind.
    pub queues_throttled: Family<KindLabels, Gauge>,
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
    /// Queue levels forgotten by the sweeps (found without a live intent for an hour).
    pub queue_levels_forgotten: Counter,
    /// Intents by state and region (live states only; finished ones are counters).
    pub intents: Family<DepthLabels, Gauge>,
    /// Seconds the oldest claimable PENDING intent has waited.
    pub oldest_pending_age: Gauge<f64, AtomicU64>,
    /// Seconds the oldest STAGED intent has waited for its producer transaction.
    pub oldest_staged_age: Gauge<f64, AtomicU64>,
    /// Intents awaiting an operator (NEEDS_RECONCILE + DEAD_LETTERED).
    pub reconcile_backlog: Gauge,
    /// Ordering keys held back by their first intent (retrying, or awaiting an operator).
    pub blocked_keys: Gauge,
    /// Time to get a connection from each pool.
    pub pool_acquire: HistogramFamily<PoolLabels>,
    /// Calls waiting for a connection from each pool.
    pub pool_acquires_waiting: Family<PoolLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The states `outbox_intents` counts: every live one (finished ones are counters).
const LIVE_STATES: [IntentState; 7] = [
    IntentState::Staged,
    IntentState::Waiting,
    IntentState::Pending,
    IntentState::Leased,
    IntentState::Submitted,
    IntentState::NeedsReconcile,
    IntentState::DeadLettered,
];

/// The `kind` label of intents whose kind `OUTBOX_METRICS__KINDS` does not list.
pub const OTHER_KIND: &str = "other";

/// Most regions labelled on their own: regions are the producers' strings, and each costs
/// a series per live state, kept for good.
const MAX_REGION_LABELS: usize = 64;

/// The `region` label of intents of regions past [`MAX_REGION_LABELS`]: not a valid region
/// name, so no region's own label.
const OTHER_REGION: &str = "(other)";

/// The commit this binary was built from (build.rs), or `unknown` outside a git checkout.
pub const BUILD_COMMIT: &str = env!("OUTBOXD_BUILD_COMMIT");

impl Metrics {
    /// A registry with every metric registered (outboxd's under the `outbox_` prefix, the
    /// process's as `process_*`), no kind labelled on its own.
    pub fn new() -> Self {
        Self::with_kinds(Vec::new())
    }

    /// [`Metrics::new`], labelling intents of `kinds` by their kind (the rest `other`).
    pub fn with_kinds(kinds: Vec<String>) -> Self {
        let mut m = Self {
            registry: Registry::default(),
            kinds,
            regions_seen: Mutex::new(BTreeSet::from([String::new()])),
            rpc_requests: Family::default(),
            rpc_duration: Family::new_with_constructor(latency_histogram),
            enqueued: Family::default(),
            enqueue_transactions: Counter::default(),
            enqueue_calls_waiting: Gauge::default(),
            claims_waiting: Gauge::default(),
            claimed: Family::default(),
            handed_off: Counter::default(),
            refused_by_limit: Counter::default(),
            queues_paused: Family::default(),
            queues_throttled: Family::default(),
            given_back: Counter::default(),
            enqueue_to_claim: Family::new_with_constructor(wait_histogram),
            acked: Counter::default(),
            failed: Family::default(),
            dead_lettered: Counter::default(),
            lease_expiries: Family::default(),
            promoted: Counter::default(),
            discarded: Counter::default(),
            purged: Counter::default(),
            queue_levels_forgotten: Counter::default(),
            intents: Family::default(),
            oldest_pending_age: Gauge::default(),
            oldest_staged_age: Gauge::default(),
            reconcile_backlog: Gauge::default(),
            blocked_keys: Gauge::default(),
            pool_acquire: Family::new_with_constructor(latency_histogram),
            pool_acquires_waiting: Family::default(),
        };
        // Series that exist before anything happens: a dashboard or an alert sees 0, not
        // an absent series, for every kind label and every live state.
        for kind in m.kinds.iter().map(String::as_str).chain([OTHER_KIND]) {
            let labels = KindLabels {
                kind: kind.to_owned(),
            };
            let _ = m.enqueued.get_or_create(&labels);
            let _ = m.claimed.get_or_create(&labels);
            let _ = m.queues_paused.get_or_create(&labels);
            let _ = m.queues_throttled.get_or_create(&labels);
        }
        for outcome in [
            FailOutcome::Retry,
            FailOutcome::Permanent,
            FailOutcome::Unknown,
        ] {
            let _ = m.failed.get_or_create(&OutcomeLabels {
                outcome: outcome.as_str().to_owned(),
            });
        }
        m.set_depth(&[], &BTreeSet::from([String::new()]));
        m.registry.register_collector(Box::new(ProcessCollector));
        let build_info = Family::<[(&'static str, &'static str); 2], Gauge>::default();
        build_info
            .get_or_create(&[
                ("version", env!("CARGO_PKG_VERSION")),
                ("commit", BUILD_COMMIT),
            ])
            .set(1);
        let r = m.registry.sub_registry_with_prefix("outbox");
        r.register(
            "build_info",
            "The version and commit of this outboxd, as labels of a constant 1",
            build_info,
        );
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
            "Intents recorded by Enqueue, by kind",
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
            "leases_refused_by_limit",
            "Leases a queue's concurrency or rate limit refused to a Claim while the queue had due intents",
            m.refused_by_limit.clone(),
        );
        r.register(
            "queues_paused",
            "Queues (a tenant's kind) paused by their policy, by kind",
            m.queues_paused.clone(),
        );
        r.register(
            "queues_throttled",
            "Queues at their concurrency or rate limit now, by kind",
            m.queues_throttled.clone(),
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
            "Intents leased by Claim, by kind",
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
            "queue_levels_forgotten",
            "Queue levels forgotten after an hour without a live intent",
            m.queue_levels_forgotten.clone(),
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
        r.register(
            "blocked_ordering_keys",
            "Ordering keys whose first intent holds the later ones back (retrying, dead-lettered or awaiting reconcile)",
            m.blocked_keys.clone(),
        );
        r.register(
            "db_pool_acquire_seconds",
            "Time a call (a transaction, a Claim, a settle) waited for a connection from the pool",
            m.pool_acquire.clone(),
        );
        r.register(
            "db_pool_acquires_waiting",
            "Calls waiting for a connection from the pool now",
            m.pool_acquires_waiting.clone(),
        );
        m
    }

    /// Exports the size of `pools` on every scrape, and hands them the counters of their
    /// acquires; returns the pools that count.
    pub fn observe_pools(&mut self, pools: Pools) -> Pools {
        self.registry
            .sub_registry_with_prefix("outbox")
            .register_collector(Box::new(PoolCollector {
                pools: pools.clone(),
            }));
        let counters = |pool: &str| {
            let labels = PoolLabels {
                pool: pool.to_owned(),
            };
            AcquireCounters {
                seconds: self.pool_acquire.get_or_create(&labels).clone(),
                waiting: self.pool_acquires_waiting.get_or_create(&labels).clone(),
            }
        };
        let (tenant, fleet) = (counters("tenant"), counters("fleet"));
        pools.with_acquire_counters(tenant, fleet)
    }

    /// The exposition text in `format`.
    pub fn encode(&self, format: Format) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        match format {
            Format::OpenMetrics => out,
            Format::Text004 => text_004(&out),
        }
    }

    /// The `kind` label of an intent of `kind`.
    pub fn kind_label(&self, kind: &str) -> &str {
        self.kinds
            .iter()
            .find(|k| *k == kind)
            .map_or(OTHER_KIND, String::as_str)
    }

    /// Counts intents recorded by Enqueue, by kind.
    pub fn record_enqueued<'a>(&self, kinds: impl Iterator<Item = &'a str>) {
        count_by_kind(&self.enqueued, kinds.map(|k| self.kind_label(k)));
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
        let depth = store::queue_depth(&mut tx, &self.kinds).await?;
        tx.commit().await?;
        let regions = {
            let mut seen = self
                .regions_seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            for d in &depth.counts {
                if !seen.contains(&d.region) {
                    // `seen` holds "" (no region) besides the named regions.
                    let label = if seen.len() <= MAX_REGION_LABELS {
                        d.region.clone()
                    } else {
                        OTHER_REGION.to_owned()
                    };
                    seen.insert(label);
                }
            }
            seen.clone()
        };
        let backlog = self.set_depth(&depth.counts, &regions);
        self.reconcile_backlog.set(backlog);
        self.oldest_pending_age
            .set(depth.oldest_pending_age.unwrap_or(0.0));
        self.oldest_staged_age
            .set(depth.oldest_staged_age.unwrap_or(0.0));
        self.blocked_keys.set(depth.blocked_keys);
        self.set_policed(&depth.policed_queues);
        Ok(())
    }

    /// Sets `outbox_queues_paused` and `outbox_queues_throttled` of every kind label, 0
    /// where no queue is.
    fn set_policed(&self, queues: &[store::QueuesOfKind]) {
        for kind in self.kinds.iter().map(String::as_str).chain([OTHER_KIND]) {
            let of_kind =
                |q: &&store::QueuesOfKind| q.kind.as_deref().unwrap_or(OTHER_KIND) == kind;
            let labels = KindLabels {
                kind: kind.to_owned(),
            };
            let (paused, throttled) = queues
                .iter()
                .filter(of_kind)
                .fold((0, 0), |(p, t), q| (p + q.paused, t + q.throttled));
            self.queues_paused.get_or_create(&labels).set(paused);
            self.queues_throttled.get_or_create(&labels).set(throttled);
        }
    }

    /// Sets `outbox_intents` of every live state in every region of `regions` to its count
    /// in `counts`, 0 where there is none; returns the intents awaiting a decision.
    fn set_depth(&self, counts: &[store::StateCount], regions: &BTreeSet<String>) -> i64 {
        let mut by_label: HashMap<(IntentState, &str), i64> = HashMap::new();
        for d in counts {
            let region = regions.get(&d.region).map_or(OTHER_REGION, String::as_str);
            *by_label.entry((d.state, region)).or_default() += d.count;
        }
        let mut backlog = 0;
        for region in regions {
            for state in LIVE_STATES {
                let count = by_label
                    .get(&(state, region.as_str()))
                    .copied()
                    .unwrap_or(0);
                self.intents
                    .get_or_create(&DepthLabels {
                        state: state.as_str().to_owned(),
                        region: region.clone(),
                    })
                    .set(count);
                if state.awaits_decision() {
                    backlog += count;
                }
            }
        }
        backlog
    }

    /// The counters of direct enqueues.
    pub fn enqueue_counters(&self) -> EnqueueCounters {
        EnqueueCounters {
            calls_waiting: self.enqueue_calls_waiting.clone(),
            transactions: self.enqueue_transactions.clone(),
        }
    }

    /// The counters of Claim calls (no claim tally: the console's, not the metrics').
    pub fn claim_counters(&self) -> ClaimCounters {
        ClaimCounters {
            waiting: self.claims_waiting.clone(),
            handed_off: self.handed_off.clone(),
            refused_by_limit: self.refused_by_limit.clone(),
            tally: None,
        }
    }

    /// Records claimed intents (their kinds) and how long each waited while claimable.
    pub fn record_claimed<'a>(&self, claimed: impl Iterator<Item = (&'a str, Duration)>) {
        let histogram = self.enqueue_to_claim.get_or_create(&MethodLabels {
            method: CLAIM_METHOD.to_owned(),
        });
        let kinds = claimed.map(|(kind, waited)| {
            histogram.observe(waited.as_secs_f64());
            self.kind_label(kind)
        });
        count_by_kind(&self.claimed, kinds);
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

    fn forgot_queue_levels(&self, levels: u64) {
        self.queue_levels_forgotten.inc_by(levels);
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

/// Adds each of `kinds` (labels) to its counter in `family`, one `get_or_create` per
/// distinct label rather than per intent.
fn count_by_kind<'a>(family: &Family<KindLabels, Counter>, kinds: impl Iterator<Item = &'a str>) {
    let mut counts: Vec<(&str, u64)> = Vec::new();
    for kind in kinds {
        match counts.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => counts.push((kind, 1)),
        }
    }
    for (kind, n) in counts {
        family
            .get_or_create(&KindLabels {
                kind: kind.to_owned(),
            })
            .inc_by(n);
    }
}

/// The full name of Claim, the `method` of `outbox_enqueue_to_claim_seconds`.
pub(super) const CLAIM_METHOD: &str = "/outbox.v1.OutboxService/Claim";

#[cfg(test)]
mod tests {
    use super::*;

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
