//! Prometheus metrics: what happened (counters, fed by the RPC handlers and the sweeps),
//! how the queue looks (gauges, refreshed from PostgreSQL), RPC latency by method and
//! code (a tower layer), the process, the build and the connection pools; exposed as
//! OpenMetrics or as the Prometheus text format 0.0.4, whichever the scraper asks for.
//! Labels never carry tenant or intent ids: unbounded cardinality.

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::outbox::IntentState;
use crate::outbox::claim::ClaimCounters;
use crate::outbox::enqueue::EnqueueCounters;
use crate::outbox::maintenance::{SweepObserver, SweepReport};
use crate::outbox::promotion::PromotionObserver;
use crate::outbox::store::{
    self, AcquireCounters, AlsoAtBegin, Pools, PromotionReport, TenantScope,
};

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
    /// Time to get a connection from each pool.
    pub pool_acquire: HistogramFamily<PoolLabels>,
    /// Transactions waiting for a connection from each pool.
    pub pool_acquires_waiting: Family<PoolLabels, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// The states `outbox_intents` counts: every live one (finished ones are counters).
const LIVE_STATES: [IntentState; 6] = [
    IntentState::Staged,
    IntentState::Pending,
    IntentState::Leased,
    IntentState::Submitted,
    IntentState::NeedsReconcile,
    IntentState::DeadLettered,
];

/// The `kind` label of intents whose kind `OUTBOX_METRICS__KINDS` does not list.
pub const OTHER_KIND: &str = "other";

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
            "db_pool_acquire_seconds",
            "Time a transaction waited for a connection from the pool",
            m.pool_acquire.clone(),
        );
        r.register(
            "db_pool_acquires_waiting",
            "Transactions waiting for a connection from the pool now",
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
        let depth = store::queue_depth(&mut tx).await?;
        tx.commit().await?;
        let regions = {
            let mut seen = self
                .regions_seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            seen.extend(depth.counts.iter().map(|d| d.region.clone()));
            seen.clone()
        };
        let backlog = self.set_depth(&depth.counts, &regions);
        self.reconcile_backlog.set(backlog);
        self.oldest_pending_age
            .set(depth.oldest_pending_age.unwrap_or(0.0));
        self.oldest_staged_age
            .set(depth.oldest_staged_age.unwrap_or(0.0));
        Ok(())
    }

    /// Sets `outbox_intents` of every live state in every region of `regions` to its count
    /// in `counts`, 0 where there is none; returns the intents awaiting a decision.
    fn set_depth(&self, counts: &[store::StateCount], regions: &BTreeSet<String>) -> i64 {
        let mut backlog = 0;
        for region in regions {
            for state in LIVE_STATES {
                let count = counts
                    .iter()
                    .filter(|d| d.state == state && d.region == *region)
                    .map(|d| d.count)
                    .sum();
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

    /// The counters of Claim calls.
    pub fn claim_counters(&self) -> ClaimCounters {
        ClaimCounters {
            waiting: self.claims_waiting.clone(),
            handed_off: self.handed_off.clone(),
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

/// An exposition format of `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 (`application/openmetrics-text`).
    OpenMetrics,
    /// The Prometheus text format 0.0.4 (`text/plain`), what scrapers that do not ask for
    /// OpenMetrics parse (promtool, prometheus_client's parser, older Prometheus).
    Text004,
}

impl Format {
    /// The format an `Accept` header asks for: OpenMetrics when it names
    /// `application/openmetrics-text` with a weight (q) above 0 and at least that of any
    /// other type it accepts; text 0.0.4 otherwise (no header, `*/*`, `text/plain`).
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut other) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.strip_prefix("q="))
                .find_map(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => openmetrics = openmetrics.max(q),
                "" => {}
                _ => other = other.max(q),
            }
        }
        match openmetrics > 0.0 && openmetrics >= other {
            true => Self::OpenMetrics,
            false => Self::Text004,
        }
    }

    /// The `Content-Type` of a reply in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::Text004 => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// OpenMetrics text as the Prometheus text format 0.0.4: a counter's HELP and TYPE name
/// its samples (`x_total`, where OpenMetrics names the family `x`), an info family is a
/// gauge `x_info`, and there are no UNIT lines nor `# EOF`. Without this a 0.0.4 parser
/// sees samples of families it has no HELP nor TYPE for ("no help text"), and counters
/// as untyped.
fn text_004(openmetrics: &str) -> String {
    let types: std::collections::HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        let Some((prefix, rest)) = descriptor else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
        let (suffix, tail) = match (types.get(name).copied(), prefix) {
            (Some("counter"), _) => ("_total", tail),
            (Some("info"), "# TYPE ") => ("_info", "gauge"),
            (Some("info"), _) => ("_info", tail),
            _ => ("", tail),
        };
        out.push_str(&format!("{prefix}{name}{suffix} {tail}\n"));
    }
    out
}

