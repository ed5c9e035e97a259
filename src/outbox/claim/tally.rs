//! Intents leased per minute, by tenant and region, for the console's chart: counted in
//! memory as this server's Claims lease them (and its enqueues hand them to waiting
//! claims), and added to `outbox.claim_tally` every second by [`add_until_stopped`], so
//! that a Claim writes nothing more for it.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chrono::{DurationRound, TimeDelta, Utc};
use tokio_util::sync::CancellationToken;

use crate::outbox::store::{self, ClaimCounts, Pools};
use crate::outbox::{Intent, Result};

/// How often the counts are added to the table.
const EVERY: Duration = Duration::from_secs(1);

/// Counts not yet in the table.
#[derive(Debug, Default)]
pub struct ClaimTally(Mutex<ClaimCounts>);

impl ClaimTally {
    /// Counts `leased` in the minute each lease began (its `updated_at`, the database's
    /// clock, as the chart's other lines).
    pub fn count(&self, leased: &[Intent]) {
        let mut counts = self.lock();
        for intent in leased {
            let at = intent.updated_at;
            let minute = at.duration_trunc(TimeDelta::minutes(1)).unwrap_or(at);
            *counts
                .entry((minute, intent.tenant.clone(), intent.region.clone()))
                .or_default() += 1;
        }
    }

    /// Adds what was counted to the table; what fails to go is kept for the next time,
    /// up to the two hours the table keeps.
    ///
    /// # Errors
    /// [`crate::outbox::Error::Database`].
    pub async fn add(&self, pools: &Pools) -> Result<()> {
        let counts = std::mem::take(&mut *self.lock());
        if counts.is_empty() {
            return Ok(());
        }
        let Err(e) = store::add_claim_counts(pools, &counts).await else {
            return Ok(());
        };
        let kept_from = Utc::now() - store::CLAIM_TALLY_KEPT;
        let mut now = self.lock();
        for (key, n) in counts {
            if key.0 >= kept_from {
                *now.entry(key).or_default() += n;
            }
        }
        Err(e)
    }

    fn lock(&self) -> MutexGuard<'_, ClaimCounts> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Adds the counts every second until `shutdown`, then once more.
pub async fn add_until_stopped(tally: Arc<ClaimTally>, pools: Pools, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let stopping = tokio::select! {
            () = shutdown.cancelled() => true,
            _ = every.tick() => false,
        };
        if let Err(e) = tally.add(&pools).await {
            tracing::warn!(error.message = %e, "adding the claim tally failed");
        }
        if stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::DateTime;

    use super::*;

    #[test]
    fn leases_are_counted_by_minute_tenant_and_region() {
        let at = |s: &str| DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc);
        let intent = |updated: &str, tenant: &str| Intent {
            updated_at: at(updated),
            region: "eu".to_owned(),
            tenant: tenant.to_owned(),
            ..crate::outbox::leased_intent(crate::outbox::IntentId(uuid::Uuid::nil()))
        };
        let (a, b, c) = (
            intent("2026-12-05T08:00:01Z", "acme"),
            intent("2026-12-05T08:00:59Z", "acme"),
            intent("2026-12-05T08:01:00Z", "acme"),
        );
        let globex = Intent {
            tenant: "globex".to_owned(),
            ..a.clone()
        };
        let tally = ClaimTally::default();
        tally.count(&[a, b, c, globex]);
        let counts = tally.lock();
        let minute = at("2026-12-05T08:00:00Z");
        assert_eq!(counts[&(minute, "acme".to_owned(), "eu".to_owned())], 2);
        assert_eq!(counts[&(minute, "globex".to_owned(), "eu".to_owned())], 1);
        assert_eq!(counts.len(), 3);
    }
}
