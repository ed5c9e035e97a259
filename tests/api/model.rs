//! A model-based test of the intent lifecycle: proptest-state-machine generates sequences
//! of Enqueue (with and without idempotency keys), Claim (two workers, and repeats of a
//! request id whose response was lost), MarkSubmitted, Ack, Fail, ExtendLease (with live
//! and stale leases), clock moves, lease rescue and operator decisions from a reference
//! model of the documented rules (README "Workers", "Guarantees", "Decisions where the
//! design is silent"; DESIGN.md "Lifecycle of an intent"), drives them against a real
//! server over gRPC, and after every step compares the server's answers, item by item,
//! and every stored intent (read as superuser) with the model, and checks the guarantees
//! on the stored rows: one live lease per intent, and a SUBMITTED intent stays with its
//! lease until its holder's outcome or an operator's decision.
//!
//! Some Enqueues carry an ordering key (docs/ordering.md), alone or with a second intent of
//! the same key in the same request. The model keeps each key's queue in enqueue order
//! (commit order: the model's Enqueues are direct and one at a time): only the key's head
//! is PENDING, LEASED, SUBMITTED, NEEDS_RECONCILE or DEAD_LETTERED, the others WAITING; an
//! Ack or an operator's DELIVERED or DEAD moves the key on, REQUEUE puts an intent back in
//! its place. On the stored rows it checks, per key: one head at most, a key with WAITING
//! intents has one, and no head has an earlier intent of its key that is neither delivered
//! nor given up by an operator.
//!
//! The model keeps a virtual clock. Retry and rescue backoff is jittered (50–100% of the
//! delay), so the model keeps the interval an intent's `available_at` falls in and only
//! generates a Claim whose outcome that interval decides: no PENDING intent may be "maybe
//! due", and the intents taken must all come before those left (by `available_at`, then
//! id) whatever the jitter was.

use std::time::Duration;

use chrono::{DateTime, Utc};
use outboxd::proto::v1::{self, Decision, FailOutcome, IntentState as St};
use proptest::prelude::*;
use proptest::strategy::Union;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use tonic::Code;

use crate::helpers::{TestApp, claim_request, id_of, intent};

/// The server's default lease (`OUTBOX_LEASE__DEFAULT`), in ms.
const LEASE_MS: i64 = 30_000;
/// Retry backoff (`OUTBOX_RETRY__BASE`, `OUTBOX_RETRY__CAP`), in ms.
const BACKOFF_BASE_MS: i64 = 1_000;
const BACKOFF_CAP_MS: i64 = 300_000;

#[derive(Clone, Debug)]
struct Intent {
    state: St,
    attempts: i32,
    max_attempts: i32,
    key: Option<u8>,
    payload: u8,
    /// The lease recorded in `lease_id` (a handle into `Model::leases`), if any.
    lease: Option<usize>,
    /// `available_at` lies in `[.0, .1]` (ms on the virtual clock).
    available: (i64, i64),
    lease_expires_at: Option<i64>,
    /// The worker holding or last holding it.
    worker: Option<u8>,
    /// `claim_request_id` with its worker: (worker, request number).
    claim_request: Option<(u8, u32)>,
    /// Ghost: the lease that marked it SUBMITTED, until that lease's holder reports a
    /// definite outcome or an operator decides. Meanwhile no other worker may get it.
    submitted_by: Option<usize>,
    /// Its ordering key (`ordering_name`), if any.
    ordering: Option<u8>,
    /// DEAD_LETTERED and given up by an operator's DEAD: it no longer holds its key
    /// (`finished_at` is set), and no later decision applies to it.
    released: bool,
}

impl Intent {
    /// Its key's head: the one intent of its key that may be anything but WAITING or
    /// finished (`outbox.advance_keys`' test).
    fn holds_key(&self) -> bool {
        self.ordering.is_some()
            && (matches!(
                self.state,
                St::Pending | St::Leased | St::Submitted | St::NeedsReconcile
            ) || (self.state == St::DeadLettered && !self.released))
    }
}

/// The wire name of ordering key `k`.
fn ordering_name(k: u8) -> String {
    format!("order-{k}")
}

#[derive(Clone, Debug)]
struct Lease {
    intent: usize,
}

/// What the server must answer for one item.
#[derive(Clone, Debug, PartialEq)]
struct Answer {
    error: Option<(Code, &'static str)>,
    /// The intent's state after the call (UNSPECIFIED when not found).
    state: St,
    /// ExtendLease only: the new expiry.
    lease_expires_at: Option<i64>,
}

impl Answer {
    fn ok(state: St) -> Self {
        Self {
            error: None,
            state,
            lease_expires_at: None,
        }
    }