/// The process's CPU time, memory and file descriptors (the `process_*` metrics of the
/// Prometheus client libraries), read from `/proc/self` at each scrape. Written here because
/// no maintained collector exists for prometheus-client (the `metrics` crate's one
/// needs that other library), and the reading is a few files. Elsewhere than Linux it
/// exports nothing.
#[derive(Debug)]
struct ProcessCollector;

/// What `/proc/self` says of this process.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    start_time_seconds: i64,
    threads: i64,
    open_fds: i64,
    max_fds: i64,
}

impl ProcessStats {
    /// Reads them, or `None` where there is no `/proc/self/stat` (not Linux).
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat").ok()?;
        let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
        let ticks = rustix::param::clock_ticks_per_second() as f64;
        let page = rustix::param::page_size() as i64;
        let mut stats = Self::parse(&stat, &boot_time, &limits, ticks, page)?;
        stats.open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as i64);
        Some(stats)
    }

    /// From the text of `/proc/self/stat`, `/proc/stat` and `/proc/self/limits`.
    fn parse(stat: &str, system: &str, limits: &str, ticks: f64, page: i64) -> Option<Self> {
        // The command name (field 2) may hold spaces and parentheses: fields resume after
        // the last ')'. `fields[0]` is then field 3, the state.
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        let field = |n: usize| -> Option<f64> { fields.get(n - 3)?.parse().ok() };
        let boot: f64 = system
            .lines()
            .find_map(|l| l.strip_prefix("btime "))?
            .trim()
            .parse()
            .ok()?;
        let max_fds = limits
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .and_then(|l| l.split_whitespace().nth(3))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        Some(Self {
            cpu_seconds: (field(14)? + field(15)?) / ticks,
            threads: field(20)? as i64,
            start_time_seconds: (boot + field(22)? / ticks) as i64,
            virtual_bytes: field(23)? as i64,
            resident_bytes: field(24)? as i64 * page,
            open_fds: 0,
            max_fds,
        })
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(p) = ProcessStats::read() else {
            return Ok(());
        };
        ConstCounter::new(p.cpu_seconds).encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            MetricType::Counter,
        )?)?;
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                p.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                p.virtual_bytes,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                p.start_time_seconds,
            ),
            (
                "process_threads",
                "Number of OS threads in the process",
                p.threads,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                p.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                p.max_fds,
            ),
        ] {
            ConstGauge::new(value).encode(encoder.encode_descriptor(
                name,
                help,
                None,
                MetricType::Gauge,
            )?)?;
        }
        Ok(())
    }
}

/// The size of the connection pools, read from them at each scrape.
#[derive(Debug)]
struct PoolCollector {
    pools: Pools,
}

