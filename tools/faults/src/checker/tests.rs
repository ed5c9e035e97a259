//! The checks on hand-made journals: each fires on the violation it names, and only then.

use uuid::Uuid;

use super::*;
use crate::cluster::IntentRow;
use crate::faults::{FaultKind, FaultRecord};
use crate::journal::{FailKind, LeaseSeen, Outcome};

const SECOND: i64 = 1_000_000;
const LEASE_MS: i64 = 2000;

struct World {
    snapshot: Snapshot,
    observations: Observations,
    faults: Vec<FaultRecord>,
}

impl World {
    /// One committed order (id 1) with one intent, as the database has it at the end.
    fn committed(state: &str, lease: Option<Uuid>) -> (Self, Uuid) {
        let id = Uuid::now_v7();
        let mut snapshot = Snapshot::default();
        snapshot
            .intents
            .insert(id, row(id, state, Some("committed"), lease));
        snapshot.committed_orders.insert(1, vec![id]);
        let staged = Event::Staged {
            t: 0,
            order: 1,
            xid: "42".into(),
            intents: vec![id],
            tries: 1,
            deduplicated: 0,
        };
        let observations = Observations {
            producers: vec![(
                "p1.g1".into(),
                vec![staged, Event::Committed { t: 1, order: 1 }],
            )],
            workers: vec![],
        };
        let world = Self {
            snapshot,
            observations,
            faults: vec![],
        };
        (world, id)
    }

    fn worker(&mut self, name: &str, events: Vec<Event>) {
        self.observations.workers.push((name.into(), events));
    }

    fn check(&self) -> Verdict {
        check(&self.snapshot, &self.observations, &self.faults, &[])
    }
}

fn row(id: Uuid, state: &str, xact: Option<&str>, lease: Option<Uuid>) -> IntentRow {
    IntentRow {
        id,
        tenant_id: crate::cluster::TENANT.into(),
        kind: crate::IDEMPOTENT_KIND.into(),
        state: state.into(),
        attempts: 1,
        max_attempts: 8,
        xact: xact.map(str::to_owned),
        two_phase: xact.is_some(),
        txn_xid: xact.map(|_| "42".to_owned()),
        lease_id: lease,
        last_error: None,
        ordering_key: None,
        order_seq: None,
        created_us: 0,
        finished_us: None,
        commit_us: None,
    }
}

/// A claim at `at` (s) of `intent` with `attempt`, and the lease it returned.
fn claim(intent: Uuid, attempt: i32, at: i64, kind: &str) -> (Event, Uuid) {
    let lease = Uuid::new_v4();
    let event = Event::Claimed {
        t: at * SECOND,
        request: Some(Uuid::new_v4()),
        duration_ms: LEASE_MS,
        tries: 1,
        errors: vec![],
        last_try: at * SECOND,
        leases: vec![LeaseSeen {
            intent,
            lease,
            kind: kind.into(),
            attempt,
            expires: at * SECOND + LEASE_MS * 1000,
            state: "INTENT_STATE_LEASED".into(),
            handed_off: false,
        }],
    };
    (event, lease)
}

fn performed(intent: Uuid, lease: Uuid, at: i64) -> Event {
    Event::Performed {
        t: at * SECOND,
        intent,
        lease,
        attempt: 1,
    }
}

fn acked(intent: Uuid, lease: Uuid, at: i64, result: Outcome) -> Event {
    Event::Acked {
        t: at * SECOND,
        intent,
        lease,
        result,
        tries: 1,
        errors: vec![],
        via: None,
    }
}

/// A second worker leases `id` again at 13 s (attempt 2), performs and acks it: the
/// intent ends delivered under that lease.
fn delivered_again(world: &mut World, id: Uuid, kind: &str) {
    let (second, lease) = claim(id, 2, 13, kind);
    world.snapshot.intents.get_mut(&id).unwrap().lease_id = Some(lease);
    world.worker(
        "w2.g1",
        vec![
            second,
            performed(id, lease, 13),
            acked(id, lease, 13, Outcome::Ok),
        ],
    );
}

