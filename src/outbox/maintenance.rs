//! The background sweeps every replica runs: lease rescue, retention purge and forgetting
//! empty queues. They are safe to run concurrently on many replicas because the store takes
//! rows `SKIP LOCKED` (or its turn), and they are the explicitly cross-tenant work the
//! row-level security policies allow.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::store::{self, AlsoAtBegin, BackoffParams, Pools, TenantScope};
use super::{Clock, IntentState, Result};

/// Settings of the background sweeps (`crate::config` reads them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MaintenanceConfig {
    /// How often expired leases are looked for.
    #[serde(with = "humantime_serde")]
    pub rescue_interval: Duration,
    /// How often finished intents are purged.
    #[serde(with = "humantime_serde")]
    pub purge_interval: Duration,
    /// How long DELIVERED intents without an idempotency key are kept (the other finished
    /// ones: see [`Self::live_table_retention`]).
    #[serde(with = "humantime_serde")]
    pub retention: Duration,
    /// How long, at least, a finished intent with an idempotency key is kept, so that its
    /// key is remembered, however short `retention` is: see [`Self::live_table_retention`].
    #[serde(with = "humantime_serde")]
    pub key_retention: Duration,
    /// Rows per sweep statement, so one sweep never holds many locks for long. A row of the
    /// delivered history holds one Ack's intents of one bucket (up to `limits.max_batch`),
    /// so its purge deletes up to that many intents per row.
    #[serde(skip)]
    pub batch_size: i64,
    /// Backoff applied to rescued intents before their next attempt.
    pub backoff: BackoffParams,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        Self {
            rescue_interval: Duration::from_secs(1),
            purge_interval: Duration::from_secs(60),
            retention: Duration::from_secs(24 * 3600),
            key_retention: Duration::from_secs(24 * 3600),
            batch_size: 1000,
            backoff: BackoffParams::default(),
        }
    }
}

impl MaintenanceConfig {
    /// Longest retention (100 years): the purge's cut-off must stay a timestamp.
    pub const RETENTION_CEILING: Duration = Duration::from_secs(36_600 * 86_400);

    /// How long the finished intents that stay in `outbox.intent` are kept: the longer of
    /// the two retentions. Those are the keyed intents (where the unique index on their key
    /// guards it), the DISCARDED ones and those an operator resolved; the delivered intents
    /// without a key, in the history (`outbox.delivered_batch`; or deleted by their Ack at retention
    /// zero), are kept `retention`. One bound for the whole table, so that the purge reads
    /// its finished rows oldest first and stops at the first it must keep, instead of
    /// walking past every keyed intent of the key window on each sweep.
    pub fn live_table_retention(&self) -> Duration {
        self.retention.max(self.key_retention)
    }
}

/// What one pass of the sweeps did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Expired LEASED intents put back to PENDING.
    pub requeued: u64,
    /// Expired LEASED intents out of attempts, dead-lettered.
    pub dead_lettered: u64,
    /// Expired SUBMITTED intents sent to NEEDS_RECONCILE.
    pub needs_reconcile: u64,
    /// Finished intents deleted.
    pub purged: u64,
}

/// Rescues every expired lease, batch by batch, and forgets the replay records of the
/// claims whose lease duration has passed.
///
/// # Errors
/// [`super::Error::Database`].
pub async fn rescue_all(
    pools: &Pools,
    config: &MaintenanceConfig,
    clock: &Clock,
) -> Result<SweepReport> {
    let mut report = SweepReport::default();
    loop {
        let mut tx =
            store::begin_with(pools, &TenantScope::All, &[AlsoAtBegin::IndexPlans]).await?;
        let states =
            store::rescue_expired_leases(&mut *tx, config.backoff, config.batch_size, clock.now())
                .await?;
        tx.commit().await?;
        for state in &states {
            match state {
                IntentState::Pending => report.requeued += 1,
                IntentState::DeadLettered => report.dead_lettered += 1,
                _ => report.needs_reconcile += 1,
            }
        }
        if (states.len() as i64) < config.batch_size {
            break;
        }
    }
    // Apart from the rescue, so that a failure here never holds up leases' rescue.
    if let Err(e) = forget_claim_requests(pools, config, clock).await {
        tracing::warn!(error.message = %e, "forgetting expired claim records failed; will retry");
    }
    if report.needs_reconcile > 0 || report.dead_lettered > 0 {
        tracing::warn!(
            intents.needs_reconcile = report.needs_reconcile,
            intents.dead_lettered = report.dead_lettered,
            "expired leases need an operator"
        );
    }
    Ok(report)
}