impl Collector for PoolCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let pools = [
            ("tenant", self.pools.tenant()),
            ("fleet", self.pools.fleet()),
        ];
        type Read = fn(&sqlx::PgPool) -> i64;
        let read: [(&str, &str, Read); 3] = [
            (
                "db_pool_connections",
                "Connections the pool holds open (idle and in use)",
                |p| i64::from(p.size()),
            ),
            (
                "db_pool_idle_connections",
                "Open connections of the pool that are idle",
                |p| p.num_idle() as i64,
            ),
            (
                "db_pool_max_connections",
                "Most connections the pool opens (OUTBOX_DATABASE__MAX_CONNECTIONS)",
                |p| i64::from(p.options().get_max_connections()),
            ),
        ];
        for (name, help, value) in read {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, pool) in pools {
                let labels = [("pool", label)];
                ConstGauge::new(value(pool)).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
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

/// The full name of Claim, the `method` of `outbox_enqueue_to_claim_seconds`.
const CLAIM_METHOD: &str = "/outbox.v1.OutboxService/Claim";

/// The methods served, labelled by their full gRPC name (`/package.Service/Method`): one
/// form for every service, the name gRPC itself puts on the wire (`:path`).
const METHODS: [&str; 14] = [
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
        assert_eq!(outbox.len(), 10);
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

    #[test]
    fn openmetrics_is_served_only_to_a_scraper_that_prefers_it() {
        use Format::*;
        for (accept, format) in [
            (None, Text004),
            (Some(""), Text004),
            (Some("*/*"), Text004),
            (Some("text/plain; version=0.0.4"), Text004),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("application/openmetrics-text;version=1.0.0"),
                OpenMetrics,
            ),
            (
                Some("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;q=0.3,*/*;q=0.2"),
                OpenMetrics,
            ),
            (
                Some("text/plain,application/openmetrics-text;q=0.9"),
                Text004,
            ),
            (Some("application/openmetrics-text;q=0"), Text004),
            (Some("Application/OpenMetrics-Text"), OpenMetrics),
            (Some("application/openmetrics-text;q=nonsense"), OpenMetrics),
        ] {
            assert_eq!(Format::negotiate(accept), format, "{accept:?}");
        }
    }

    #[test]
    fn text_004_names_counter_families_by_their_samples_and_drops_what_it_lacks() {
        let m = Metrics::new();
        m.record_enqueued(["job"].into_iter());
        let openmetrics = m.encode(Format::OpenMetrics);
        assert!(openmetrics.contains("# TYPE outbox_intents_enqueued counter\n"));
        assert!(openmetrics.ends_with("# EOF\n"));
        let text = m.encode(Format::Text004);
        assert!(text.contains("# HELP outbox_intents_enqueued_total Intents recorded"));
        assert!(text.contains("# TYPE outbox_intents_enqueued_total counter\n"));
        assert!(text.contains("outbox_intents_enqueued_total{kind=\"other\"} 1\n"));
        assert!(text.contains("# TYPE outbox_intents gauge\n"));
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"));
        // Only the descriptors change (the process's own figures move between scrapes).
        let samples = |t: &str| {
            t.lines()
                .filter(|l| !l.starts_with('#') && !l.starts_with("process_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(samples(&text), samples(&openmetrics));
        assert_eq!(
            text_004("# HELP x_info Build.\n# TYPE x info\nx_info{v=\"1\"} 1\n# EOF\n"),
            "# HELP x_info Build.\n# TYPE x_info gauge\nx_info{v=\"1\"} 1\n"
        );
    }

    #[test]
    fn process_stats_are_read_from_procfs_text_even_with_a_strange_command_name() {
        let stat = "4242 (out box) d) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 150 0 0 20 0 7 0 12345 1000000 300 18446744073709551615";
        let system = "cpu  1 2 3\nbtime 1700000000\nprocesses 9\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        let stats = ProcessStats::parse(stat, system, limits, 100.0, 4096).unwrap();
        assert_eq!(
            stats,
            ProcessStats {
                cpu_seconds: 4.0,
                resident_bytes: 300 * 4096,
                virtual_bytes: 1_000_000,
                start_time_seconds: 1_700_000_123,
                threads: 7,
                open_fds: 0,
                max_fds: 1024,
            }
        );
        assert_eq!(
            ProcessStats::parse("garbage", system, limits, 100.0, 4096),
            None
        );
        let live = ProcessStats::read().expect("Linux");
        assert!(live.resident_bytes > 0 && live.open_fds > 0 && live.threads > 0);
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