    fn lease_lost(state: St) -> Self {
        Self {
            error: Some((Code::FailedPrecondition, "LEASE_LOST")),
            state,
            lease_expires_at: None,
        }
    }
}

/// The answer the model expects for the last transition.
#[derive(Clone, Debug)]
enum Expect {
    Nothing,
    /// One per intent of the request: (intent, deduplicated, state answered).
    Enqueued(Vec<(usize, bool, St)>),
    IdempotencyConflict,
    /// (intent, lease handle) for each intent leased: new handles, or those the first
    /// attempt of a repeated request took.
    Claimed(Vec<(usize, usize)>),
    Item(Answer),
    Rescued {
        requeued: u64,
        dead_lettered: u64,
        needs_reconcile: u64,
    },
}

#[derive(Clone, Debug)]
struct Model {
    /// Virtual time since the start of the case, in ms.
    now: i64,
    /// In enqueue order, which is id order (UUIDv7).
    intents: Vec<Intent>,
    /// Every lease ever handed out, stale ones included.
    leases: Vec<Lease>,
    /// Each worker's last Claim request id (a number), which a repeated Claim sends again.
    last_request: [Option<u32>; 2],
    /// Request ids handed out so far.
    requests: u32,
    expect: Expect,
}

#[derive(Clone, Copy, Debug)]
enum Transition {
    /// `key`: the idempotency key; `ordering`: the ordering key; `and_next`: a second
    /// intent of the same ordering key (no idempotency key) follows in the same request.
    Enqueue {
        key: Option<u8>,
        payload: u8,
        max_attempts: i32,
        ordering: Option<u8>,
        and_next: bool,
    },
    /// `repeat`: the worker lost the response and sends its last request id again.
    Claim {
        worker: u8,
        n: i32,
        repeat: bool,
    },
    MarkSubmitted(usize),
    Ack(usize),
    Fail(usize, FailOutcome),
    ExtendLease(usize, i64),
    AdvanceClock(i64),
    Rescue,
    /// An intent by enqueue order (`usize::MAX`: an id that does not exist).
    Reconcile(usize, Decision),
}

fn backoff_ms(attempts: i32) -> i64 {
    let doublings = (attempts - 1).clamp(0, 40) as u32;
    BACKOFF_CAP_MS.min(BACKOFF_BASE_MS.saturating_mul(1i64 << doublings.min(30)))
}

impl Model {
    /// The jittered backoff window after `attempts` claims.
    fn backoff_window(&self, attempts: i32) -> (i64, i64) {
        let delay = backoff_ms(attempts);
        (self.now + delay / 2, self.now + delay)
    }

    /// PENDING intents whose jitter window straddles now: a Claim may or may not see them.
    fn maybe_due(&self) -> bool {
        self.intents.iter().any(|i| {
            i.state == St::Pending && i.available.0 <= self.now && self.now < i.available.1
        })
    }

    /// The intents a Claim of `n` takes, in the server's order, or `None` when the jitter
    /// decides which.
    fn claim_pick(&self, n: i32) -> Option<Vec<usize>> {
        if self.maybe_due() {
            return None;
        }
        let mut due: Vec<usize> = (0..self.intents.len())
            .filter(|&s| {
                let i = &self.intents[s];
                i.state == St::Pending && i.available.1 <= self.now
            })
            .collect();
        due.sort_by_key(|&s| (self.intents[s].available.0, s));
        let n = n.max(0) as usize;
        if due.len() > n {
            // Every intent taken must come before every one left, whatever the jitter.
            let before = |a: usize, b: usize| {
                let (x, y) = (&self.intents[a].available, &self.intents[b].available);
                x.1 < y.0 || (x.1 <= y.0 && a < b)
            };
            let (taken, left) = due.split_at(n);
            if !taken.iter().all(|&a| left.iter().all(|&b| before(a, b))) {
                return None;
            }
            due.truncate(n);
        }
        Some(due)
    }

    /// The live leases a repeated Claim returns: those its first attempt took that are
    /// still LEASED or SUBMITTED (Ack, Fail and rescue forget the request id) and not past
    /// their expiry (the rescue, which takes leases that expired before now, may not
    /// have come yet).
    fn earlier_leases(&self, worker: u8) -> Vec<usize> {
        let Some(request) = self.last_request[worker as usize] else {
            return Vec::new();
        };
        (0..self.intents.len())
            .filter(|&s| {
                let i = &self.intents[s];
                i.claim_request == Some((worker, request))
                    && matches!(i.state, St::Leased | St::Submitted)
                    && i.lease_expires_at.is_some_and(|t| t >= self.now)
            })
            .collect()
    }

    /// A Claim size that the jitter cannot make ambiguous: `n`, or all that are due.
    fn decided_claim_size(&self, n: i32) -> i32 {
        if self.claim_pick(n).is_some() {
            n
        } else {
            self.intents.len().max(1) as i32
        }
    }

    /// The lease `handle` is the one the intent records.
    fn current(&self, handle: usize) -> (usize, bool) {
        let seq = self.leases[handle].intent;
        (seq, self.intents[seq].lease == Some(handle))
    }

    /// The head of ordering key `k`, if it has one.
    fn head(&self, k: u8) -> Option<usize> {
        self.intents
            .iter()
            .position(|i| i.ordering == Some(k) && i.holds_key())
    }

    /// `outbox.advance_keys` for one key: if it has no head, its first WAITING intent in
    /// commit order (enqueue order here) becomes PENDING, claimable from now on.
    fn advance(&mut self, k: Option<u8>) {
        let Some(k) = k else { return };
        if self.head(k).is_some() {
            return;
        }
        let Some(seq) = self
            .intents
            .iter()
            .position(|i| i.ordering == Some(k) && i.state == St::Waiting)
        else {
            return;
        };
        let now = self.now;
        let intent = &mut self.intents[seq];
        intent.state = St::Pending;
        intent.available = (intent.available.0.max(now), intent.available.1.max(now));
    }