fn guarantees(v: &Verdict) -> Vec<Guarantee> {
    v.violations.iter().map(|x| x.guarantee).collect()
}

#[test]
fn a_clean_delivery_breaks_nothing() {
    let (mut world, id) = World::committed("delivered", None);
    let (event, lease) = claim(id, 1, 10, "fault.email");
    world.snapshot.intents.get_mut(&id).unwrap().lease_id = Some(lease);
    world.worker(
        "w1.g1",
        vec![
            event,
            performed(id, lease, 10),
            acked(id, lease, 10, Outcome::Ok),
        ],
    );
    let v = world.check();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!(v.duplicate_total(), 0);
}

#[test]
fn a_committed_intent_discarded_is_lost() {
    let (world, _) = World::committed("discarded", None);
    assert!(guarantees(&world.check()).contains(&Guarantee::NoneLost));
}

#[test]
fn a_committed_intent_missing_from_the_table_is_lost() {
    let (mut world, id) = World::committed("delivered", None);
    world.snapshot.intents.remove(&id);
    assert!(guarantees(&world.check()).contains(&Guarantee::NoneLost));
}

#[test]
fn an_aborted_intent_that_was_claimed_is_a_violation() {
    let (mut world, id) = World::committed("discarded", None);
    world.snapshot.committed_orders.clear();
    world.snapshot.intents.get_mut(&id).unwrap().xact = Some("aborted".into());
    let (event, _) = claim(id, 1, 10, "fault.email");
    world.worker("w1.g1", vec![event]);
    assert!(guarantees(&world.check()).contains(&Guarantee::AbortedNeverClaimed));
}

#[test]
fn a_lease_minted_while_another_is_live_is_a_violation() {
    let (mut world, id) = World::committed("delivered", None);
    let (first, _) = claim(id, 1, 10, "fault.email");
    // Minted 1 s into a 2 s lease that nobody failed.
    let (second, lease) = claim(id, 2, 11, "fault.email");
    world.snapshot.intents.get_mut(&id).unwrap().lease_id = Some(lease);
    world.worker("w1.g1", vec![first]);
    world.worker(
        "w2.g1",
        vec![
            second,
            performed(id, lease, 11),
            acked(id, lease, 11, Outcome::Ok),
        ],
    );
    assert!(guarantees(&world.check()).contains(&Guarantee::NoOverlappingLeases));
}

#[test]
fn a_lease_after_the_holders_fail_is_fine() {
    let (mut world, id) = World::committed("delivered", None);
    let (first, old) = claim(id, 1, 10, "fault.email");
    let fail_sent = Event::FailSent {
        t: 10 * SECOND + 100,
        intent: id,
        lease: old,
        outcome: FailKind::Retry,
    };
    let (second, lease) = claim(id, 2, 11, "fault.email");
    world.snapshot.intents.get_mut(&id).unwrap().lease_id = Some(lease);
    world.worker("w1.g1", vec![first, fail_sent]);
    world.worker(
        "w2.g1",
        vec![
            second,
            performed(id, lease, 11),
            acked(id, lease, 11, Outcome::Ok),
        ],
    );
    let v = world.check();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
}

#[test]
fn an_accepted_ack_of_a_stale_lease_is_a_violation() {
    let (mut world, id) = World::committed("delivered", None);
    let (first, stale) = claim(id, 1, 10, "fault.email");
    let (second, lease) = claim(id, 2, 13, "fault.email");
    world.snapshot.intents.get_mut(&id).unwrap().lease_id = Some(lease);
    // The first holder was stopped past its lease; its late Ack must be refused.
    world.worker(
        "w1.g1",
        vec![
            first,
            performed(id, stale, 10),
            acked(id, stale, 14, Outcome::Ok),
        ],
    );
    world.worker(
        "w2.g1",
        vec![
            second,
            performed(id, lease, 13),
            acked(id, lease, 13, Outcome::Ok),
        ],
    );
    let v = world.check();
    assert!(guarantees(&v).contains(&Guarantee::StaleSettleRejected));
    assert_eq!(
        v.duplicates.get("after an accepted Ack (violation)"),
        Some(&1)
    );
}

