//! Where a claim starts looking: a floor behind the intents its group of claimers took, so
//! that while the xmin horizon is pinned a claim does not walk the index entries of every
//! intent claimed since (`outbox.claim` in migration `…02_baseline_functions` says why they
//! stay), and a burn-down of
//! an old backlog does not walk the entries its own earlier claims left.
//!
//! A floor never loses an intent, it can only find it later. Every transition into PENDING
//! sets `available_at` to the transition's own time or later (enqueue now or after a delay,
//! the producer's commit for a STAGED intent, retry backoff, lease rescue, requeue). So an
//! intent that a look at time `t` could not see yet (it committed after that look began)
//! has an `available_at` after `t - LOOK_BACK`, unless its transaction took longer than
//! [`LOOK_BACK`] to commit; and one it could see, up to the newest `available_at` it took,
//! it took (claims take the oldest first), unless another transaction held it locked. The
//! floor a look leaves is therefore the older of those two times ([`Leased::floor`]): in a
//! live queue `LOOK_BACK` behind the look, in an older backlog the newest intent it took.
//!
//! An intent lands behind the floor only when it becomes claimable more than
//! [`LOOK_BACK`] after its `available_at`, or a look passed it over: a transition whose
//! transaction took that long to commit, an `available_at` set in the past, a claim that
//! skipped a row locked by a transaction that then left it PENDING (a claim that rolled
//! back, an operator's call that failed), a handed-off lease given back
//! (`super::handoff`: it keeps the `available_at` of its enqueue, which a stalled COMMIT
//! may have made older). Those are found by the group's next look at the whole queue: a
//! claim looks at it once [`WHOLE_LOOK_EVERY`] has passed since the group's last such look,
//! and a long-polling claim whenever its wait ends without a wake-up (its recheck, every
//! 2 s by default, or its deadline).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use crate::outbox::Intent;

/// How far behind its own time a look's floor lies (at most): wider than the time between a
/// transition's `now()` and its commit.
pub const LOOK_BACK: Duration = Duration::from_secs(1);

/// How often a group looks at the whole queue. While xmin is pinned such a look walks every
/// entry left since the pin began; once in this period, not at every claim.
pub const WHOLE_LOOK_EVERY: Duration = Duration::from_secs(2);

/// Groups remembered at most; past it all are forgotten (each looks at the whole queue
/// once more). Groups are few in practice: one per tenant scope and filter set.
const MAX_GROUPS: usize = 4096;

/// What one look leased, as its floor needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leased {
    /// The newest `available_at` among the intents it leased.
    pub newest: DateTime<Utc>,
    /// When it leased them, by the database's clock (the claim's `now`, which it wrote as
    /// their `updated_at`): no later than when its snapshot was taken.
    pub at: DateTime<Utc>,
}

impl Leased {
    /// What a look that leased `intents` (the claim statement's rows) leased; `None` for
    /// none.
    pub fn of(intents: &[Intent]) -> Option<Self> {
        Some(Self {
            newest: intents.iter().map(|i| i.available_at).max()?,
            at: intents.iter().map(|i| i.updated_at).min()?,
        })
    }

    /// Where a later look may begin without passing an intent this one left: whatever it
    /// could see up to `newest` it took (or another transaction held locked), and whatever it
    /// could not see yet became PENDING after `at`, so is available from `at - LOOK_BACK`.
    pub fn floor(self) -> DateTime<Utc> {
        self.newest.min(self.at - LOOK_BACK)
    }
}

/// The floors of every group of claimers of this server (by tenants and filters, the
/// same groups as [`crate::outbox::notify::Turn`]).
#[derive(Debug, Default)]
pub struct ClaimFloors {
    groups: Mutex<HashMap<String, Floor>>,
}

#[derive(Debug, Clone, Copy)]
struct Floor {
    /// Where the group's next look begins: the highest floor its looks left.
    from: DateTime<Utc>,
    /// When the group looks at the whole queue again.
    whole_look_at: Instant,
}

impl ClaimFloors {
    /// Where the next look of `group` begins, at `now`: lease only intents available at or
    /// after this; `None`: look at the whole queue.
    pub fn look_from(&self, group: &str, now: Instant) -> Option<DateTime<Utc>> {
        let groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups
            .get(group)
            .filter(|floor| now < floor.whole_look_at)
            .map(|floor| floor.from)
    }