    /// A new intent: PENDING, or for an ordered one WAITING until its key is advanced.
    fn push(&mut self, key: Option<u8>, payload: u8, max_attempts: i32, ordering: Option<u8>) {
        self.intents.push(Intent {
            state: if ordering.is_some() {
                St::Waiting
            } else {
                St::Pending
            },
            attempts: 0,
            max_attempts,
            key,
            payload,
            lease: None,
            available: (self.now, self.now),
            lease_expires_at: None,
            worker: None,
            claim_request: None,
            submitted_by: None,
            ordering,
            released: false,
        });
    }

    /// A direct Enqueue: one transaction, deduplicated by idempotency key (kind, payload
    /// and region decide whether it is the same intent; the ordering key does not), the
    /// request's ordered intents queued in request order behind their keys' heads.
    fn enqueue(
        &mut self,
        key: Option<u8>,
        payload: u8,
        max_attempts: i32,
        ordering: Option<u8>,
        and_next: bool,
    ) -> Expect {
        let holder = key.and_then(|k| self.intents.iter().position(|i| i.key == Some(k)));
        let mut items = Vec::new();
        match holder {
            Some(seq) if self.intents[seq].payload == payload => {
                items.push((seq, true, self.intents[seq].state));
            }
            // The whole request is refused: nothing written.
            Some(_) => return Expect::IdempotencyConflict,
            None => {
                self.push(key, payload, max_attempts, ordering);
                items.push((self.intents.len() - 1, false, St::Unspecified));
            }
        }
        if and_next {
            self.push(None, payload, max_attempts, ordering);
            items.push((self.intents.len() - 1, false, St::Unspecified));
        }
        self.advance(ordering);
        for (seq, deduplicated, state) in &mut items {
            if !*deduplicated {
                *state = self.intents[*seq].state;
            }
        }
        Expect::Enqueued(items)
    }

    fn mark_submitted(&mut self, handle: usize) -> Answer {
        let (seq, current) = self.current(handle);
        let intent = &mut self.intents[seq];
        match intent.state {
            St::Leased if current => {
                intent.state = St::Submitted;
                intent.submitted_by = Some(handle);
                Answer::ok(St::Submitted)
            }
            // A repeat whose response was lost.
            St::Submitted if current => Answer::ok(St::Submitted),
            state => Answer::lease_lost(state),
        }
    }

    fn extend(&mut self, handle: usize, secs: i64) -> Answer {
        let (seq, current) = self.current(handle);
        let now = self.now;
        let intent = &mut self.intents[seq];
        if current && matches!(intent.state, St::Leased | St::Submitted) {
            // Never earlier than the lease already runs (a stale extension moves nothing).
            let expiry = intent
                .lease_expires_at
                .map_or(now + secs * 1000, |at| at.max(now + secs * 1000));
            intent.lease_expires_at = Some(expiry);
            Answer {
                lease_expires_at: Some(expiry),
                ..Answer::ok(intent.state)
            }
        } else {
            Answer::lease_lost(intent.state)
        }
    }

    fn ack(&mut self, handle: usize) -> Answer {
        let (seq, current) = self.current(handle);
        let intent = &mut self.intents[seq];
        match intent.state {
            // The live lease, even expired (not rescued yet), or the last holder of an
            // intent awaiting an operator.
            St::Leased | St::Submitted | St::NeedsReconcile if current => {
                intent.state = St::Delivered;
                intent.lease_expires_at = None;
                intent.claim_request = None;
                intent.submitted_by = None;
                // The next intent of its key takes its place, in the Ack's transaction.
                let ordering = intent.ordering;
                self.advance(ordering);
                Answer::ok(St::Delivered)
            }
            St::Delivered if current => Answer::ok(St::Delivered),
            state => Answer::lease_lost(state),
        }
    }

    fn fail(&mut self, handle: usize, outcome: FailOutcome) -> Answer {
        let (seq, current) = self.current(handle);
        let window = self.backoff_window(self.intents[seq].attempts);
        let intent = &mut self.intents[seq];
        let applies = current
            && (matches!(intent.state, St::Leased | St::Submitted)
                || (intent.state == St::NeedsReconcile && outcome != FailOutcome::Unknown));
        if applies {
            intent.lease_expires_at = None;
            intent.claim_request = None;
            if outcome != FailOutcome::Unknown {
                intent.submitted_by = None;
            }
            intent.state = match outcome {
                FailOutcome::Unknown => St::NeedsReconcile,
                FailOutcome::Permanent => St::DeadLettered,
                _ if intent.attempts >= intent.max_attempts => St::DeadLettered,
                _ => {
                    intent.available = window;
                    St::Pending
                }
            };
            return Answer::ok(intent.state);
        }
        let put_there = match outcome {
            FailOutcome::Unknown => intent.state == St::NeedsReconcile,
            FailOutcome::Permanent => intent.state == St::DeadLettered,
            // A RETRY dead-letters only an intent whose attempts are used up.
            _ => {
                intent.state == St::Pending
                    || (intent.state == St::DeadLettered && intent.attempts >= intent.max_attempts)
            }
        };
        if current && put_there {
            Answer::ok(intent.state)
        } else {
            Answer::lease_lost(intent.state)
        }
    }