#[test]
fn a_submitted_intent_handed_out_again_is_a_violation() {
    let (mut world, id) = World::committed("delivered", None);
    let (first, marked) = claim(id, 1, 10, "fault.payment");
    let mark = Event::Marked {
        t: 10 * SECOND,
        intent: id,
        lease: marked,
        result: Outcome::Ok,
        tries: 1,
    };
    world.worker("w1.g1", vec![first, mark]);
    delivered_again(&mut world, id, "fault.payment");
    assert!(guarantees(&world.check()).contains(&Guarantee::SubmittedNotReHanded));
}

#[test]
fn a_duplicate_is_explained_by_a_kill_and_unexplained_without_one() {
    let (mut world, id) = World::committed("delivered", None);
    let (first, killed) = claim(id, 1, 10, "fault.email");
    world.worker("w1.g1", vec![first, performed(id, killed, 10)]);
    delivered_again(&mut world, id, "fault.email");
    assert!(guarantees(&world.check()).contains(&Guarantee::DuplicatesExplained));
    world.faults.push(FaultRecord {
        kind: FaultKind::WorkerKill,
        target: "w1.g1".into(),
        start: 10 * SECOND + 5,
        end: 10 * SECOND + 10,
        detail: String::new(),
    });
    let v = world.check();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!(v.duplicate_total(), 1);
}

#[test]
fn a_lease_found_lost_after_its_side_effect_is_explained_only_by_a_service_fault() {
    let (mut world, id) = World::committed("delivered", None);
    let (first, lost) = claim(id, 1, 10, "fault.email");
    let gave_up = Event::LeaseLost {
        t: 12 * SECOND,
        intent: id,
        lease: lost,
        why: "it expired before a heartbeat got through".into(),
    };
    world.worker("w1.g1", vec![first, performed(id, lost, 10), gave_up]);
    delivered_again(&mut world, id, "fault.email");
    let v = world.check();
    assert!(guarantees(&v).contains(&Guarantee::DuplicatesExplained));
    assert_eq!(v.counts.lost, 1);
    // A fault that ended before the claim explains nothing.
    let lost_responses = |start: i64| FaultRecord {
        kind: FaultKind::LostResponses,
        target: "r1".into(),
        start,
        end: start + SECOND,
        detail: String::new(),
    };
    world.faults.push(lost_responses(8 * SECOND));
    assert!(guarantees(&world.check()).contains(&Guarantee::DuplicatesExplained));
    world.faults.push(lost_responses(11 * SECOND));
    let v = world.check();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    assert_eq!(v.duplicate_total(), 1);
}

#[test]
fn a_retried_ack_refused_though_its_lease_delivered_the_intent_is_a_violation() {
    let (mut world, id) = World::committed("delivered", None);
    let (event, lease) = claim(id, 1, 10, "fault.email");
    world.snapshot.intents.get_mut(&id).unwrap().lease_id = Some(lease);
    world.worker(
        "w1.g1",
        vec![
            event,
            performed(id, lease, 10),
            acked(id, lease, 11, Outcome::LeaseLost),
        ],
    );
    assert_eq!(
        guarantees(&world.check()),
        vec![Guarantee::HolderAckRefused]
    );
}

#[test]
fn delivered_without_a_side_effect_is_inconsistent() {
    let (world, _) = World::committed("delivered", None);
    assert!(guarantees(&world.check()).contains(&Guarantee::Consistency));
}

/// Two two-phase orders on one ordering key: `a` committed within `a_commit`, `b` within
/// `b_commit` (ms), both delivered at the end (their finish times set by `deliver`).
struct KeyWorld {
    world: World,
    a: Uuid,
    b: Uuid,
}

const MS: i64 = 1_000;