    /// Notes what a look of `group` from `looked_from` leased (`None`: nothing).
    pub fn record(
        &self,
        group: &str,
        looked_from: Option<DateTime<Utc>>,
        leased: Option<Leased>,
        now: Instant,
    ) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(floor) = groups.get_mut(group) {
            if let Some(leased) = leased {
                floor.from = floor.from.max(leased.floor());
            }
            if looked_from.is_none() {
                floor.whole_look_at = now + WHOLE_LOOK_EVERY;
            }
            return;
        }
        // A group's floor starts with a whole look that leased something: before that
        // nothing is known of where its intents begin.
        if let (None, Some(leased)) = (looked_from, leased) {
            if groups.len() >= MAX_GROUPS {
                groups.clear();
            }
            groups.insert(
                group.to_owned(),
                Floor {
                    from: leased.floor(),
                    whole_look_at: now + WHOLE_LOOK_EVERY,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + seconds, 0).expect("valid")
    }

    /// A look at `seconds` that took intents available up to then (a live queue).
    fn live(seconds: i64) -> Option<Leased> {
        Some(Leased {
            newest: at(seconds),
            at: at(seconds),
        })
    }

    #[test]
    fn a_group_looks_at_the_whole_queue_until_it_has_leased_something() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        assert_eq!(floors.look_from("g", now), None);
        floors.record("g", None, None, now);
        assert_eq!(floors.look_from("g", now), None);
    }

    #[test]
    fn in_a_live_queue_the_next_look_begins_look_back_behind_the_last() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        floors.record("g", None, live(10), now);
        assert_eq!(floors.look_from("g", now), Some(at(10) - LOOK_BACK));
        assert_eq!(floors.look_from("other", now), None, "floors are per group");
    }

    #[test]
    fn in_a_backlog_older_than_the_look_back_the_next_look_begins_at_the_newest_intent_leased() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        let backlog = Leased {
            newest: at(10),
            at: at(60),
        };
        floors.record("g", None, Some(backlog), now);
        assert_eq!(floors.look_from("g", now), Some(at(10)));
        // Anything that becomes PENDING from now on is available after at(60) - LOOK_BACK.
        let nearly = Leased {
            newest: at(59),
            at: at(59) + Duration::from_millis(500),
        };
        floors.record("g", Some(at(10)), Some(nearly), now);
        assert_eq!(
            floors.look_from("g", now),
            Some(at(59) + Duration::from_millis(500) - LOOK_BACK)
        );
    }

    #[test]
    fn a_look_leased_intents_at_the_time_the_claim_wrote_and_up_to_the_newest_available() {
        let intent = |available: i64, updated: i64| Intent {
            available_at: at(available),
            updated_at: at(updated),
            ..crate::outbox::leased_intent(crate::outbox::IntentId(uuid::Uuid::nil()))
        };
        assert_eq!(Leased::of(&[]), None);
        assert_eq!(
            Leased::of(&[intent(5, 20), intent(7, 20), intent(3, 20)]),
            Some(Leased {
                newest: at(7),
                at: at(20)
            })
        );
    }

    #[test]
    fn the_floor_never_moves_back_and_the_whole_queue_is_looked_at_again_in_time() {
        let floors = ClaimFloors::default();
        let start = Instant::now();
        floors.record("g", None, live(10), start);
        let from = floors.look_from("g", start);
        floors.record("g", from, live(5), start);
        assert_eq!(floors.look_from("g", start), Some(at(10) - LOOK_BACK));

        let later = start + WHOLE_LOOK_EVERY;
        assert_eq!(floors.look_from("g", later), None);
        // A whole look that found only older intents keeps the floor, and restarts the period.
        floors.record("g", None, live(3), later);
        assert_eq!(floors.look_from("g", later), Some(at(10) - LOOK_BACK));
        assert_eq!(floors.look_from("g", later + WHOLE_LOOK_EVERY), None);
    }

    #[test]
    fn past_the_most_groups_every_group_is_forgotten() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        for g in 0..MAX_GROUPS {
            floors.record(&g.to_string(), None, live(1), now);
        }
        assert!(floors.look_from("0", now).is_some());
        floors.record("one more", None, live(1), now);
        assert_eq!(floors.look_from("0", now), None);
        assert!(floors.look_from("one more", now).is_some());
    }
}
