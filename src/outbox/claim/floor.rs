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
//! transaction took that long to commit (an `available_at` given in the past is stored as
//! the Enqueue's time), a claim that
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
use crate::outbox::store::QueueLevel;

/// How far behind its own time a look's floor lies (at most): wider than the time between a
/// transition's `now()` and its commit.
pub const LOOK_BACK: Duration = Duration::from_secs(1);

/// How often a group looks at the whole queue. While xmin is pinned such a look walks every
/// entry left since the pin began; once in this period, not at every claim.
pub const WHOLE_LOOK_EVERY: Duration = Duration::from_secs(2);

/// Groups remembered at most; past it all are forgotten (each looks at the whole queue
/// once more). Groups are few in practice: one per tenant scope and filter set.
const MAX_GROUPS: usize = 4096;

/// Levels remembered per group at most; past it the group's are forgotten.
const MAX_LEVELS: usize = 4096;

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
    /// What one look leased in each level.
    pub fn by_level(intents: &[Intent]) -> Vec<(QueueLevel, Self)> {
        let mut levels: HashMap<QueueLevel, Self> = HashMap::new();
        for intent in intents {
            let level = QueueLevel {
                tenant: intent.tenant.clone(),
                kind: intent.kind.clone(),
                priority: intent.priority,
            };
            let this = Self {
                newest: intent.available_at,
                at: intent.updated_at,
            };
            levels
                .entry(level)
                .and_modify(|l| {
                    l.newest = l.newest.max(this.newest);
                    l.at = l.at.min(this.at);
                })
                .or_insert(this);
        }
        levels.into_iter().collect()
    }

    /// Where a later look may begin without passing an intent this one left: whatever it
    /// could see up to `newest` it took (or another transaction held locked), and whatever it
    /// could not see yet became PENDING after `at`, so is available from `at - LOOK_BACK`.
    pub fn floor(self) -> DateTime<Utc> {
        self.newest.min(self.at - LOOK_BACK)
    }
}

/// The floors of every group of claimers of this server (by tenants and filters, the
/// same groups as [`crate::outbox::notify::Turn`]), one per level a group took from: a
/// claim takes each level (a queue's intents of one priority) oldest first, but shares its
/// batch among levels, so what it left in one level says nothing of another.
#[derive(Debug, Default)]
pub struct ClaimFloors {
    groups: Mutex<HashMap<String, Floors>>,
}

#[derive(Debug)]
struct Floors {
    /// Where the group's next look begins in each level: the highest floor its looks left.
    levels: HashMap<QueueLevel, DateTime<Utc>>,
    /// When the group looks at the whole queue again.
    whole_look_at: Instant,
}

impl ClaimFloors {
    /// Where the next look of `group` begins, at `now`, in each level it has a floor for
    /// (in the others: at the start); `None`: look at the whole queue.
    pub fn look_from(&self, group: &str, now: Instant) -> Option<Vec<(QueueLevel, DateTime<Utc>)>> {
        let groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        groups
            .get(group)
            .filter(|floors| now < floors.whole_look_at)
            .map(|floors| {
                floors
                    .levels
                    .iter()
                    .map(|(l, at)| (l.clone(), *at))
                    .collect()
            })
    }

