//! Groups of claimers that drained the queue: a long-polling Claim whose group's last look
//! leased fewer intents than it asked for, with nothing woken since, waits at once instead
//! of looking first.
//!
//! At a steady rate most Claim calls began with a look that found nothing (the worker
//! returns from its Ack; the claimer already waiting took what arrived meanwhile): half
//! the claim statements at 1,000 intents/s. At 100/s skipping them saves a quarter of the
//! commits; at 1,000/s something new has usually been enqueued since the group's last
//! look, and little is skipped. Such a look can be skipped exactly when it could find
//! nothing a waiting claimer would not be woken for: the group's last look leased fewer
//! than it asked (so nothing else was claimable for its tenants and filters then), no
//! wake-up has come since (no bump, no turn: nothing was enqueued, promoted, rescued,
//! requeued, retried or released by an ordered Ack through this server, or announced by
//! another), and its next delayed intent is not yet due. The skipping claim then waits as
//! if it had looked at that moment: until a wake-up, that due time, or the group's recheck
//! after the look, whichever is first, so a claimer of the group still looks at least once
//! per recheck.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::outbox::notify::Mark;

/// Groups remembered at most; past it all are forgotten (each looks once more).
const MAX_GROUPS: usize = 4096;

/// What a claimer had seen of the wake-ups when it began a look: the pending signal's
/// count and the turns given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// The pending signal's count ([`crate::outbox::notify::PendingSignal::subscribe`]).
    pub signal: u64,
    /// The turns given ([`crate::outbox::notify::Turn::mark`]).
    pub turns: Mark,
}

/// The drained groups of this server's claimers (by tenants and filters, the groups of
/// [`crate::outbox::notify::Turn`]).
#[derive(Debug, Default)]
pub struct DrainedGroups {
    groups: Mutex<HashMap<String, Drained>>,
}

#[derive(Debug, Clone, Copy)]
struct Drained {
    seen: Seen,
    /// When the group must look again whatever happens: its recheck after the look, or its
    /// next delayed intent's due time if sooner.
    until: Instant,
}

impl DrainedGroups {
    /// Notes a look of `group` that began having seen `seen` and ended at `now`: `drained`
    /// when it leased fewer intents than it asked for, and then `look_again_in` is how long
    /// until the group must look again (its recheck, or its next due intent if sooner).
    pub fn record(
        &self,
        group: &str,
        seen: Seen,
        drained: bool,
        look_again_in: Duration,
        now: Instant,
    ) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if !drained {
            groups.remove(group);
            return;
        }
        if groups.len() >= MAX_GROUPS && !groups.contains_key(group) {
            groups.clear();
        }
        groups.insert(
            group.to_owned(),
            Drained {
                seen,
                until: now + look_again_in,
            },
        );
    }

    /// Until when a claimer of `group` that has seen `seen` may wait without looking, at
    /// `now`: `None` if it must look (the group did not drain the queue in its last look,
    /// something woke claimers since, or the time to look again has come).
    pub fn wait_until(&self, group: &str, seen: Seen, now: Instant) -> Option<Instant> {
        let groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups
            .get(group)
            .filter(|d| d.seen == seen && now < d.until)
            .map(|d| d.until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(signal: u64, turns: u64) -> Seen {
        Seen {
            signal,
            turns: Mark::at(turns),
        }
    }

    const RECHECK: Duration = Duration::from_secs(2);

    #[test]
    fn a_group_that_drained_the_queue_waits_until_its_recheck_while_nothing_wakes_it() {
        let groups = DrainedGroups::default();
        let now = Instant::now();
        assert_eq!(
            groups.wait_until("g", seen(1, 1), now),
            None,
            "unknown: look"
        );
        groups.record("g", seen(1, 1), true, RECHECK, now);
        assert_eq!(groups.wait_until("g", seen(1, 1), now), Some(now + RECHECK));
        assert_eq!(
            groups.wait_until("g", seen(1, 1), now + RECHECK),
            None,
            "the recheck has come"
        );
        assert_eq!(
            groups.wait_until("other", seen(1, 1), now),
            None,
            "per group"
        );
    }

    #[test]
    fn any_wake_up_since_the_look_makes_the_next_claimer_look() {
        let groups = DrainedGroups::default();
        let now = Instant::now();
        groups.record("g", seen(1, 1), true, RECHECK, now);
        assert_eq!(groups.wait_until("g", seen(2, 1), now), None, "a bump");
        assert_eq!(groups.wait_until("g", seen(1, 2), now), None, "a turn");
    }

    #[test]
    fn a_look_that_filled_its_batch_leaves_the_group_undrained() {
        let groups = DrainedGroups::default();
        let now = Instant::now();
        groups.record("g", seen(1, 1), true, RECHECK, now);
        groups.record("g", seen(1, 1), false, RECHECK, now);
        assert_eq!(groups.wait_until("g", seen(1, 1), now), None);
    }

    #[test]
    fn a_delayed_intent_due_before_the_recheck_ends_the_wait_at_its_due_time() {
        let groups = DrainedGroups::default();
        let now = Instant::now();
        let due = Duration::from_millis(300);
        groups.record("g", seen(1, 1), true, due, now);
        assert_eq!(groups.wait_until("g", seen(1, 1), now), Some(now + due));
        assert_eq!(groups.wait_until("g", seen(1, 1), now + due), None);
    }

    #[test]
    fn past_the_most_groups_every_group_is_forgotten() {
        let groups = DrainedGroups::default();
        let now = Instant::now();
        for g in 0..MAX_GROUPS {
            groups.record(&g.to_string(), seen(1, 1), true, RECHECK, now);
        }
        assert!(groups.wait_until("0", seen(1, 1), now).is_some());
        groups.record("one more", seen(1, 1), true, RECHECK, now);
        assert_eq!(groups.wait_until("0", seen(1, 1), now), None);
        assert!(groups.wait_until("one more", seen(1, 1), now).is_some());
    }
}