impl KeyWorld {
    fn new(a_commit: (i64, i64), b_commit: (i64, i64)) -> Self {
        let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
        let mut snapshot = Snapshot::default();
        let mut producer = Vec::new();
        for (order, id, (sent, done)) in [(1, a, a_commit), (2, b, b_commit)] {
            let mut r = row(id, "delivered", Some("committed"), None);
            r.ordering_key = Some("key-01".into());
            r.txn_xid = Some(format!("{}", 40 + order));
            r.order_seq = Some(order);
            snapshot.intents.insert(id, r);
            snapshot.committed_orders.insert(order, vec![id]);
            producer.push(Event::Staged {
                t: (sent - 5) * MS,
                order,
                xid: format!("{}", 40 + order),
                intents: vec![id],
                tries: 1,
                deduplicated: 0,
            });
            producer.push(Event::CommitSent {
                t: sent * MS,
                order,
            });
            producer.push(Event::Committed {
                t: done * MS,
                order,
            });
        }
        let observations = Observations {
            producers: vec![("p1.g1".into(), producer)],
            workers: vec![],
        };
        let world = World {
            snapshot,
            observations,
            faults: vec![],
        };
        Self { world, a, b }
    }

    /// `id` leased at `at` ms by `worker`; acked (and delivered) at `ack` ms if given.
    fn lease(&mut self, worker: &str, id: Uuid, attempt: i32, at: i64, ack: Option<i64>) {
        let lease = Uuid::new_v4();
        let mut events = vec![Event::Claimed {
            t: at * MS,
            request: Some(Uuid::new_v4()),
            duration_ms: LEASE_MS,
            tries: 1,
            errors: vec![],
            last_try: at * MS,
            leases: vec![LeaseSeen {
                intent: id,
                lease,
                kind: crate::IDEMPOTENT_KIND.into(),
                attempt,
                expires: at * MS + LEASE_MS * 1000,
                state: "INTENT_STATE_LEASED".into(),
                handed_off: false,
            }],
        }];
        if let Some(ack) = ack {
            events.push(Event::Performed {
                t: (ack - 1) * MS,
                intent: id,
                lease,
                attempt,
            });
            events.push(Event::AckSent {
                t: ack * MS,
                intent: id,
                lease,
            });
            events.push(Event::Acked {
                t: (ack + 2) * MS,
                intent: id,
                lease,
                result: Outcome::Ok,
                tries: 1,
                errors: vec![],
                via: None,
            });
            let r = self.world.snapshot.intents.get_mut(&id).unwrap();
            r.lease_id = Some(lease);
            r.finished_us = Some((ack + 1) * MS);
        }
        self.world.worker(worker, events);
    }
}

#[test]
fn ordered_intents_delivered_one_after_another_in_commit_order_break_nothing() {
    let mut k = KeyWorld::new((1000, 1010), (2000, 2010));
    let (a, b) = (k.a, k.b);
    k.lease("w1.g1", a, 1, 3000, Some(3100));
    k.lease("w2.g1", b, 1, 3200, Some(3300));
    let v = k.world.check();
    assert_eq!(guarantees(&v), vec![], "{:?}", v.violations);
    assert_eq!(v.counts.order_pairs, 1);
    assert_eq!(v.counts.ordering_keys, 1);
}

#[test]
fn an_ordered_intent_leased_before_an_earlier_commit_was_acked_is_a_violation() {
    let mut k = KeyWorld::new((1000, 1010), (2000, 2010));
    let (a, b) = (k.a, k.b);
    k.lease("w1.g1", a, 1, 3000, Some(3500));
    k.lease("w2.g1", b, 1, 3200, Some(3300));
    let found = guarantees(&k.world.check());
    assert!(found.contains(&Guarantee::KeyOrder), "{found:?}");
    assert!(found.contains(&Guarantee::KeyOneAtATime), "{found:?}");
}

#[test]
fn a_later_intent_delivered_first_is_a_violation_when_the_commits_did_not_overlap() {
    let mut k = KeyWorld::new((1000, 1010), (2000, 2010));
    let (a, b) = (k.a, k.b);
    k.lease("w2.g1", b, 1, 3000, Some(3100));
    k.lease("w1.g1", a, 1, 3200, Some(3300));
    let found = guarantees(&k.world.check());
    assert_eq!(found, vec![Guarantee::KeyOrder]);
}