    /// Notes what a look of `group` (of the whole queue, or from the group's floors) leased,
    /// level by level.
    pub fn record(
        &self,
        group: &str,
        whole: bool,
        leased: Vec<(QueueLevel, Leased)>,
        now: Instant,
    ) {
        let mut groups = self.groups.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(floors) = groups.get_mut(group) {
            // A level without a floor was looked at from its start, as in a whole look.
            for (level, leased) in leased {
                let floor = floors.levels.entry(level).or_insert(leased.floor());
                *floor = (*floor).max(leased.floor());
            }
            if floors.levels.len() > MAX_LEVELS {
                floors.levels.clear();
            }
            if whole {
                floors.whole_look_at = now + WHOLE_LOOK_EVERY;
            }
            return;
        }
        // A group's floors start with a whole look that leased something: before that
        // nothing is known of where its intents begin.
        if whole && !leased.is_empty() {
            if groups.len() >= MAX_GROUPS {
                groups.clear();
            }
            groups.insert(
                group.to_owned(),
                Floors {
                    levels: leased
                        .into_iter()
                        .map(|(l, leased)| (l, leased.floor()))
                        .collect(),
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

    fn level(kind: &str) -> QueueLevel {
        QueueLevel {
            tenant: "t".to_owned(),
            kind: kind.to_owned(),
            priority: 0,
        }
    }

    /// A look at `seconds` that took intents of level `kind` available up to then (a live
    /// queue).
    fn live(kind: &str, seconds: i64) -> Vec<(QueueLevel, Leased)> {
        vec![(
            level(kind),
            Leased {
                newest: at(seconds),
                at: at(seconds),
            },
        )]
    }

    fn floor_of(
        floors: &ClaimFloors,
        group: &str,
        kind: &str,
        now: Instant,
    ) -> Option<DateTime<Utc>> {
        let levels = floors.look_from(group, now)?;
        levels
            .into_iter()
            .find(|(l, _)| *l == level(kind))
            .map(|(_, at)| at)
    }

    #[test]
    fn a_group_looks_at_the_whole_queue_until_it_has_leased_something() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        assert_eq!(floors.look_from("g", now), None);
        floors.record("g", true, Vec::new(), now);
        assert_eq!(floors.look_from("g", now), None);
    }

    #[test]
    fn in_a_live_queue_the_next_look_begins_look_back_behind_the_last() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        floors.record("g", true, live("a", 10), now);
        assert_eq!(floor_of(&floors, "g", "a", now), Some(at(10) - LOOK_BACK));
        assert_eq!(floors.look_from("other", now), None, "floors are per group");
    }

    #[test]
    fn each_level_has_its_own_floor_and_a_new_level_starts_at_its_start() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        floors.record("g", true, live("a", 10), now);
        assert_eq!(floor_of(&floors, "g", "b", now), None);
        floors.record("g", false, live("b", 3), now);
        assert_eq!(floor_of(&floors, "g", "a", now), Some(at(10) - LOOK_BACK));
        assert_eq!(floor_of(&floors, "g", "b", now), Some(at(3) - LOOK_BACK));
    }

    #[test]
    fn in_a_backlog_older_than_the_look_back_the_next_look_begins_at_the_newest_intent_leased() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        let backlog = Leased {
            newest: at(10),
            at: at(60),
        };
        floors.record("g", true, vec![(level("a"), backlog)], now);
        assert_eq!(floor_of(&floors, "g", "a", now), Some(at(10)));
        // Anything that becomes PENDING from now on is available after at(60) - LOOK_BACK.
        let nearly = Leased {
            newest: at(59),
            at: at(59) + Duration::from_millis(500),
        };
        floors.record("g", false, vec![(level("a"), nearly)], now);
        assert_eq!(
            floor_of(&floors, "g", "a", now),
            Some(at(59) + Duration::from_millis(500) - LOOK_BACK)
        );
    }

    #[test]
    fn a_look_leased_intents_at_the_time_the_claim_wrote_and_up_to_the_newest_available() {
        let intent = |kind: &str, available: i64, updated: i64| Intent {
            kind: kind.to_owned(),
            available_at: at(available),
            updated_at: at(updated),
            ..crate::outbox::leased_intent(crate::outbox::IntentId(uuid::Uuid::nil()))
        };
        assert_eq!(Leased::by_level(&[]), Vec::new());
        let mut levels = Leased::by_level(&[
            intent("a", 5, 20),
            intent("a", 7, 21),
            intent("a", 3, 20),
            intent("b", 9, 22),
        ]);
        levels.sort_by(|x, y| x.0.kind.cmp(&y.0.kind));
        assert_eq!(
            levels,
            vec![
                (
                    level("a"),
                    Leased {
                        newest: at(7),
                        at: at(20)
                    }
                ),
                (
                    level("b"),
                    Leased {
                        newest: at(9),
                        at: at(22)
                    }
                ),
            ]
        );
    }

    #[test]
    fn the_floor_never_moves_back_and_the_whole_queue_is_looked_at_again_in_time() {
        let floors = ClaimFloors::default();
        let start = Instant::now();
        floors.record("g", true, live("a", 10), start);
        floors.record("g", false, live("a", 5), start);
        assert_eq!(floor_of(&floors, "g", "a", start), Some(at(10) - LOOK_BACK));

        let later = start + WHOLE_LOOK_EVERY;
        assert_eq!(floors.look_from("g", later), None);
        // A whole look that found only older intents keeps the floor, and restarts the period.
        floors.record("g", true, live("a", 3), later);
        assert_eq!(floor_of(&floors, "g", "a", later), Some(at(10) - LOOK_BACK));
        assert_eq!(floors.look_from("g", later + WHOLE_LOOK_EVERY), None);
    }

    #[test]
    fn past_the_most_groups_every_group_is_forgotten() {
        let floors = ClaimFloors::default();
        let now = Instant::now();
        for g in 0..MAX_GROUPS {
            floors.record(&g.to_string(), true, live("a", 1), now);
        }
        assert!(floors.look_from("0", now).is_some());
        floors.record("one more", true, live("a", 1), now);
        assert_eq!(floors.look_from("0", now), None);
        assert!(floors.look_from("one more", now).is_some());
    }
}
