//! Ordering keys: the intents of one key are leased one at a time, in the order their
//! transactions committed.
//!
//! Commit order comes from the producers' journals, not from the server: a two-phase
//! transaction committed between its `commit_sent` and `committed` lines, a direct
//! Enqueue's transaction between the row's `created_at` (its transaction's start) and the
//! answer the producer journaled. Intent `a` committed before `b` for certain when `a`'s
//! window closed before `b`'s opened, or when both came from one Enqueue and `a` was
//! earlier in the request; commits whose windows overlap may be in either order, and an
//! intent whose commit was never answered (killed producer, lost answer) has an open
//! window. Lease times are bounds too: a lease was minted between its claim transaction's
//! start (`claimed_at`) and the moment the worker journaled the answer (`claim_t`).
//!
//! Two checks per key, each reported only when the bounds make it certain:
//! - order: no intent's first lease was minted before an intent of its key that committed
//!   earlier had finished: been delivered (Ack or operator DELIVERED; `finished_at`, the
//!   start of the transaction that delivered it) or released by an operator's DEAD. A head
//!   still retrying, dead-lettered or NEEDS_RECONCILE holds the later ones back. Leases of
//!   the head itself again and again (redeliveries after a crash or a lost answer) are
//!   at-least-once, not a violation;
//! - one at a time: no two leases of different intents of one key were live at once, a
//!   lease living until the Ack that delivered its intent, else at least until its expiry,
//!   its holder's Fail or its holder's Ack, whichever was first.
//!
//! Delivered ordered intents are kept, in the delivered history with their keys, until the
//! retention purges them, 24 h in the suite: the snapshot (`outbox.all_intents`) has them all.

use std::collections::{BTreeMap, HashMap};

use uuid::Uuid;

use super::leases::LeaseLife;
use super::{CLOCK_TOLERANCE_US, Guarantee, Observations, Verdict, clock};
use crate::cluster::{IntentRow, Snapshot};
use crate::journal::Event;

/// The Enqueue call an intent came from: a two-phase order, or a direct call (producer
/// journal, event index).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Order(i64),
    Direct(usize, usize),
}

/// What the producers journaled about where an intent came from.
#[derive(Debug, Clone, Copy)]
struct Origin {
    call: Call,
    /// Position in the Enqueue request.
    index: usize,
    /// The commit began no earlier than this (µs; two-phase: `commit_sent`).
    start: Option<i64>,
    /// The commit was over by this (µs; `committed`, or the direct Enqueue's answer).
    end: Option<i64>,
}

/// One committed ordered intent and what the checks need of it.
struct Ordered<'a> {
    row: &'a IntentRow,
    origin: Option<Origin>,
    start: i64,
    end: i64,
    /// When it stopped holding its key (None: it still held it at the end).
    finish: Option<i64>,
    /// Its leases, first minted first.
    leases: Vec<&'a LeaseLife>,
}

impl Ordered<'_> {
    /// Whether `self` committed before `other` for certain.
    fn precedes(&self, other: &Ordered<'_>) -> bool {
        match (self.origin, other.origin) {
            (Some(a), Some(b)) if a.call == b.call => a.index < b.index,
            _ => self.end < other.start,
        }
    }

    /// Why `self` is known to have committed before `other`, for the report.
    fn why_before(&self, other: &Ordered<'_>) -> String {
        match (self.origin, other.origin) {
            (Some(a), Some(b)) if a.call == b.call => format!(
                "same Enqueue ({}), request positions {} < {}",
                describe_call(a.call),
                a.index,
                b.index
            ),
            _ => format!(
                "its commit was over by {} ({}), the later one's began at {} ({})",
                clock(self.end),
                self.origin
                    .map_or("?".to_owned(), |o| describe_call(o.call)),
                clock(other.start),
                other
                    .origin
                    .map_or("direct, unanswered".to_owned(), |o| describe_call(o.call)),
            ),
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} ({}, txn {}, commit ts {}, order_seq {}, ended {}{})",
            self.row.id,
            if self.row.two_phase {
                "two-phase"
            } else {
                "direct"
            },
            self.row.txn_xid.as_deref().unwrap_or("?"),
            self.row.commit_us.map_or("?".to_owned(), clock),
            self.row.order_seq.map_or("?".to_owned(), |s| s.to_string()),
            self.row.state,
            self.finish
                .map_or(String::new(), |f| format!(", finished {}", clock(f))),
        )
    }
}

fn describe_call(call: Call) -> String {
    match call {
        Call::Order(order) => format!("producer order {order}"),
        Call::Direct(journal, event) => {
            format!("direct Enqueue, journal #{journal} line {}", event + 1)
        }
    }
}

/// Commit windows of the intents the producers journaled.
fn origins(obs: &Observations) -> HashMap<Uuid, Origin> {
    let mut out = HashMap::new();
    let (mut sent, mut done): (HashMap<i64, i64>, HashMap<i64, i64>) = Default::default();
    for (j, (_, events)) in obs.producers.iter().enumerate() {
        for (e, event) in events.iter().enumerate() {
            match event {
                Event::Staged { order, intents, .. } => {
                    for (index, id) in intents.iter().enumerate() {
                        let call = Call::Order(*order);
                        out.insert(
                            *id,
                            Origin {
                                call,
                                index,
                                start: None,
                                end: None,
                            },
                        );
                    }
                }
                Event::CommitSent { t, order } => {
                    sent.insert(*order, *t);
                }
                Event::Committed { t, order } => {
                    done.insert(*order, *t);
                }
                Event::DirectEnqueued { t, intents, .. } => {
                    for (index, id) in intents.iter().enumerate() {
                        let call = Call::Direct(j, e);
                        out.insert(
                            *id,
                            Origin {
                                call,
                                index,
                                start: None,
                                end: Some(*t),
                            },
                        );
                    }
                }
                _ => {}
            }
        }
    }
    for origin in out.values_mut() {
        if let Call::Order(order) = origin.call {
            origin.start = sent.get(&order).copied();
            origin.end = done.get(&order).copied();
        }
    }
    out
}