#[test]
fn commits_that_overlapped_may_be_delivered_in_either_order() {
    let mut k = KeyWorld::new((1000, 2000), (1500, 2500));
    let (a, b) = (k.a, k.b);
    k.lease("w2.g1", b, 1, 3000, Some(3100));
    k.lease("w1.g1", a, 1, 3200, Some(3300));
    let v = k.world.check();
    assert_eq!(guarantees(&v), vec![], "{:?}", v.violations);
    assert_eq!(v.counts.order_pairs, 0);
}

#[test]
fn concurrent_leases_of_one_key_are_a_violation_even_when_the_commit_order_is_unknown() {
    let mut k = KeyWorld::new((1000, 2000), (1500, 2500));
    let (a, b) = (k.a, k.b);
    k.lease("w1.g1", a, 1, 3000, Some(3500));
    k.lease("w2.g1", b, 1, 3200, Some(3300));
    assert_eq!(guarantees(&k.world.check()), vec![Guarantee::KeyOneAtATime]);
}

#[test]
fn a_head_redelivered_after_its_lease_expired_is_at_least_once_not_a_violation() {
    let mut k = KeyWorld::new((1000, 1010), (2000, 2010));
    let (a, b) = (k.a, k.b);
    // The first lease's answer was lost with its worker: it expires at 5000.
    k.lease("w1.g1", a, 1, 3000, None);
    k.lease("w2.g1", a, 2, 5300, Some(5400));
    k.lease("w2.g1", b, 1, 5500, Some(5600));
    let v = k.world.check();
    assert_eq!(guarantees(&v), vec![], "{:?}", v.violations);
}

#[test]
fn a_later_intent_leased_behind_a_dead_letter_no_operator_released_is_a_violation() {
    let mut k = KeyWorld::new((1000, 1010), (2000, 2010));
    let (a, b) = (k.a, k.b);
    k.lease("w1.g1", a, 1, 3000, None);
    let r = k.world.snapshot.intents.get_mut(&a).unwrap();
    r.state = "dead_lettered".into();
    r.attempts = r.max_attempts;
    k.lease("w2.g1", b, 1, 5500, Some(5600));
    let found = guarantees(&k.world.check());
    assert_eq!(found, vec![Guarantee::KeyOrder]);
    // Released by an operator's DEAD before b was leased: fine.
    k.world.snapshot.intents.get_mut(&a).unwrap().finished_us = Some(5200 * MS);
    let v = k.world.check();
    assert_eq!(guarantees(&v), vec![], "{:?}", v.violations);
}

#[test]
fn intents_of_one_enqueue_go_in_request_order() {
    let mut k = KeyWorld::new((1000, 1010), (1000, 1010));
    let (a, b) = (k.a, k.b);
    // One order, [b, a]: b first.
    k.world.observations.producers[0].1 = vec![
        Event::Staged {
            t: 990 * MS,
            order: 1,
            xid: "41".into(),
            intents: vec![b, a],
            tries: 1,
            deduplicated: 0,
        },
        Event::CommitSent {
            t: 1000 * MS,
            order: 1,
        },
        Event::Committed {
            t: 1010 * MS,
            order: 1,
        },
    ];
    k.world.snapshot.committed_orders.clear();
    k.world.snapshot.committed_orders.insert(1, vec![b, a]);
    k.lease("w1.g1", a, 1, 3000, Some(3100));
    k.lease("w2.g1", b, 1, 3200, Some(3300));
    let found = guarantees(&k.world.check());
    assert_eq!(found, vec![Guarantee::KeyOrder]);
}

// Queue limits, from the database's flow log (`limits.rs`).

const PAY: &str = crate::PAYMENT_KIND;
const MAIL: &str = crate::IDEMPOTENT_KIND;