/// Deletes the replay records of claims whose lease duration has passed, batch by batch:
/// each batch one statement of the fleet role (its grant is its scope), committed alone.
async fn forget_claim_requests(
    pools: &Pools,
    config: &MaintenanceConfig,
    clock: &Clock,
) -> Result<()> {
    loop {
        let n = store::forget_claim_requests(pools.fleet(), config.batch_size, clock.now()).await?;
        if (n as i64) < config.batch_size {
            return Ok(());
        }
    }
}

/// Purges every finished intent past retention, batch by batch.
///
/// # Errors
/// [`super::Error::Database`].
pub async fn purge_all(pools: &Pools, config: &MaintenanceConfig, clock: &Clock) -> Result<u64> {
    let mut purged = 0;
    loop {
        let mut tx =
            store::begin_with(pools, &TenantScope::All, &[AlsoAtBegin::IndexPlans]).await?;
        let n = store::purge_finished_intents(
            &mut *tx,
            config.live_table_retention(),
            config.retention,
            config.batch_size,
            clock.now(),
        )
        .await?;
        tx.commit().await?;
        purged += n;
        if (n as i64) < config.batch_size {
            return Ok(purged);
        }
    }
}

/// How long a queue's level stays registered without a live intent (docs/flow-control.md).
pub const EMPTY_QUEUE_GRACE: Duration = Duration::from_secs(3600);

/// Queues a sweep forgets at most, each under its lock, held to the sweep's commit.
const QUEUES_PER_SWEEP: i64 = 100;

/// Forgets the queue levels found without a live intent for [`EMPTY_QUEUE_GRACE`] (up to
/// 100 queues a pass) and notes which are empty now. Returns how many levels it forgot.
///
/// # Errors
/// [`super::Error::Database`].
pub async fn forget_empty_queues(pools: &Pools, clock: &Clock) -> Result<u64> {
    let mut tx = store::begin_with(pools, &TenantScope::All, &[AlsoAtBegin::IndexPlans]).await?;
    let forgotten =
        store::forget_empty_queues(&mut tx, EMPTY_QUEUE_GRACE, QUEUES_PER_SWEEP, clock.now())
            .await?;
    tx.commit().await?;
    Ok(forgotten)
}

/// Where the sweeps report what they did (the server's metrics).
pub trait SweepObserver: Send + Sync {
    /// A lease rescue finished.
    fn rescued(&self, report: &SweepReport);
    /// A retention purge deleted `intents`.
    fn purged(&self, intents: u64);
    /// A sweep forgot `levels` queue levels without a live intent.
    fn forgot_queue_levels(&self, levels: u64);
}

/// Runs the sweeps on their intervals (empty queues with the purge) until `shutdown`.
/// Failures are logged and retried on the next tick: a database outage must not stop the
/// sweeps for good. The rescue has its own schedule, so a long purge (a large backlog past
/// retention) never holds up the lease rescue.
pub async fn run_until_stopped(
    pools: Pools,
    config: MaintenanceConfig,
    clock: Clock,
    observer: Arc<dyn SweepObserver>,
    shutdown: CancellationToken,
) {
    let rescue = every(config.rescue_interval, &shutdown, || async {
        match rescue_all(&pools, &config, &clock).await {
            Ok(report) => observer.rescued(&report),
            Err(e) => tracing::warn!(error.message = %e, "lease rescue failed; will retry"),
        }
    });
    let purge = every(config.purge_interval, &shutdown, || async {
        match purge_all(&pools, &config, &clock).await {
            Ok(0) => {}
            Ok(n) => {
                observer.purged(n);
                tracing::info!(intents.purged = n, "purged finished intents");
            }
            Err(e) => tracing::warn!(error.message = %e, "retention purge failed; will retry"),
        }
        match forget_empty_queues(&pools, &clock).await {
            Ok(0) => {}
            Ok(n) => {
                observer.forgot_queue_levels(n);
                tracing::info!(queue_levels.forgotten = n, "forgot empty queues");
            }
            Err(e) => {
                tracing::warn!(error.message = %e, "forgetting empty queues failed; will retry")
            }
        }
    });
    tokio::join!(rescue, purge);
}

/// Runs `sweep` every `period` (a sweep that overran delays the next) until `shutdown`,
/// which also ends a sweep in flight: each of its batches commits on its own, so one cut
/// short leaves nothing half done (its report, and the metrics of the batches it did
/// commit, are lost with it).
async fn every<F, Fut>(period: Duration, shutdown: &CancellationToken, mut sweep: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = ticks.tick() => {}
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = sweep() => {}
        }
    }
}