    fn rescue(&mut self) -> Expect {
        let (mut requeued, mut dead_lettered, mut needs_reconcile) = (0, 0, 0);
        let now = self.now;
        for seq in 0..self.intents.len() {
            let window = self.backoff_window(self.intents[seq].attempts);
            let intent = &mut self.intents[seq];
            let expired = intent.lease_expires_at.is_some_and(|t| t < now);
            if !expired || !matches!(intent.state, St::Leased | St::Submitted) {
                continue;
            }
            intent.lease_expires_at = None;
            intent.claim_request = None;
            if intent.state == St::Submitted {
                // Nobody knows whether the side effect happened; the holder may still
                // report it, so its lease stays recorded.
                intent.state = St::NeedsReconcile;
                needs_reconcile += 1;
                continue;
            }
            intent.lease = None;
            if intent.attempts >= intent.max_attempts {
                intent.state = St::DeadLettered;
                dead_lettered += 1;
            } else {
                intent.state = St::Pending;
                intent.available = window;
                requeued += 1;
            }
        }
        Expect::Rescued {
            requeued,
            dead_lettered,
            needs_reconcile,
        }
    }

    fn reconcile(&mut self, seq: usize, decision: Decision) -> Answer {
        let now = self.now;
        let Some(intent) = self.intents.get_mut(seq) else {
            return Answer {
                error: Some((Code::NotFound, "NOT_FOUND")),
                state: St::Unspecified,
                lease_expires_at: None,
            };
        };
        let applies = match decision {
            // DEAD on a dead letter changes nothing, unless it holds its ordering key: then
            // it releases the key.
            Decision::Dead => {
                intent.state == St::NeedsReconcile
                    || (intent.state == St::DeadLettered
                        && intent.ordering.is_some()
                        && !intent.released)
            }
            // Given up, its key moved on: the decision is final.
            _ => matches!(intent.state, St::NeedsReconcile | St::DeadLettered) && !intent.released,
        };
        if !applies {
            return Answer {
                error: Some((Code::FailedPrecondition, "INVALID_STATE")),
                ..Answer::ok(intent.state)
            };
        }
        intent.lease = None;
        intent.lease_expires_at = None;
        intent.submitted_by = None;
        let ordering = intent.ordering;
        intent.released = decision == Decision::Dead && ordering.is_some();
        intent.state = match decision {
            Decision::Delivered => St::Delivered,
            Decision::Dead => St::DeadLettered,
            _ => {
                // A redriven intent gets a full attempt budget, claimable at once; an
                // ordered one takes its place in its key again (first in commit order, so
                // the head if the key has none).
                intent.attempts = 0;
                intent.available = (now, now);
                if ordering.is_some() {
                    St::Waiting
                } else {
                    St::Pending
                }
            }
        };
        // DELIVERED and DEAD release the key, REQUEUE may take it: the key moves on.
        self.advance(ordering);
        Answer::ok(self.intents[seq].state)
    }
}

struct Lifecycle;

fn outcome() -> impl Strategy<Value = FailOutcome> {
    prop_oneof![
        Just(FailOutcome::Retry),
        Just(FailOutcome::Permanent),
        Just(FailOutcome::Unknown),
    ]
}

fn decision() -> impl Strategy<Value = Decision> {
    prop_oneof![
        Just(Decision::Delivered),
        Just(Decision::Requeue),
        Just(Decision::Dead),
    ]
}

impl ReferenceStateMachine for Lifecycle {
    type State = Model;
    type Transition = Transition;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model {
            now: 0,
            intents: Vec::new(),
            leases: Vec::new(),
            last_request: [None; 2],
            requests: 0,
            expect: Expect::Nothing,
        })
        .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Transition> {
        // Weights follow the state, so that sequences reach expiry, rescue, re-leasing and
        // operator decisions instead of claiming from an empty queue.
        let now = state.now;
        let due = state
            .intents
            .iter()
            .any(|i| i.state == St::Pending && i.available.1 <= now);
        let waiting = state
            .intents
            .iter()
            .any(|i| i.state == St::Pending && now < i.available.1);
        let held = state
            .intents
            .iter()
            .any(|i| matches!(i.state, St::Leased | St::Submitted));
        let expired = state
            .intents
            .iter()
            .any(|i| i.lease_expires_at.is_some_and(|t| t < now));
        let clock = match (held && !expired, waiting) {
            (true, _) => {
                prop_oneof![1 => Just(1i64), 1 => Just(5), 4 => Just(31), 1 => Just(61)].boxed()
            }
            (false, true) => {
                prop_oneof![1 => Just(1i64), 2 => Just(2), 3 => Just(5), 1 => Just(61)].boxed()
            }
            (false, false) => prop_oneof![Just(1i64), Just(5), Just(31)].boxed(),
        };
        let mut arms: Vec<(u32, BoxedStrategy<Transition>)> = vec![
            (
                if state.intents.len() < 4 { 4 } else { 1 },
                (
                    proptest::option::of(0..2u8),
                    0..2u8,
                    1..=3i32,
                    // Mostly one key, so that its queue grows.
                    proptest::option::weighted(0.7, prop_oneof![3 => Just(0u8), 1 => Just(1)]),
                    proptest::bool::weighted(0.2),
                )
                    .prop_map(|(key, payload, max_attempts, ordering, and_next)| {
                        Transition::Enqueue {
                            key,
                            payload,
                            max_attempts,
                            ordering,
                            and_next: and_next && ordering.is_some(),
                        }
                    })
                    .boxed(),
            ),
            (
                if held || waiting { 4 } else { 1 },
                clock.prop_map(Transition::AdvanceClock).boxed(),
            ),
            (
                if expired { 5 } else { 1 },
                Just(Transition::Rescue).boxed(),
            ),
        ];
        if !state.maybe_due() {
            let model = state.clone();
            arms.push((
                if due { 6 } else { 1 },
                (0..2u8, 1..=3i32, proptest::bool::weighted(0.2))
                    .prop_map(move |(worker, n, repeat)| Transition::Claim {
                        worker,
                        n: model.decided_claim_size(n),
                        repeat: repeat && model.last_request[worker as usize].is_some(),
                    })
                    .boxed(),
            ));
        }
        if !state.leases.is_empty() {
            // Mostly the newest leases, sometimes any (stale ones included).
            let n = state.leases.len();
            let lease = || prop_oneof![2 => n.saturating_sub(2)..n, 1 => 0..n];
            arms.push((3, lease().prop_map(Transition::MarkSubmitted).boxed()));
            arms.push((4, lease().prop_map(Transition::Ack).boxed()));
            arms.push((
                4,
                (lease(), outcome())
                    .prop_map(|(h, o)| Transition::Fail(h, o))
                    .boxed(),
            ));
            arms.push((
                1,
                (lease(), prop_oneof![Just(10i64), Just(60)])
                    .prop_map(|(h, s)| Transition::ExtendLease(h, s))
                    .boxed(),
            ));
        }
        if !state.intents.is_empty() {
            let awaiting: Vec<usize> = (0..state.intents.len())
                .filter(|&s| {
                    matches!(
                        state.intents[s].state,
                        St::NeedsReconcile | St::DeadLettered
                    )
                })
                .collect();
            let any = 0..state.intents.len();
            // Heads that hold their ordering key with intents waiting behind: deciding them
            // moves the key on (or not), so they are decided more often.
            let blocking: Vec<usize> = awaiting
                .iter()
                .copied()
                .filter(|&s| {
                    let head = &state.intents[s];
                    head.holds_key()
                        && state
                            .intents
                            .iter()
                            .any(|i| i.ordering == head.ordering && i.state == St::Waiting)
                })
                .collect();
            let weight = match (awaiting.is_empty(), blocking.is_empty()) {
                (true, _) => 2,
                (false, true) => 4,
                (false, false) => 8,
            };
            let target = match (awaiting.is_empty(), blocking.is_empty()) {
                (true, _) => prop_oneof![8 => any, 1 => Just(usize::MAX)].boxed(),
                (false, true) => {
                    let awaiting = proptest::sample::select(awaiting);
                    prop_oneof![6 => awaiting, 2 => any, 1 => Just(usize::MAX)].boxed()
                }
                (false, false) => {
                    let awaiting = proptest::sample::select(awaiting);
                    let blocking = proptest::sample::select(blocking);
                    prop_oneof![
                        6 => blocking,
                        4 => awaiting,
                        2 => any,
                        1 => Just(usize::MAX)
                    ]
                    .boxed()
                }
            };
            arms.push((
                weight,
                (target, decision())
                    .prop_map(|(s, d)| Transition::Reconcile(s, d))
                    .boxed(),
            ));
        }
        Union::new_weighted(arms).boxed()
    }