/// A run's limits (max 3 payments in flight; mail at 40/s, burst 20) and a log written
/// by `log`.
struct FlowWorld {
    snapshot: Snapshot,
    observations: Observations,
    seq: i64,
}

impl FlowWorld {
    fn new() -> Self {
        let snapshot = Snapshot {
            flow: Some(crate::cluster::FlowLog {
                limits: crate::cluster::QueueLimits {
                    concurrency_kind: PAY,
                    max_in_flight: 3,
                    rate_kind: MAIL,
                    rate_per_second: 40.0,
                    burst: 20,
                },
                changes: vec![],
            }),
            ..Snapshot::default()
        };
        Self {
            snapshot,
            observations: Observations::default(),
            seq: 0,
        }
    }

    /// A move of `kind` by `delta` at `at_ms`, in transaction `txid` begun at `txn_ms`;
    /// with a new lease for +1. Returns the lease.
    fn log(&mut self, kind: &str, at_ms: i64, txn_ms: i64, txid: i64, delta: i32) -> Uuid {
        self.seq += 1;
        let lease = Uuid::new_v4();
        let flow = self.snapshot.flow.as_mut().unwrap();
        flow.changes.push(crate::cluster::FlowChange {
            seq: self.seq,
            intent_id: Uuid::now_v7(),
            kind: kind.into(),
            at_us: at_ms * MS,
            txn_us: txn_ms * MS,
            txid,
            delta,
            minted: delta > 0,
            lease_id: (delta > 0).then_some(lease),
        });
        lease
    }

    /// `n` mail leases by one claim begun at `at_ms`.
    fn mail(&mut self, at_ms: i64, n: usize) {
        for _ in 0..n {
            self.log(MAIL, at_ms, at_ms, at_ms, 1);
        }
    }

    fn check(&self) -> Verdict {
        check(&self.snapshot, &self.observations, &[], &[])
    }
}

/// Payments: 3 leased, one acked, another leased (never more than 3); mail: the burst at
/// 0, then one every 25 ms (40/s) for 2 s.
fn within_limits() -> FlowWorld {
    let mut w = FlowWorld::new();
    for i in 0..3 {
        w.log(PAY, 10 + i, 10, 1, 1);
    }
    w.log(PAY, 20, 20, 2, -1);
    w.log(PAY, 30, 30, 3, 1);
    for i in 0..3 {
        w.log(PAY, 40 + i, 40 + i, 4 + i, -1);
    }
    w.mail(0, 20);
    for k in 1..=80 {
        w.mail(k * 25, 1);
    }
    w
}

#[test]
fn a_run_within_its_queue_limits_breaks_nothing() {
    let w = within_limits();
    let v = w.check();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    let in_flight = v.counts.in_flight.unwrap();
    assert_eq!(
        (in_flight.most, in_flight.limit, in_flight.moves),
        (3, 3, 8)
    );
    let rate = v.counts.rate.unwrap();
    assert_eq!(rate.leases, 100);
    // 20 at 0 and 40 in (0, 1 s]: exactly the bound.
    assert_eq!(rate.most_in_second, 60);
    assert_eq!(rate.bound(1_000_000), 60.0);
    assert!(rate.worst_excess <= 1e-9, "{}", rate.worst_excess);
}

#[test]
fn a_fourth_intent_in_flight_is_a_violation_once_per_excursion() {
    let mut w = within_limits();
    // A replica killed after its claim committed has spent its allowance: a claim that
    // leased a 4th anyway breaks the limit, twice here.
    w.log(PAY, 50, 50, 9, 1);
    w.log(PAY, 51, 51, 9, 1);
    w.log(PAY, 52, 52, 9, 1);
    w.log(PAY, 53, 53, 10, 1);
    w.log(PAY, 54, 54, 11, 1);
    w.log(PAY, 60, 60, 12, -1);
    w.log(PAY, 61, 61, 13, -1);
    w.log(PAY, 62, 62, 14, 1);
    let v = w.check();
    assert_eq!(
        guarantees(&v),
        vec![Guarantee::ConcurrencyLimit, Guarantee::ConcurrencyLimit]
    );
    assert_eq!(v.counts.in_flight.unwrap().most, 5);
}

