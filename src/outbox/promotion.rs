//! The promoter: turns STAGED intents into PENDING (or DISCARDED) as soon as their
//! producer transaction finishes. Kicked by the commit NOTIFY of `outbox.txn_token()`;
//! a short polling sweep is the fallback for aborts (which send nothing), producers in other
//! databases of the cluster (whose NOTIFY outboxd cannot hear) and lost notifications.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::notify::PendingSignal;
use super::store::{self, AlsoAtBegin, Pools, PromotionReport, TenantScope};
use super::{Clock, Result};

/// Rows per promotion statement.
const BATCH: i64 = 1000;

/// Resolves every STAGED intent whose transaction has finished.
///
/// # Errors
/// [`super::Error::Database`].
pub async fn promote_all(pools: &Pools, clock: &Clock) -> Result<PromotionReport> {
    let mut total = PromotionReport::default();
    loop {
        let mut tx =
            store::begin_with(pools, &TenantScope::All, &[AlsoAtBegin::IndexPlans]).await?;
        let r = store::promote_staged_intents(&mut tx, BATCH, clock.now()).await?;
        tx.commit().await?;
        total.promoted += r.promoted;
        total.discarded += r.discarded;
        total.forgotten += r.forgotten;
        if ((r.promoted + r.discarded + r.forgotten) as i64) < BATCH {
            return Ok(total);
        }
    }
}

/// Where promotion reports what it did (the server's metrics).
pub trait PromotionObserver: Send + Sync {
    /// A round of promotion finished.
    fn promoted(&self, report: &PromotionReport);
}

/// Promotes on every kick and at least every `interval`, until `shutdown`.
pub async fn run_until_stopped(
    pools: Pools,
    clock: Clock,
    kick: Arc<Notify>,
    interval: Duration,
    pending: PendingSignal,
    observer: Arc<dyn PromotionObserver>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = kick.notified() => {}
            _ = tokio::time::sleep(interval) => {}
        }
        match promote_all(&pools, &clock).await {
            Ok(r) => {
                observer.promoted(&r);
                if r.promoted > 0 {
                    // Local claimers need not wait for the NOTIFY round trip.
                    pending.bump();
                }
                if r.forgotten > 0 {
                    tracing::warn!(
                        intents.count = r.forgotten,
                        "staged intents of a transaction this cluster cannot resolve (too old, or \
                         not handed out yet) need an operator"
                    );
                }
            }
            Err(e) => {
                tracing::warn!(error.message = %e, "promotion of staged intents failed; will retry")
            }
        }
    }
}