    fn preconditions(state: &Model, transition: &Transition) -> bool {
        match *transition {
            Transition::Claim { worker, n, repeat } => {
                (repeat && !state.earlier_leases(worker).is_empty())
                    || state.claim_pick(n).is_some()
            }
            Transition::MarkSubmitted(h)
            | Transition::Ack(h)
            | Transition::Fail(h, _)
            | Transition::ExtendLease(h, _) => h < state.leases.len(),
            Transition::Reconcile(s, _) => s == usize::MAX || s < state.intents.len(),
            _ => true,
        }
    }

    fn apply(mut state: Model, transition: &Transition) -> Model {
        state.expect = match *transition {
            Transition::Enqueue {
                key,
                payload,
                max_attempts,
                ordering,
                and_next,
            } => state.enqueue(key, payload, max_attempts, ordering, and_next),
            Transition::Claim { worker, n, repeat } => {
                let earlier = if repeat {
                    state.earlier_leases(worker)
                } else {
                    Vec::new()
                };
                let request = match state.last_request[worker as usize] {
                    Some(last) if repeat => last,
                    _ => {
                        state.requests += 1;
                        state.requests
                    }
                };
                state.last_request[worker as usize] = Some(request);
                let picked = if earlier.is_empty() {
                    state.claim_pick(n).expect("precondition")
                } else {
                    Vec::new()
                };
                let mut claimed: Vec<(usize, usize)> = earlier
                    .into_iter()
                    .map(|seq| (seq, state.intents[seq].lease.expect("leased")))
                    .collect();
                for seq in picked {
                    let handle = state.leases.len();
                    state.leases.push(Lease { intent: seq });
                    let now = state.now;
                    let intent = &mut state.intents[seq];
                    intent.state = St::Leased;
                    intent.attempts += 1;
                    intent.lease = Some(handle);
                    intent.lease_expires_at = Some(now + LEASE_MS);
                    intent.worker = Some(worker);
                    intent.claim_request = Some((worker, request));
                    claimed.push((seq, handle));
                }
                Expect::Claimed(claimed)
            }
            Transition::MarkSubmitted(h) => Expect::Item(state.mark_submitted(h)),
            Transition::Ack(h) => Expect::Item(state.ack(h)),
            Transition::Fail(h, o) => Expect::Item(state.fail(h, o)),
            Transition::ExtendLease(h, secs) => Expect::Item(state.extend(h, secs)),
            Transition::AdvanceClock(secs) => {
                state.now += secs * 1000;
                Expect::Nothing
            }
            Transition::Rescue => state.rescue(),
            Transition::Reconcile(seq, d) => Expect::Item(state.reconcile(seq, d)),
        };
        state
    }
}