#[test]
fn leases_past_the_bucket_are_a_violation() {
    let mut w = within_limits();
    // Tokens given back by a crashed claim: a second burst of 20 right after the log ends.
    w.mail(2_010, 20);
    let v = w.check();
    assert!(!v.violations.is_empty());
    assert!(
        guarantees(&v).iter().all(|g| *g == Guarantee::RateLimit),
        "{:?}",
        v.violations
    );
    assert!(v.counts.rate.unwrap().worst_excess >= 19.0);
}

#[test]
fn a_claim_that_started_before_the_last_one_is_within_the_tolerance() {
    let mut w = within_limits();
    // Begun 5 ms before the claim at 2000 ms, it locked the bucket after it: its token was
    // counted as of 2000 ms, so timed by its own start its lease looks 5 ms early.
    w.mail(1_995, 1);
    w.mail(2_025, 1);
    let v = w.check();
    assert!(v.violations.is_empty(), "{:?}", v.violations);
    let rate = v.counts.rate.unwrap();
    assert_eq!(rate.lag_us, 5_000);
    assert!(rate.worst_excess > 0.0 && rate.worst_excess <= rate.tolerance);
}

#[test]
fn a_journaled_lease_missing_from_the_flow_log_is_inconsistent() {
    let mut w = within_limits();
    let (event, _) = claim(Uuid::now_v7(), 1, 1, MAIL);
    w.observations.workers.push(("w1.g1".into(), vec![event]));
    let v = w.check();
    let missing: Vec<_> = v
        .violations
        .iter()
        .filter(|x| x.detail.contains("not in the database's flow log"))
        .collect();
    assert_eq!(missing.len(), 1, "{:?}", v.violations);
    assert_eq!(missing[0].guarantee, Guarantee::Consistency);
}

#[test]
fn a_flow_log_without_leases_of_a_limited_kind_proves_nothing() {
    let mut w = FlowWorld::new();
    w.mail(0, 1);
    let v = w.check();
    assert_eq!(guarantees(&v), vec![Guarantee::Consistency]);
    assert!(v.violations[0].detail.contains(PAY));
}

#[test]
fn windows_are_measured_from_each_distinct_lease_time() {
    // Rate 1/s, burst 2: from 0, five in 1.5 s are 1.5 over 2 + 1.5; from 1 s on, two in
    // 0.5 s are within.
    let times = [0, 0, 0, SECOND, SECOND + SECOND / 2];
    let windows = limits::over_bound(&times, 1.0, 2);
    assert_eq!(windows.len(), 3);
    assert_eq!((windows[0].start, windows[0].count), (0, 5));
    assert!((windows[0].excess - 1.5).abs() < 1e-9, "{:?}", windows[0]);
    assert!(windows[1].excess <= 0.0 && windows[2].excess <= 0.0);
    assert_eq!(limits::most_within(&times, SECOND), 4);
}

// Tenant fairness, from the database's flow log (`fairness.rs`).

/// A backlog of `backlog` intents of the other tenant first leased one every 200 ms from
/// 0, and 50 intents of the run's tenant claimable every 400 ms from 0, each leased 30 ms
/// later.
fn beside_a_backlog(backlog: i64) -> FlowWorld {
    let mut w = FlowWorld::new();
    for i in 0..backlog {
        fairness_intent(
            &mut w,
            crate::cluster::BACKLOG_TENANT,
            -SECOND,
            Some(i * 200),
        );
    }
    for i in 0..50 {
        fairness_intent(
            &mut w,
            crate::cluster::TENANT,
            i * 400 * MS,
            Some(i * 400 + 30),
        );
    }
    w
}

/// [`beside_a_backlog`] of 100: it lasts 19.8 s.
fn fair_run() -> FlowWorld {
    beside_a_backlog(100)
}

