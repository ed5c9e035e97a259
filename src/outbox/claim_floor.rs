//! Where a claim starts looking: a floor a little behind the newest intent its group of
//! claimers took, so that while the xmin horizon is pinned a claim does not walk the index
//! entries of every intent claimed since (migration `20261201000008` says why they stay).
//!
//! A floor never loses an intent, it can only find it later. Every transition into PENDING
//! sets `available_at` to the transition's own time or later (enqueue now or after a delay,
//! the producer's commit for a STAGED intent, retry backoff, lease rescue, requeue), so an
//! intent lands behind the floor only when it becomes claimable more than [`LOOK_BACK`]
//! after its `available_at`: a transition whose transaction took that long to commit, an
//! `available_at` set in the past, a claim that skipped a row locked by a claim that then
//! rolled back, a handed-off lease given back (`super::handoff`: it keeps the
//! `available_at` of its enqueue, which a stalled COMMIT may have made older). Those are
//! found by the group's next look at the whole queue: a claim looks at it once
//! [`WHOLE_LOOK_EVERY`] has passed since the group's last such look, and a long-polling
//! claim whenever its wait ends without a wake-up (its recheck, every 2 s by default, or its
//! deadline).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::time::Instant;

/// How far behind the newest intent a group took its next look begins: wider than the
/// time between a transition's `now()` and its commit.
pub const LOOK_BACK: Duration = Duration::from_secs(1);

/// How often a group looks at the whole queue. While xmin is pinned such a look walks every
/// entry left since the pin began; once in this period, not at every claim.
pub const WHOLE_LOOK_EVERY: Duration = Duration::from_secs(2);

/// Groups remembered at most; past it all are forgotten (each looks at the whole queue
/// once more). Groups are few in practice: one per tenant scope and filter set.
const MAX_GROUPS: usize = 4096;

/// The floors of every group of claimers of this server (by tenants and filters, the
/// same groups as [`super::notify::Turn`]).
#[derive(Debug, Default)]
pub struct ClaimFloors {
    groups: Mutex<HashMap<String, Floor>>,
}

#[derive(Debug, Clone, Copy)]
struct Floor {
    /// Newest `available_at` the group has claimed.
    newest: DateTime<Utc>,
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
            .map(|floor| floor.newest - LOOK_BACK)
    }

    /// Notes what a look of `group` from `looked_from` leased: `newest` is the newest
    /// `available_at` among them (`None`: it leased none).
    pub fn record(
        &self,
        group: &str,
        looked_from: Option<DateTime<Utc>>,
        newest: Option<DateTime<Utc>>,
        now: Instant,
    ) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(floor) = groups.get_mut(group) {
            if let Some(newest) = newest {
                floor.newest = floor.newest.max(newest);
            }
            if looked_from.is_none() {
                floor.whole_look_at = now + WHOLE_LOOK_EVERY;
            }
            return;
        }
        // A group's floor starts with a whole look that leased something: before that
        // nothing is known of where its intents begin.
        if let (None, Some(newest)) = (looked_from, newest) {
            if groups.len() >= MAX_GROUPS {
                groups.clear();
            }
            groups.insert(
                group.to_owned(),
                Floor {
                    newest,
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

    #[test]
    fn a_group_looks_at_the_whole_queue_until_it_has_leased_something() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        assert_eq!(floors.look_from("g", now), None);
        floors.record("g", None, None, now);
        assert_eq!(floors.look_from("g", now), None);
    }

    #[test]
    fn after_a_lease_the_next_look_begins_look_back_behind_the_newest_intent_leased() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        floors.record("g", None, Some(at(10)), now);
        assert_eq!(floors.look_from("g", now), Some(at(10) - LOOK_BACK));
        assert_eq!(floors.look_from("other", now), None, "floors are per group");
    }

    #[test]
    fn the_floor_never_moves_back_and_the_whole_queue_is_looked_at_again_in_time() {
        let floors = ClaimFloors::default();
        let start = Instant::now();
        floors.record("g", None, Some(at(10)), start);
        let from = floors.look_from("g", start);
        floors.record("g", from, Some(at(5)), start);
        assert_eq!(floors.look_from("g", start), Some(at(10) - LOOK_BACK));

        let later = start + WHOLE_LOOK_EVERY;
        assert_eq!(floors.look_from("g", later), None);
        // A whole look that found only older intents keeps the floor, and restarts the period.
        floors.record("g", None, Some(at(3)), later);
        assert_eq!(floors.look_from("g", later), Some(at(10) - LOOK_BACK));
        assert_eq!(floors.look_from("g", later + WHOLE_LOOK_EVERY), None);
    }

    #[test]
    fn past_the_most_groups_every_group_is_forgotten() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        for g in 0..MAX_GROUPS {
            floors.record(&g.to_string(), None, Some(at(1)), now);
        }
        assert!(floors.look_from("0", now).is_some());
        floors.record("one more", None, Some(at(1)), now);
        assert_eq!(floors.look_from("0", now), None);
        assert!(floors.look_from("one more", now).is_some());
    }
}