/// The real server for one case, on its own database and runtime.
struct Server {
    runtime: tokio::runtime::Runtime,
    app: TestApp,
    /// The manual clock at the start of the case, truncated to PostgreSQL's microseconds.
    start: DateTime<Utc>,
    /// Intent ids in enqueue order.
    ids: Vec<String>,
    /// Leases by model handle.
    leases: Vec<v1::Lease>,
}

impl Server {
    fn micros_since_start(&self, t: DateTime<Utc>) -> i64 {
        (t - self.start).num_microseconds().expect("in range")
    }

    fn timestamp_ms(&self, t: &Option<prost_types::Timestamp>) -> i64 {
        let t = t.as_ref().expect("timestamp set");
        let t = DateTime::from_timestamp(t.seconds, t.nanos as u32).expect("valid timestamp");
        let micros = self.micros_since_start(t);
        assert_eq!(
            micros % 1000,
            0,
            "the virtual clock moves in whole ms: {micros}µs"
        );
        micros / 1000
    }

    fn check_item(&self, result: &v1::LeaseResult, id: &str, expected: &Answer, what: &str) {
        assert_eq!(result.intent_id, id, "{what}");
        let got = result.error.as_ref().map(|e| (e.code, e.reason.as_str()));
        let want = expected.error.map(|(code, reason)| (code as i32, reason));
        assert_eq!(got, want, "{what}: {result:?}");
        assert_eq!(result.state(), expected.state, "{what}: {result:?}");
        if let Some(expiry) = expected.lease_expires_at {
            assert_eq!(
                self.timestamp_ms(&result.lease_expires_at),
                expiry,
                "{what}: new expiry"
            );
        }
    }
}

fn state_name(state: St) -> &'static str {
    match state {
        St::Staged => "staged",
        St::Pending => "pending",
        St::Leased => "leased",
        St::Submitted => "submitted",
        St::Delivered => "delivered",
        St::NeedsReconcile => "needs_reconcile",
        St::DeadLettered => "dead_lettered",
        St::Discarded => "discarded",
        St::Waiting => "waiting",
        St::Cancelled => "cancelled",
        St::Unspecified => "unspecified",
    }
}

#[derive(sqlx::FromRow, Debug)]
struct Stored {
    id: String,
    state: String,
    attempts: i32,
    max_attempts: i32,
    lease_id: Option<String>,
    lease_expires_at: Option<DateTime<Utc>>,
    available_at: DateTime<Utc>,
    worker_id: Option<String>,
    ordering_key: Option<String>,
    finished_at: Option<DateTime<Utc>>,
}

impl StateMachineTest for Lifecycle {
    type SystemUnderTest = Server;
    type Reference = Lifecycle;

    fn init_test(_: &Model) -> Server {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let app = runtime.block_on(TestApp::spawn());
        assert_eq!(
            app.settings.limits.default_lease.as_millis(),
            LEASE_MS as u128
        );
        let backoff = app.settings.backoff();
        assert_eq!(backoff.base.as_millis(), BACKOFF_BASE_MS as u128);
        assert_eq!(backoff.cap.as_millis(), BACKOFF_CAP_MS as u128);
        let start = app.clock.now().expect("manual clock");
        // PostgreSQL keeps microseconds; every instant the server reports is start + whole ms.
        let start = DateTime::from_timestamp_micros(start.timestamp_micros()).unwrap();
        Server {
            runtime,
            app,
            start,
            ids: Vec::new(),
            leases: Vec::new(),
        }
    }