/// An unlimited-kind intent of `tenant`, directly enqueued at `created_us` and first
/// leased at `leased_ms` (logged by the database), or never.
fn fairness_intent(
    w: &mut FlowWorld,
    tenant: &str,
    created_us: i64,
    leased_ms: Option<i64>,
) -> Uuid {
    let id = Uuid::now_v7();
    let mut intent = row(id, "delivered", None, None);
    intent.tenant_id = tenant.into();
    intent.kind = crate::NOTICE_KIND.into();
    intent.created_us = created_us;
    w.snapshot.intents.insert(id, intent);
    if let Some(at) = leased_ms {
        w.seq += 1;
        let flow = w.snapshot.flow.as_mut().unwrap();
        flow.changes.push(crate::cluster::FlowChange {
            seq: w.seq,
            intent_id: id,
            kind: crate::NOTICE_KIND.into(),
            at_us: at * MS,
            txn_us: at * MS,
            txid: w.seq,
            delta: 0,
            minted: true,
            lease_id: Some(Uuid::new_v4()),
        });
    }
    id
}

fn fairness_only(v: &Verdict) -> Vec<&Violation> {
    v.violations
        .iter()
        .filter(|x| x.guarantee == Guarantee::TenantFairness)
        .collect()
}

#[test]
fn intents_leased_while_another_tenants_backlog_lasts_are_fair() {
    let w = fair_run();
    let v = w.check();
    assert!(fairness_only(&v).is_empty(), "{:?}", v.violations);
    let f = v.counts.fairness.unwrap();
    // Claimable at 0, 0.4 … 9.6 s: more than 10 s before the backlog's end at 19.8 s.
    assert_eq!((f.backlog, f.checked), (100, 25));
    assert_eq!((f.p50_us, f.max_us), (30 * MS, 30 * MS));
    assert_eq!(f.backlog_span_us, 19_800 * MS);
}

#[test]
fn an_intent_served_after_the_whole_backlog_is_unfair() {
    let mut w = fair_run();
    let late = fairness_intent(&mut w, crate::cluster::TENANT, 4 * SECOND, Some(20_000));
    let never = fairness_intent(&mut w, crate::cluster::TENANT, 6 * SECOND, None);
    // Claimable 7.8 s before the end and leased after it: within the slack, not checked.
    fairness_intent(&mut w, crate::cluster::TENANT, 12 * SECOND, Some(20_000));
    let v = w.check();
    let mut flagged: Vec<_> = fairness_only(&v).iter().map(|x| x.intent).collect();
    flagged.sort();
    let mut expected = vec![Some(late), Some(never)];
    expected.sort();
    assert_eq!(flagged, expected, "{:?}", v.violations);
}

#[test]
fn time_postgresql_was_down_does_not_count_towards_the_slack() {
    let mut w = fair_run();
    // Claimable 10.2 s before the end, PostgreSQL down for 0.5 s of them, leased after the
    // end: 9.7 s of service, not checked.
    fairness_intent(&mut w, crate::cluster::TENANT, 9_600 * MS, Some(20_000));
    let crash = FaultRecord {
        kind: FaultKind::PostgresCrash,
        target: "postgres".into(),
        start: 15 * SECOND,
        end: 15_500 * MS,
        detail: String::new(),
    };
    let v = check(&w.snapshot, &w.observations, &[crash], &[]);
    assert!(fairness_only(&v).is_empty(), "{:?}", v.violations);
    assert!(!fairness_only(&w.check()).is_empty());
}

#[test]
fn a_backlog_too_short_to_show_fairness_fails_the_check() {
    // It lasts 1.8 s: nothing of the run's tenant is claimable 10 s before its end.
    let v = beside_a_backlog(10).check();
    assert!(fairness_only(&v).is_empty(), "{:?}", v.violations);
    let too_few: Vec<_> = v
        .violations
        .iter()
        .filter(|x| x.detail.contains("too few to show fairness"))
        .collect();
    assert_eq!(too_few.len(), 1, "{:?}", v.violations);
    assert_eq!(too_few[0].guarantee, Guarantee::Consistency);
}