pub(super) fn check_ordering(
    snapshot: &Snapshot,
    obs: &Observations,
    leases: &HashMap<Uuid, LeaseLife>,
    v: &mut Verdict,
) {
    let origins = origins(obs);
    let mut of_intent: HashMap<Uuid, Vec<&LeaseLife>> = HashMap::new();
    for l in leases.values() {
        of_intent.entry(l.intent).or_default().push(l);
    }
    let mut keys: BTreeMap<&str, Vec<Ordered<'_>>> = BTreeMap::new();
    for row in snapshot.intents.values() {
        let Some(key) = row.ordering_key.as_deref() else {
            continue;
        };
        v.counts.ordered += 1;
        // Never committed: never in its key's order (claiming it is the aborted check's).
        if row.state == "discarded" || (row.two_phase && row.xact.as_deref() != Some("committed")) {
            continue;
        }
        let origin = origins.get(&row.id).copied();
        let start = origin
            .and_then(|o| o.start)
            .unwrap_or(row.created_us)
            .max(row.created_us);
        let end = origin.and_then(|o| o.end).unwrap_or(i64::MAX);
        let finish = match row.state.as_str() {
            "delivered" | "dead_lettered" => row.finished_us,
            _ => None,
        };
        let mut own = of_intent.remove(&row.id).unwrap_or_default();
        own.sort_by_key(|l| (l.claimed_at, l.claim_t));
        keys.entry(key).or_default().push(Ordered {
            row,
            origin,
            start,
            end,
            finish,
            leases: own,
        });
    }
    v.counts.ordering_keys = keys.len() as u64;
    for (key, intents) in &keys {
        check_key_order(key, intents, v);
        check_one_at_a_time(key, intents, v);
    }
}

/// No intent first leased before an earlier one of its key had finished.
fn check_key_order(key: &str, intents: &[Ordered<'_>], v: &mut Verdict) {
    for later in intents {
        let Some(first) = later.leases.iter().min_by_key(|l| l.claim_t) else {
            continue;
        };
        let mut blockers = Vec::new();
        for earlier in intents {
            if std::ptr::eq(earlier, later) || !earlier.precedes(later) {
                continue;
            }
            v.counts.order_pairs += 1;
            let unfinished = earlier
                .finish
                .is_none_or(|f| first.claim_t + CLOCK_TOLERANCE_US < f);
            if unfinished {
                blockers.push(earlier);
            }
        }
        // The earliest of them is the clearest evidence (and one violation per intent).
        let Some(earlier) = blockers.into_iter().min_by_key(|e| (e.end, e.start)) else {
            continue;
        };
        let held = match earlier.finish {
            Some(f) => format!("it finished only at {}", clock(f)),
            None => format!("it never finished (ended {})", earlier.row.state),
        };
        let earlier_leases = earlier
            .leases
            .iter()
            .map(|l| l.describe())
            .collect::<Vec<_>>()
            .join("; ");
        v.violate(
            Guarantee::KeyOrder,
            Some(later.row.id),
            format!(
                "key {key}: first leased by {} (claim answered {}) before {} had finished, \
                 though that one committed earlier ({}); {held}; its leases: [{}]; the later \
                 intent: {}",
                first.describe(),
                clock(first.claim_t),
                earlier.describe(),
                earlier.why_before(later),
                earlier_leases,
                later.describe(),
            ),
        );
    }
}

/// When lease `l` of `of` stopped holding the key, at the earliest.
fn lease_end(l: &LeaseLife, of: &Ordered<'_>) -> i64 {
    if of.row.state == "delivered"
        && of.row.lease_id == Some(l.lease)
        && let Some(f) = of.finish
    {
        return f;
    }
    let mut end = l.expires;
    if let Some((_, t)) = l.fail_sent {
        end = end.min(t);
    }
    if let Some(t) = l.ack_sent {
        end = end.min(t);
    }
    end
}

/// No two leases of different intents of one key live at once.
fn check_one_at_a_time(key: &str, intents: &[Ordered<'_>], v: &mut Verdict) {
    let mut all: Vec<(&LeaseLife, &Ordered<'_>)> = intents
        .iter()
        .flat_map(|o| o.leases.iter().map(move |l| (*l, o)))
        .collect();
    all.sort_by_key(|(l, _)| l.claimed_at);
    for (i, (a, of_a)) in all.iter().enumerate() {
        let a_end = lease_end(a, of_a);
        for (b, of_b) in &all[i + 1..] {
            if b.intent == a.intent {
                continue;
            }
            v.counts.key_lease_pairs += 1;
            // b minted after a for certain, and before a ended for certain.
            if a.claim_t <= b.claimed_at && b.claim_t + CLOCK_TOLERANCE_US < a_end {
                v.violate(
                    Guarantee::KeyOneAtATime,
                    Some(b.intent),
                    format!(
                        "key {key}: {} of {} minted (claim answered {}) while {} of {} was \
                         live (answered {}, live until at least {})",
                        b.describe(),
                        of_b.row.id,
                        clock(b.claim_t),
                        a.describe(),
                        of_a.row.id,
                        clock(a.claim_t),
                        clock(a_end),
                    ),
                );
            }
        }
    }
}