    fn apply(mut server: Server, model: &Model, transition: Transition) -> Server {
        let what = format!("{transition:?} at {}ms", model.now);
        let app = &server.app;
        match (transition, &model.expect) {
            (
                Transition::Enqueue {
                    key,
                    payload,
                    max_attempts,
                    ordering,
                    and_next,
                },
                expect,
            ) => {
                let mut new = intent("job", &format!("{{\"p\":{payload}}}"));
                new.max_attempts = max_attempts;
                new.ordering_key = ordering.map(ordering_name).unwrap_or_default();
                let mut request = vec![new.clone()];
                if and_next {
                    request.push(new.clone());
                }
                request[0].idempotency_key = key.map(|k| format!("key-{k}")).unwrap_or_default();
                let answer = server.runtime.block_on(app.enqueue(request));
                match expect {
                    Expect::Enqueued(items) => {
                        let results = answer.unwrap_or_else(|e| panic!("{what}: {e:?}"));
                        assert_eq!(results.len(), items.len(), "{what}: {results:?}");
                        for (result, &(seq, deduplicated, state)) in results.into_iter().zip(items)
                        {
                            assert_eq!(result.deduplicated, deduplicated, "{what}: {result:?}");
                            assert_eq!(result.state(), state, "{what}: {result:?}");
                            if deduplicated {
                                assert_eq!(result.id, server.ids[seq], "{what}");
                            } else {
                                assert_eq!(seq, server.ids.len());
                                server.ids.push(result.id);
                            }
                        }
                    }
                    Expect::IdempotencyConflict => {
                        let status = answer.expect_err(&what);
                        crate::helpers::assert_status(
                            &status,
                            Code::AlreadyExists,
                            "IDEMPOTENCY_CONFLICT",
                            &[],
                        );
                    }
                    other => unreachable!("{other:?}"),
                }
            }
            (Transition::Claim { worker, n, .. }, Expect::Claimed(expected)) => {
                let request = model.last_request[worker as usize].expect("sent");
                let mut claim = claim_request(&format!("worker-{worker}"), n);
                claim.request_id = format!("request-{request}");
                let leases = server
                    .runtime
                    .block_on(app.claim(claim))
                    .unwrap_or_else(|e| panic!("{what}: {e:?}"));
                let mut got: Vec<&str> = leases.iter().map(id_of).collect();
                let mut want: Vec<&str> = expected
                    .iter()
                    .map(|&(seq, _)| server.ids[seq].as_str())
                    .collect();
                got.sort_unstable();
                want.sort_unstable();
                assert_eq!(got, want, "{what}: the intents leased");
                let mut by_handle = Vec::new();
                for &(seq, handle) in expected {
                    let lease = leases
                        .iter()
                        .find(|l| id_of(l) == server.ids[seq])
                        .unwrap()
                        .clone();
                    let intent = &model.intents[seq];
                    assert_eq!(lease.attempt, intent.attempts, "{what}: attempt");
                    assert_eq!(
                        server.timestamp_ms(&lease.lease_expires_at),
                        intent.lease_expires_at.unwrap(),
                        "{what}: lease expiry"
                    );
                    match server.leases.get(handle) {
                        // A repeated request returns the leases its first attempt took.
                        Some(earlier) => assert_eq!(
                            lease.lease_id, earlier.lease_id,
                            "{what}: the same lease again"
                        ),
                        None => {
                            assert!(
                                server.leases.iter().all(|l| l.lease_id != lease.lease_id),
                                "{what}: every claim mints a fresh lease id"
                            );
                            by_handle.push((handle, lease));
                        }
                    }
                }
                by_handle.sort_by_key(|(h, _)| *h);
                for (handle, lease) in by_handle {
                    assert_eq!(handle, server.leases.len());
                    server.leases.push(lease);
                }
            }
            (Transition::MarkSubmitted(h), Expect::Item(answer)) => {
                let lease = &server.leases[h];
                let result = server.runtime.block_on(app.mark_submitted(&[lease]));
                server.check_item(&result[0], id_of(lease), answer, &what);
            }
            (Transition::Ack(h), Expect::Item(answer)) => {
                let lease = &server.leases[h];
                let result = server.runtime.block_on(app.ack(&[lease]));
                server.check_item(&result[0], id_of(lease), answer, &what);
            }
            (Transition::Fail(h, outcome), Expect::Item(answer)) => {
                let lease = &server.leases[h];
                let result = server.runtime.block_on(app.fail(lease, outcome));
                server.check_item(&result, id_of(lease), answer, &what);
            }
            (Transition::ExtendLease(h, secs), Expect::Item(answer)) => {
                let lease = &server.leases[h];
                let by = Duration::from_secs(secs as u64);
                let result = server.runtime.block_on(app.extend(&[lease], by));
                server.check_item(&result[0], id_of(lease), answer, &what);
            }
            (Transition::AdvanceClock(secs), _) => {
                app.advance(Duration::from_secs(secs as u64));
            }
            (
                Transition::Rescue,
                Expect::Rescued {
                    requeued,
                    dead_lettered,
                    needs_reconcile,
                },
            ) => {
                let report = server.runtime.block_on(app.rescue());
                assert_eq!(
                    (
                        report.requeued,
                        report.dead_lettered,
                        report.needs_reconcile
                    ),
                    (*requeued, *dead_lettered, *needs_reconcile),
                    "{what}"
                );
            }
            (Transition::Reconcile(seq, decision), Expect::Item(answer)) => {
                let id = server
                    .ids
                    .get(seq)
                    .cloned()
                    .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
                let request = v1::ReconcileRequest {
                    target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
                        ids: vec![id.clone()],
                        ..Default::default()
                    })),
                    decision: decision as i32,
                    actor: "model".into(),
                    reason: "model-based test".into(),
                    limit: 0,
                };
                let result = server
                    .runtime
                    .block_on(app.reconcile(request))
                    .unwrap_or_else(|e| panic!("{what}: {e:?}"))
                    .remove(0);
                assert_eq!(result.intent_id, id, "{what}");
                let got = result.error.as_ref().map(|e| (e.code, e.reason.as_str()));
                let want = answer.error.map(|(code, reason)| (code as i32, reason));
                assert_eq!(got, want, "{what}: {result:?}");
                assert_eq!(result.state(), answer.state, "{what}: {result:?}");
            }
            (transition, expect) => unreachable!("{transition:?} with {expect:?}"),
        }
        server
    }

    fn check_invariants(server: &Server, model: &Model) {
        let stored: Vec<Stored> = server
            .runtime
            .block_on(
                sqlx::query_as(
                    "SELECT id::text AS id, state::text AS state, attempts, max_attempts, \
                        lease_id::text AS lease_id, lease_expires_at, available_at, worker_id, \
                        ordering_key, finished_at \
                 FROM outbox.all_intents ORDER BY id",
                )
                .fetch_all(&server.app.pool),
            )
            .unwrap();
        assert_eq!(
            stored.len(),
            model.intents.len(),
            "no intent lost or made up"
        );
        let mut lease_ids = std::collections::HashSet::new();
        for row in &stored {
            let seq = server.ids.iter().position(|id| *id == row.id).unwrap();
            let intent = &model.intents[seq];
            let at = format!("intent #{seq} at {}ms: {row:?}", model.now);
            assert_eq!(row.state, state_name(intent.state), "{at}");
            assert_eq!(row.attempts, intent.attempts, "{at}");
            assert_eq!(row.max_attempts, intent.max_attempts, "{at}");
            let recorded = intent.lease.map(|h| server.leases[h].lease_id.as_str());
            assert_eq!(row.lease_id.as_deref(), recorded, "{at}: lease_id");
            assert_eq!(
                row.worker_id.as_deref(),
                intent.worker.map(|w| format!("worker-{w}")).as_deref(),
                "{at}: worker"
            );
            // One live lease at most: a LEASED or SUBMITTED intent has exactly one lease
            // and its expiry; nothing else has an expiry; no lease id is on two intents.
            let live = matches!(intent.state, St::Leased | St::Submitted);
            assert_eq!(row.lease_expires_at.is_some(), live, "{at}: lease expiry");
            if let Some(expiry) = row.lease_expires_at {
                assert_eq!(
                    server.micros_since_start(expiry),
                    intent.lease_expires_at.unwrap() * 1000,
                    "{at}: lease expiry"
                );
            }
            if let Some(lease) = &row.lease_id {
                assert!(lease_ids.insert(lease.clone()), "{at}: lease id reused");
            }
            assert!(
                !live || row.lease_id.is_some(),
                "{at}: a live intent without lease"
            );
            // A SUBMITTED intent is never handed to a second worker without its holder's
            // definite outcome or an operator decision.
            if let Some(h) = intent.submitted_by {
                assert!(
                    matches!(row.state.as_str(), "submitted" | "needs_reconcile")
                        && row.lease_id.as_deref() == Some(server.leases[h].lease_id.as_str()),
                    "{at}: submitted under lease #{h}"
                );
            }
            if intent.state == St::Pending {
                let available = server.micros_since_start(row.available_at);
                let (earliest, latest) = intent.available;
                assert!(
                    earliest * 1000 <= available && available <= latest * 1000,
                    "{at}: available_at {available}µs outside [{earliest}, {latest}]ms"
                );
            }
            assert_eq!(
                row.ordering_key,
                intent.ordering.map(ordering_name),
                "{at}: ordering key"
            );
            if intent.state == St::DeadLettered {
                assert_eq!(
                    row.finished_at.is_some(),
                    intent.released,
                    "{at}: a dead letter holds its key until an operator's DEAD"
                );
            }
        }
        check_ordering(server, model, &stored);
    }

    fn teardown(server: Server, _: Model) {
        let Server { runtime, app, .. } = server;
        runtime.block_on(async move {
            let pool = app.pool.clone();
            app.stop().await;
            pool.close().await;
        });
    }
}

/// The ordering guarantees on the stored rows, per ordering key, with the model's enqueue
/// order (which is commit order) and its ghost of operators' DEAD decisions.
fn check_ordering(server: &Server, model: &Model, stored: &[Stored]) {
    let mut keys: std::collections::BTreeMap<&str, Vec<(usize, &Stored)>> = Default::default();
    for row in stored {
        if let Some(key) = &row.ordering_key {
            let seq = server.ids.iter().position(|id| *id == row.id).unwrap();
            keys.entry(key).or_default().push((seq, row));
        }
    }
    for (key, mut rows) in keys {
        rows.sort_by_key(|(seq, _)| *seq);
        let at = format!("ordering key {key} at {}ms: {rows:?}", model.now);
        let live = rows
            .iter()
            .filter(|(_, r)| matches!(r.state.as_str(), "pending" | "leased" | "submitted"))
            .count();
        assert!(
            live <= 1,
            "{at}: {live} intents PENDING, LEASED or SUBMITTED"
        );
        let heads: Vec<usize> = rows
            .iter()
            .filter(|(_, r)| match r.state.as_str() {
                "staged" | "pending" | "leased" | "submitted" | "needs_reconcile" => true,
                "dead_lettered" => r.finished_at.is_none(),
                _ => false,
            })
            .map(|(seq, _)| *seq)
            .collect();
        assert!(heads.len() <= 1, "{at}: heads {heads:?}");
        let waiting = rows.iter().any(|(_, r)| r.state == "waiting");
        assert!(
            !waiting || heads.len() == 1,
            "{at}: WAITING intents behind no head"
        );
        // None leased (or due to be) while an earlier one of its key is unfinished.
        if let Some(&head) = heads.first() {
            for (seq, row) in rows.iter().take_while(|(seq, _)| *seq < head) {
                assert!(
                    row.state == "delivered" || model.intents[*seq].released,
                    "{at}: #{head} is the head while #{seq} before it is unfinished"
                );
            }
        }
    }
}

/// 32 cases (a fresh database and server each) keep this test to seconds; set
/// `PROPTEST_CASES` to run more.
fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(32);
    Config {
        cases,
        max_shrink_iters: 256,
        // Failures are shrunk; no need to persist regressions next to the test binary.
        failure_persistence: None,
        ..Config::default()
    }
}

prop_state_machine! {
    #![proptest_config(config())]

    /// Random lifecycles against the real server agree with the reference model, step by
    /// step, answer by answer and row by row.
    #[test]
    fn the_server_follows_the_lifecycle_model(sequential 1..40 => Lifecycle);
}
