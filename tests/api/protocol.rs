//! A model check of the lease and two-phase token protocol, independent of the database:
//! every guarded transition of `src/outbox/store/` (claim, request-id replays, settle,
//! rescue, reconcile, staged promotion, the enqueue token check and insert) is written
//! down here as the SQL does it, and every interleaving of producers, workers, the clock,
//! the rescue sweep and an operator is explored breadth first with stateright. The
//! guarantees of docs/design.md are checked as properties of every reachable state, and
//! "every intent that must be delivered can still end delivered or with an operator" is
//! checked on the explored graph (from every reachable state, such a state is reachable).
//! Intents of one ordering key (docs/ordering.md) add `outbox.advance_keys`: WAITING
//! behind the key's head, the next made PENDING by the Ack or decision that finished it.
//!
//! Abstractions, each sound for the properties checked:
//! - A lease id is fresh at every claim, so the `lease_id` column is either NULL or the id
//!   of the last claim (`Column::Last`); a worker presents either that last lease or an
//!   older one (`stale`), which never matches again. Any worker may present an older lease
//!   of any leased intent (a superset of the workers that really held one).
//! - Time is per lease: `expired` says `lease_expires_at < now`, `due` says
//!   `available_at <= now`. Any lease may expire before any other, and ExtendLease makes it
//!   unexpired again, which is all a real clock allows.
//! - A worker may send any report with any lease it knows, at any time and any number of
//!   times: late, duplicated and stale reports are all interleavings. A lost report is one
//!   the worker sent (so it gave the lease up) and the server never saw.
//! - Claim takes any due PENDING intent, not the oldest: a superset of the real orders.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use stateright::{Checker, Expectation, Model, Property};

const MAX_ROWS: usize = 4;
const MAX_WORKERS: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum St {
    /// No row in this slot (yet).
    Absent,
    Staged,
    Pending,
    Leased,
    Submitted,
    Delivered,
    NeedsReconcile,
    DeadLettered,
    Discarded,
    /// Behind its ordering key's head.
    Waiting,
}

/// `pg_xact_status` of the producer's transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Txn {
    Open,
    Committed,
    /// Rolled back, or the producer's backend (or PostgreSQL) crashed before COMMIT.
    Aborted,
}

/// Who created a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Origin {
    /// Enqueued with the producer transaction's token: STAGED until it finishes.
    Token,
    /// Enqueued directly (no token): PENDING at once.
    Direct,
}

/// What the `lease_id` column holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Column {
    Null,
    /// The id minted by the last claim of the row.
    Last,
}

/// The last lease granted on a row: who holds it and, as ghost state, whether it is live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Grant {
    holder: u8,
    /// The holder received the Claim response (or a replay of it).
    known: bool,
    /// `lease_expires_at < now`.
    expired: bool,
    /// The holder sent its final report (Ack or Fail) with this lease.
    relinquished: bool,
    /// The protocol took the lease back: rescued while LEASED, or an operator decided.
    voided: bool,
}

impl Grant {
    fn live(&self) -> bool {
        !self.expired && !self.relinquished
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Row {
    state: St,
    origin: Origin,
    attempts: u8,
    column: Column,
    /// `available_at <= now` (meaningful while PENDING).
    due: bool,
    /// `claim_request_id` names the outstanding (response lost) claim of this worker.
    claim_req: Option<u8>,
    /// Carries the idempotency key K shared by the token and the direct producer.
    key_k: bool,
    grant: Option<Grant>,
    /// Ghost: MarkSubmitted applied and nobody has settled the outcome since (neither the
    /// holder with a definite report nor an operator).
    ambiguous: bool,
    /// Carries the ordering key (there is one); its place in the key is its slot.
    ordered: bool,
    /// DEAD_LETTERED and given up by an operator's DEAD (`finished_at` set): it no longer
    /// holds its key.
    released: bool,
    /// Ghost: finished for the intents behind it: an Ack applied, or an operator's
    /// DELIVERED or DEAD (which a later REQUEUE does not undo: the requeued intent then
    /// waits behind the key's head of the moment).
    done: bool,
}

impl Row {
    const ABSENT: Row = Row {
        state: St::Absent,
        origin: Origin::Direct,
        attempts: 0,
        column: Column::Null,
        due: false,
        claim_req: None,
        key_k: false,
        grant: None,
        ambiguous: false,
        ordered: false,
        released: false,
        done: false,
    };

    fn new(state: St, origin: Origin) -> Row {
        Row {
            state,
            origin,
            due: true,
            ..Row::ABSENT
        }
    }

    /// Holds the (shared) idempotency key: the unique index is partial, `state <> 'discarded'`.
    fn holds_key(&self) -> bool {
        self.key_k && !matches!(self.state, St::Absent | St::Discarded)
    }

    /// Is its ordering key's head (`outbox.advance_keys`' test of a key that has one).
    fn heads_key(&self) -> bool {
        self.ordered
            && (matches!(
                self.state,
                St::Staged | St::Pending | St::Leased | St::Submitted | St::NeedsReconcile
            ) || (self.state == St::DeadLettered && !self.released))
    }
}

/// One copy of the token producer's Enqueue request (a retry or a network duplicate is a
/// second copy). The server checks `pg_xact_status` first and inserts in a separate
/// transaction afterwards, so the producer's COMMIT or ROLLBACK may fall in between.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Request {
    Unsent,
    /// The status check saw the transaction in progress; the insert has not run yet.
    Checked,
    /// Answered OK with this row (inserted or deduplicated).
    Ok(u8),
    /// Answered with an error (ABORTED, FAILED_PRECONDITION, or outboxd died mid-call).
    Err,
}

/// The direct producer, whose intent carries the same idempotency key as the token one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Direct {
    Unsent,
    /// ABORTED / IDEMPOTENCY_KEY_IN_USE: the key is held by an open transaction's intent.
    KeyInUse,
    Ok(u8),
}

// Violation bits: set by a transition that breaks a rule, checked by `always` properties.
const V_TWO_LIVE_LEASES: u16 = 1 << 0;
const V_STALE_REPORT_ACCEPTED: u16 = 1 << 1;
const V_ACK_NOT_FROM_HOLDER: u16 = 1 << 2;
const V_AMBIGUOUS_RELEASED: u16 = 1 << 3;
const V_ACK_OK_NOT_DELIVERED: u16 = 1 << 4;
const V_FAIL_OK_ELSEWHERE: u16 = 1 << 5;
const V_KEY_TWO_LIVE_LEASES: u16 = 1 << 6;
const V_KEY_OUT_OF_ORDER: u16 = 1 << 7;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct State {
    rows: [Row; MAX_ROWS],
    txn: Txn,
    requests: [Request; 2],
    direct: Direct,
    /// A worker whose last Claim response was lost and who may retry it (same request id).
    outstanding: [bool; MAX_WORKERS],
    violations: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Outcome {
    Retry,
    Permanent,
    Unknown,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Decision {
    Delivered,
    Requeue,
    Dead,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Report {
    MarkSubmitted,
    Extend,
    Ack,
    Fail(Outcome),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Action {
    Commit,
    Rollback,
    /// The producer's backend is killed (or PostgreSQL crashes): `pg_xact_status` says aborted.
    ProducerCrash,
    EnqueueCheck(u8),
    EnqueueInsert(u8),
    /// outboxd dies between the status check and the insert.
    EnqueueDropped(u8),
    DirectEnqueue,
    Promote(u8),
    /// Claim of one due PENDING row; `lost`: the response never reached the worker.
    Claim {
        worker: u8,
        row: u8,
        lost: bool,
    },
    /// The worker repeats its lost Claim with the same request id.
    RetryClaim(u8),
    /// A worker reports with the last lease of the row (`stale == false`) or an older one.
    Report {
        worker: u8,
        row: u8,
        stale: bool,
        report: Report,
    },
    /// The holder sent Ack or Fail, and the message was lost.
    ReportLost {
        worker: u8,
        row: u8,
    },
    /// The clock passes the last lease's expiry.
    Expire(u8),
    /// The clock passes `available_at`.
    Due(u8),
    Rescue(u8),
    Reconcile(u8, Decision),
}

/// One configuration of the protocol.
#[derive(Clone, Debug)]
struct Protocol {
    workers: u8,
    max_attempts: u8,
    /// Rows enqueued directly before the run (PENDING, due).
    direct_rows: u8,
    /// Rows of one ordering key enqueued directly after those, in slot order: the first
    /// PENDING, the others WAITING.
    ordered_rows: u8,
    /// A producer transaction enqueues one intent with its token (key K).
    token_producer: bool,
    /// A direct producer enqueues an intent with the same key K.
    direct_producer: bool,
    /// Workers may lose Claim responses and retry them with the same request id.
    lost_claims: bool,
}

const DECISIONS: [Decision; 3] = [Decision::Delivered, Decision::Requeue, Decision::Dead];
const REPORTS: [Report; 6] = [
    Report::MarkSubmitted,
    Report::Extend,
    Report::Ack,
    Report::Fail(Outcome::Retry),
    Report::Fail(Outcome::Permanent),
    Report::Fail(Outcome::Unknown),
];

impl Protocol {
    fn free_slot(s: &State) -> Option<usize> {
        s.rows.iter().position(|r| r.state == St::Absent)
    }

    /// The row holding key K, as the enqueue statement's `ON CONFLICT` / `existing` join sees it.
    fn key_holder(s: &State) -> Option<usize> {
        s.rows.iter().position(Row::holds_key)
    }

    /// The token rows, for the replay lookup (`find_replay`: key, txn, content; any state).
    fn token_row(s: &State) -> Option<usize> {
        s.rows
            .iter()
            .position(|r| r.state != St::Absent && r.origin == Origin::Token)
    }

    /// Claim as `lease_next` does it for one row: attempts + 1, a fresh lease id.
    fn lease(s: &mut State, w: u8, i: usize, lost: bool) {
        let row = &mut s.rows[i];
        debug_assert!(row.state == St::Pending && row.due);
        if let Some(g) = row.grant {
            // The previous lease must be over before anyone else gets the intent.
            if g.live() {
                s.violations |= V_TWO_LIVE_LEASES;
            }
        }
        if row.ambiguous {
            s.violations |= V_AMBIGUOUS_RELEASED;
        }
        if row.ordered {
            let others = s
                .rows
                .iter()
                .enumerate()
                .filter(|&(j, r)| j != i && r.ordered);
            for (j, other) in others {
                if other.grant.is_some_and(|g| g.live()) {
                    s.violations |= V_KEY_TWO_LIVE_LEASES;
                }
                if j < i && !other.done {
                    s.violations |= V_KEY_OUT_OF_ORDER;
                }
            }
        }
        let row = &mut s.rows[i];
        row.state = St::Leased;
        row.attempts += 1;
        row.column = Column::Last;
        row.claim_req = lost.then_some(w);
        row.grant = Some(Grant {
            holder: w,
            known: !lost,
            expired: false,
            relinquished: false,
            voided: false,
        });
    }

    /// Fail's new state: `fail_intents`' CASE.
    fn failed_state(&self, row: &Row, outcome: Outcome) -> St {
        match outcome {
            Outcome::Unknown => St::NeedsReconcile,
            Outcome::Permanent => St::DeadLettered,
            Outcome::Retry if row.attempts >= self.max_attempts => St::DeadLettered,
            Outcome::Retry => St::Pending,
        }
    }

    fn report(&self, s: &mut State, w: u8, i: usize, stale: bool, report: Report) {
        let row = &mut s.rows[i];
        let grant = row
            .grant
            .expect("a worker knows a lease only of a leased row");
        // `i.lease_id = input.lease_id`: an older lease never matches a fresh id.
        let matches = !stale && row.column == Column::Last;
        let before = row.state;
        let applied = match report {
            // extend_leases: state IN ('leased', 'submitted').
            Report::Extend => {
                let ok = matches && matches!(before, St::Leased | St::Submitted);
                if ok {
                    row.grant.as_mut().unwrap().expired = false;
                }
                ok
            }
            // mark_intents_submitted: state = 'leased'.
            Report::MarkSubmitted => {
                let ok = matches && before == St::Leased;
                if ok {
                    row.state = St::Submitted;
                    row.ambiguous = true;
                }
                ok
            }
            // ack_intents: state IN ('leased', 'submitted', 'needs_reconcile').
            Report::Ack => {
                let ok =
                    matches && matches!(before, St::Leased | St::Submitted | St::NeedsReconcile);
                if ok {
                    row.state = St::Delivered;
                    row.claim_req = None;
                    row.ambiguous = false;
                    row.done = true;
                }
                ok
            }
            // fail_intents: state IN ('leased', 'submitted'), or NEEDS_RECONCILE for a
            // definite outcome.
            Report::Fail(outcome) => {
                let ok = matches
                    && (matches!(before, St::Leased | St::Submitted)
                        || (before == St::NeedsReconcile && outcome != Outcome::Unknown));
                if ok {
                    let next = self.failed_state(row, outcome);
                    row.state = next;
                    row.due = false;
                    row.claim_req = None;
                    if outcome != Outcome::Unknown {
                        row.ambiguous = false;
                    }
                }
                ok
            }
        };
        let after = row.state;
        // settle.rs `report`: not applied, but the lease matches and the intent already is
        // where this kind of call puts it → OK (a lost-response replay). A RETRY dead-letters
        // only an intent whose attempts are used up.
        let used_up = row.attempts >= self.max_attempts;
        let replay = matches
            && match report {
                Report::Extend => false,
                Report::MarkSubmitted => after == St::Submitted,
                Report::Ack => after == St::Delivered,
                Report::Fail(Outcome::Retry) => {
                    after == St::Pending || (after == St::DeadLettered && used_up)
                }
                Report::Fail(Outcome::Permanent) => after == St::DeadLettered,
                Report::Fail(Outcome::Unknown) => after == St::NeedsReconcile,
            };
        let answered_ok = applied || replay;
        let settles = matches!(report, Report::Ack | Report::Fail(_));
        if settles && !stale {
            row.grant.as_mut().unwrap().relinquished = true;
        }
        if settles && answered_ok && (stale || grant.voided) {
            s.violations |= V_STALE_REPORT_ACCEPTED;
        }
        if report == Report::Ack && applied {
            // Only the holder of the live lease, or the last holder of a NEEDS_RECONCILE
            // intent that nobody else was given since.
            let legit = grant.holder == w
                && !grant.voided
                && matches!(before, St::Leased | St::Submitted | St::NeedsReconcile);
            if !legit {
                s.violations |= V_ACK_NOT_FROM_HOLDER;
            }
        }
        if report == Report::Ack && answered_ok && after != St::Delivered {
            s.violations |= V_ACK_OK_NOT_DELIVERED;
        }
        if let Report::Fail(outcome) = report {
            let where_it_puts = match outcome {
                Outcome::Retry => after == St::Pending || (after == St::DeadLettered && used_up),
                Outcome::Permanent => after == St::DeadLettered,
                Outcome::Unknown => after == St::NeedsReconcile,
            };
            if answered_ok && !where_it_puts {
                s.violations |= V_FAIL_OK_ELSEWHERE;
            }
        }
        if report == Report::Ack && applied {
            // `outbox.ack`: the next intent of its key takes its place.
            Protocol::advance(s);
        }
    }

    /// `outbox.advance_keys`: if the key has no head, its first WAITING row becomes PENDING,
    /// due at once.
    fn advance(s: &mut State) {
        if s.rows.iter().any(Row::heads_key) {
            return;
        }
        if let Some(next) = s
            .rows
            .iter_mut()
            .find(|r| r.ordered && r.state == St::Waiting)
        {
            next.state = St::Pending;
            next.due = true;
        }
    }

    /// `rescue_expired_leases` for one row.
    fn rescue(&self, s: &mut State, i: usize) {
        let max = self.max_attempts;
        let row = &mut s.rows[i];
        row.claim_req = None;
        if row.state == St::Submitted {
            // The holder may still learn and report the outcome: its lease stays.
            row.state = St::NeedsReconcile;
        } else {
            row.state = if row.attempts >= max {
                St::DeadLettered
            } else {
                St::Pending
            };
            row.due = false;
            row.column = Column::Null;
            row.grant.as_mut().unwrap().voided = true;
        }
    }

    /// `resolve_intents` by id for one row, then `advance_keys` for its key.
    fn reconcile(s: &mut State, i: usize, d: Decision) {
        let row = &mut s.rows[i];
        row.state = match d {
            Decision::Delivered => St::Delivered,
            // An ordered one takes its place in its key again.
            Decision::Requeue if row.ordered => St::Waiting,
            Decision::Requeue => St::Pending,
            Decision::Dead => St::DeadLettered,
        };
        row.released = row.ordered && d == Decision::Dead;
        row.done |= d != Decision::Requeue;
        if d == Decision::Requeue {
            row.attempts = 0;
            row.due = true;
        }
        row.column = Column::Null;
        row.ambiguous = false;
        if let Some(g) = row.grant.as_mut() {
            g.voided = true;
        }
        if row.ordered {
            Protocol::advance(s);
        }
    }
}

impl Protocol {
    /// One representative of the states that behave alike, so that the exploration counts
    /// each once: fields that no transition or property reads in a row's state are reset;
    /// the two workers are interchangeable; and so are rows, unless a producer refers to
    /// one by its slot.
    fn canonical(&self, mut s: State) -> State {
        for row in s.rows.iter_mut() {
            if row.state != St::Pending {
                row.due = false;
            }
            if row.state != St::DeadLettered {
                row.released = false;
            }
            let held = matches!(row.state, St::Leased | St::Submitted);
            if !held {
                // leases_of_request only returns LEASED or SUBMITTED rows.
                row.claim_req = None;
                if let Some(g) = row.grant.as_mut() {
                    // No ExtendLease applies any more: only "is it over" matters.
                    let over = g.expired || g.relinquished;
                    g.expired = over;
                    g.relinquished = over;
                }
            }
        }
        // Producers refer to rows by slot; workers are always interchangeable.
        // So are ordered ones, by their place in the key.
        let rows_interchangeable =
            !self.token_producer && !self.direct_producer && self.ordered_rows == 0;
        let mut best = s.clone();
        if rows_interchangeable {
            best.rows.sort_by_key(|r| (r.state == St::Absent, *r));
        }
        if self.workers == 2 {
            let mut swapped = s;
            let other = |w: u8| 1 - w;
            for row in swapped.rows.iter_mut() {
                row.claim_req = row.claim_req.map(other);
                if let Some(g) = row.grant.as_mut() {
                    g.holder = other(g.holder);
                }
            }
            swapped.outstanding.swap(0, 1);
            if rows_interchangeable {
                swapped.rows.sort_by_key(|r| (r.state == St::Absent, *r));
            }
            best = best.min(swapped);
        }
        best
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut rows = [Row::ABSENT; MAX_ROWS];
        for row in rows.iter_mut().take(self.direct_rows as usize) {
            *row = Row::new(St::Pending, Origin::Direct);
        }
        let ordered = rows.iter_mut().skip(self.direct_rows as usize);
        for (k, row) in ordered.take(self.ordered_rows as usize).enumerate() {
            let state = if k == 0 { St::Pending } else { St::Waiting };
            *row = Row {
                ordered: true,
                ..Row::new(state, Origin::Direct)
            };
        }
        vec![State {
            rows,
            txn: if self.token_producer {
                Txn::Open
            } else {
                Txn::Committed
            },
            requests: if self.token_producer {
                [Request::Unsent; 2]
            } else {
                [Request::Err; 2]
            },
            direct: if self.direct_producer {
                Direct::Unsent
            } else {
                Direct::Ok(u8::MAX)
            },
            outstanding: [false; MAX_WORKERS],
            violations: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.txn == Txn::Open {
            if s.requests.iter().any(|r| matches!(r, Request::Ok(_))) {
                actions.push(Action::Commit);
            }
            actions.push(Action::Rollback);
            actions.push(Action::ProducerCrash);
        }
        for (r, request) in s.requests.iter().enumerate() {
            let r = r as u8;
            match request {
                // The second copy is a retry or a duplicate: only once the first was sent.
                Request::Unsent if r == 0 || s.requests[0] != Request::Unsent => {
                    actions.push(Action::EnqueueCheck(r))
                }
                Request::Checked => {
                    actions.push(Action::EnqueueInsert(r));
                    actions.push(Action::EnqueueDropped(r));
                }
                _ => {}
            }
        }
        if matches!(s.direct, Direct::Unsent | Direct::KeyInUse) {
            actions.push(Action::DirectEnqueue);
        }
        for (i, row) in s.rows.iter().enumerate() {
            let i8 = i as u8;
            match row.state {
                St::Staged if s.txn != Txn::Open => actions.push(Action::Promote(i8)),
                St::Pending if !row.due => actions.push(Action::Due(i8)),
                St::Pending => {
                    for w in 0..self.workers {
                        actions.push(Action::Claim {
                            worker: w,
                            row: i8,
                            lost: false,
                        });
                        if self.lost_claims {
                            actions.push(Action::Claim {
                                worker: w,
                                row: i8,
                                lost: true,
                            });
                        }
                    }
                }
                _ => {}
            }
            if let Some(g) = row.grant {
                let matters_to_server =
                    matches!(row.state, St::Leased | St::Submitted) && row.column == Column::Last;
                if !g.expired && (matters_to_server || !g.relinquished) {
                    actions.push(Action::Expire(i8));
                }
                if matters_to_server && g.expired {
                    actions.push(Action::Rescue(i8));
                }
                if g.known {
                    for report in REPORTS {
                        actions.push(Action::Report {
                            worker: g.holder,
                            row: i8,
                            stale: false,
                            report,
                        });
                    }
                    if !g.relinquished {
                        actions.push(Action::ReportLost {
                            worker: g.holder,
                            row: i8,
                        });
                    }
                }
            }
            for w in 0..self.workers {
                if row.grant.is_some() {
                    for report in REPORTS {
                        actions.push(Action::Report {
                            worker: w,
                            row: i8,
                            stale: true,
                            report,
                        });
                    }
                }
            }
            for d in DECISIONS {
                let allowed = match d {
                    Decision::Delivered | Decision::Requeue => {
                        matches!(row.state, St::NeedsReconcile | St::DeadLettered)
                    }
                    // Also on a dead letter that holds its ordering key: releases the key.
                    Decision::Dead => {
                        row.state == St::NeedsReconcile
                            || (row.state == St::DeadLettered && row.ordered && !row.released)
                    }
                };
                if allowed {
                    actions.push(Action::Reconcile(i8, d));
                }
            }
        }
        for w in 0..self.workers {
            if s.outstanding[w as usize] {
                actions.push(Action::RetryClaim(w));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Commit => s.txn = Txn::Committed,
            Action::Rollback | Action::ProducerCrash => s.txn = Txn::Aborted,
            Action::EnqueueCheck(r) => {
                s.requests[r as usize] = match s.txn {
                    Txn::Open => Request::Checked,
                    Txn::Aborted => Request::Err,
                    // Only a replay of an enqueue recorded with this transaction is accepted.
                    Txn::Committed => match Protocol::token_row(&s) {
                        Some(i) => Request::Ok(i as u8),
                        None => Request::Err,
                    },
                };
            }
            Action::EnqueueInsert(r) => {
                // The insert runs whatever the transaction did meanwhile.
                s.requests[r as usize] = match Protocol::key_holder(&s) {
                    // Staged by this very transaction: deduplicated. (Held by another
                    // transaction's STAGED intent would be KEY_IN_USE; only T stages here.)
                    Some(i) => Request::Ok(i as u8),
                    None => {
                        let i = Protocol::free_slot(&s)?;
                        s.rows[i] = Row {
                            key_k: true,
                            ..Row::new(St::Staged, Origin::Token)
                        };
                        Request::Ok(i as u8)
                    }
                };
            }
            Action::EnqueueDropped(r) => s.requests[r as usize] = Request::Err,
            Action::DirectEnqueue => {
                s.direct = match Protocol::key_holder(&s) {
                    Some(i) if s.rows[i].state == St::Staged => Direct::KeyInUse,
                    Some(i) => Direct::Ok(i as u8),
                    None => {
                        let i = Protocol::free_slot(&s)?;
                        s.rows[i] = Row {
                            key_k: true,
                            ..Row::new(St::Pending, Origin::Direct)
                        };
                        Direct::Ok(i as u8)
                    }
                };
            }
            Action::Promote(i) => {
                let row = &mut s.rows[i as usize];
                row.state = match s.txn {
                    Txn::Committed => St::Pending,
                    Txn::Aborted => St::Discarded,
                    Txn::Open => unreachable!(),
                };
                row.due = true;
            }
            Action::Claim { worker, row, lost } => {
                // A new request id: markers of an abandoned lost claim no longer match.
                for r in s.rows.iter_mut() {
                    if r.claim_req == Some(worker) {
                        r.claim_req = None;
                    }
                }
                Protocol::lease(&mut s, worker, row as usize, lost);
                s.outstanding[worker as usize] = lost;
            }
            Action::RetryClaim(w) => {
                s.outstanding[w as usize] = false;
                // leases_of_request: this worker and request id, LEASED or SUBMITTED.
                let mut found = false;
                for r in s.rows.iter_mut() {
                    if r.claim_req == Some(w) && matches!(r.state, St::Leased | St::Submitted) {
                        r.grant.as_mut().unwrap().known = true;
                        found = true;
                    }
                    if r.claim_req == Some(w) {
                        r.claim_req = None;
                    }
                }
                if !found {
                    // Nothing left of the first attempt: the retry leases afresh. (Any due
                    // row; the first one stands for all, the others are Claim's choices.)
                    if let Some(i) = s.rows.iter().position(|r| r.state == St::Pending && r.due) {
                        Protocol::lease(&mut s, w, i, false);
                    }
                }
            }
            Action::Report {
                worker,
                row,
                stale,
                report,
            } => self.report(&mut s, worker, row as usize, stale, report),
            Action::ReportLost { row, .. } => {
                s.rows[row as usize].grant.as_mut().unwrap().relinquished = true;
            }
            Action::Expire(i) => s.rows[i as usize].grant.as_mut().unwrap().expired = true,
            Action::Due(i) => s.rows[i as usize].due = true,
            Action::Rescue(i) => self.rescue(&mut s, i as usize),
            Action::Reconcile(i, d) => Protocol::reconcile(&mut s, i as usize, d),
        }
        Some(self.canonical(s))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("no two live leases on one intent", |_, s: &State| {
                s.violations & V_TWO_LIVE_LEASES == 0
            }),
            Property::always("a stale lease's Ack or Fail is rejected", |_, s: &State| {
                s.violations & V_STALE_REPORT_ACCEPTED == 0
            }),
            Property::always(
                "an Ack is applied only from the live lease or the last lease of NEEDS_RECONCILE",
                |_, s: &State| s.violations & V_ACK_NOT_FROM_HOLDER == 0,
            ),
            Property::always(
                "a SUBMITTED intent is leased again only after its holder's outcome or an operator",
                |_, s: &State| {
                    s.violations & V_AMBIGUOUS_RELEASED == 0
                        && s.rows
                            .iter()
                            .all(|r| !(r.ambiguous && r.state == St::Pending))
                },
            ),
            Property::always("an OK to Ack means DELIVERED", |_, s: &State| {
                s.violations & V_ACK_OK_NOT_DELIVERED == 0
            }),
            Property::always(
                "an intent of an aborted transaction is never claimable",
                |_, s: &State| {
                    s.rows.iter().all(|r| {
                        r.origin != Origin::Token
                            || s.txn == Txn::Committed
                            || (matches!(r.state, St::Absent | St::Staged | St::Discarded)
                                && r.grant.is_none())
                    })
                },
            ),
            Property::always(
                "an intent of a committed transaction or a direct enqueue is never discarded",
                |_, s: &State| {
                    let direct_ok = match s.direct {
                        Direct::Ok(i) if (i as usize) < MAX_ROWS => {
                            s.rows[i as usize].state != St::Discarded
                        }
                        _ => true,
                    };
                    direct_ok
                        && s.rows.iter().all(|r| {
                            r.state != St::Discarded
                                || (r.origin == Origin::Token && s.txn == Txn::Aborted)
                        })
                },
            ),
        ];
        if self.ordered_rows > 0 {
            properties.push(Property::always(
                "no two live leases of one ordering key",
                |_, s: &State| {
                    s.violations & V_KEY_TWO_LIVE_LEASES == 0
                        && s.rows.iter().filter(|r| r.heads_key()).count() <= 1
                },
            ));
            properties.push(Property::always(
                "an intent of a key is never leased before the earlier ones are finished \
                 (their final Ack, or an operator's DELIVERED or DEAD)",
                |_, s: &State| s.violations & V_KEY_OUT_OF_ORDER == 0,
            ));
            properties.push(Property::always(
                "a key with WAITING intents has a head",
                |_, s: &State| {
                    !s.rows.iter().any(|r| r.state == St::Waiting)
                        || s.rows.iter().any(Row::heads_key)
                },
            ));
        }
        // Examples the exploration must reach, so that the properties above are not
        // vacuous for this configuration.
        if self.workers > 1 && self.direct_rows > 0 {
            properties.push(Property::sometimes(
                "both workers hold leases at once",
                |_, s: &State| {
                    (0..2).all(|w| {
                        s.rows.iter().any(|r| {
                            matches!(r.state, St::Leased | St::Submitted)
                                && r.grant.is_some_and(|g| g.holder == w && g.live())
                        })
                    })
                },
            ));
        }
        if self.direct_rows > 0 {
            properties.push(Property::sometimes(
                "an expired SUBMITTED lease awaits an operator while its holder may still report",
                |_, s: &State| {
                    s.rows.iter().any(|r| {
                        r.state == St::NeedsReconcile
                            && r.column == Column::Last
                            && r.grant.is_some_and(|g| g.expired && g.known)
                    })
                },
            ));
            properties.push(Property::sometimes(
                "an intent rescued before its side effect ran out of attempts",
                |m: &Protocol, s: &State| {
                    s.rows.iter().any(|r| {
                        r.state == St::DeadLettered
                            && r.attempts >= m.max_attempts
                            && r.grant.is_some_and(|g| g.voided && g.expired)
                    })
                },
            ));
        }
        if self.ordered_rows > 1 {
            // The key's first two intents.
            fn pair(m: &Protocol, s: &State) -> (Row, Row) {
                let first = m.direct_rows as usize;
                (s.rows[first], s.rows[first + 1])
            }
            properties.push(Property::sometimes(
                "the second intent of the key is leased once the first was acked",
                |m: &Protocol, s: &State| {
                    let (first, second) = pair(m, s);
                    // An Ack leaves the lease in the column; an operator's decision clears it.
                    first.state == St::Delivered
                        && first.column == Column::Last
                        && second.state == St::Leased
                },
            ));
            properties.push(Property::sometimes(
                "the head is leased again while the second waits",
                |m: &Protocol, s: &State| {
                    let (first, second) = pair(m, s);
                    first.state == St::Leased && first.attempts > 1 && second.state == St::Waiting
                },
            ));
            properties.push(Property::sometimes(
                "a dead-lettered head holds its key",
                |m: &Protocol, s: &State| {
                    let (first, second) = pair(m, s);
                    first.state == St::DeadLettered
                        && !first.released
                        && second.state == St::Waiting
                },
            ));
            properties.push(Property::sometimes(
                "a head given up and requeued waits behind the second",
                |m: &Protocol, s: &State| {
                    let (first, second) = pair(m, s);
                    first.state == St::Waiting && first.done && second.state == St::Leased
                },
            ));
        }
        if self.lost_claims {
            properties.push(Property::sometimes(
                "a lease whose Claim response was lost is still held",
                |_, s: &State| {
                    s.rows
                        .iter()
                        .any(|r| r.state == St::Leased && r.grant.is_some_and(|g| !g.known))
                },
            ));
        }
        if self.token_producer {
            properties.push(Property::sometimes(
                "a committed token intent is delivered",
                |_, s: &State| {
                    s.txn == Txn::Committed
                        && s.rows
                            .iter()
                            .any(|r| r.origin == Origin::Token && r.state == St::Delivered)
                },
            ));
            properties.push(Property::sometimes(
                "the token insert lands after the producer rolled back",
                |_, s: &State| {
                    s.txn == Txn::Aborted
                        && s.requests.iter().any(|r| matches!(r, Request::Ok(_)))
                        && s.rows.iter().any(|r| r.state == St::Staged)
                },
            ));
            properties.push(Property::sometimes(
                "an aborted transaction's intent is discarded",
                |_, s: &State| s.rows.iter().any(|r| r.state == St::Discarded),
            ));
        }
        if self.token_producer && self.direct_producer {
            properties.push(Property::sometimes(
                "the direct producer is refused while the key is held by a STAGED intent",
                |_, s: &State| s.direct == Direct::KeyInUse,
            ));
            properties.push(Property::sometimes(
                "the direct producer is deduplicated onto the committed token intent",
                |_, s: &State| match s.direct {
                    Direct::Ok(i) if (i as usize) < MAX_ROWS => {
                        s.rows[i as usize].origin == Origin::Token
                    }
                    _ => false,
                },
            ));
            properties.push(Property::sometimes(
                "the token producer is deduplicated onto the direct intent",
                |_, s: &State| {
                    s.requests.iter().any(|r| {
                        matches!(r, Request::Ok(i) if s.rows[*i as usize].origin == Origin::Direct)
                    })
                },
            ));
        }
        properties
    }
}

/// The rule behind `V_FAIL_OK_ELSEWHERE`: see
/// `a_fail_replay_is_answered_ok_only_where_its_outcome_put_the_intent`.
fn fail_answered_ok_elsewhere(s: &State) -> bool {
    s.violations & V_FAIL_OK_ELSEWHERE != 0
}

/// Every intent that must be delivered (a direct one, or one whose transaction committed)
/// is delivered, dead-lettered or awaits an operator; every intent of an aborted
/// transaction is discarded; no producer is mid-call.
fn settled(s: &State, delivered_only: bool) -> bool {
    let requests_done = s.requests.iter().all(|r| *r != Request::Checked);
    let direct_done = matches!(s.direct, Direct::Ok(_));
    s.txn != Txn::Open
        && requests_done
        && direct_done
        && s.rows.iter().all(|r| match r.state {
            St::Absent => true,
            _ if r.origin == Origin::Token && s.txn == Txn::Aborted => r.state == St::Discarded,
            St::Delivered => true,
            St::DeadLettered | St::NeedsReconcile => !delivered_only,
            _ => false,
        })
}

/// The reachable state graph, explored breadth first (for the liveness check, which
/// stateright's `eventually` does not decide on graphs with cycles).
struct Graph {
    model: Protocol,
    states: Vec<State>,
    index: HashMap<State, u32>,
    /// BFS tree: the predecessor of each state and the action taken.
    parent: Vec<Option<(u32, Action)>>,
    predecessors: Vec<Vec<u32>>,
}

fn explore(model: &Protocol) -> Graph {
    let mut graph = Graph {
        model: model.clone(),
        index: HashMap::new(),
        states: Vec::new(),
        parent: Vec::new(),
        predecessors: Vec::new(),
    };
    let mut queue = VecDeque::new();
    for init in model.init_states() {
        let at = graph.states.len() as u32;
        graph.index.insert(init.clone(), at);
        graph.states.push(init);
        graph.parent.push(None);
        graph.predecessors.push(Vec::new());
        queue.push_back(at);
    }
    let mut actions = Vec::new();
    while let Some(at) = queue.pop_front() {
        let state = graph.states[at as usize].clone();
        actions.clear();
        model.actions(&state, &mut actions);
        for &action in &actions {
            let Some(next) = model.next_state(&state, action) else {
                continue;
            };
            let to = match graph.index.get(&next) {
                Some(&to) => to,
                None => {
                    let to = graph.states.len() as u32;
                    graph.index.insert(next.clone(), to);
                    graph.states.push(next);
                    graph.parent.push(Some((at, action)));
                    graph.predecessors.push(Vec::new());
                    queue.push_back(to);
                    to
                }
            };
            graph.predecessors[to as usize].push(at);
        }
    }
    graph
}

impl Graph {
    /// The state `action` leads to from state `from`.
    fn step(&self, from: u32, action: Action) -> u32 {
        let next = self
            .model
            .next_state(&self.states[from as usize], action)
            .expect("a recorded step");
        self.index[&next]
    }

    /// The actions from the initial state to `to`.
    fn path(&self, mut to: u32) -> Vec<Action> {
        let mut path = Vec::new();
        while let Some((from, action)) = self.parent[to as usize] {
            path.push(action);
            to = from;
        }
        path.reverse();
        path
    }

    /// The first state (in BFS order) from which no state satisfying `goal` is reachable.
    fn stuck(&self, goal: impl Fn(&State) -> bool) -> Option<u32> {
        let mut can_reach = vec![false; self.states.len()];
        let mut queue: VecDeque<u32> = VecDeque::new();
        for (i, s) in self.states.iter().enumerate() {
            if goal(s) {
                can_reach[i] = true;
                queue.push_back(i as u32);
            }
        }
        while let Some(at) = queue.pop_front() {
            for &p in &self.predecessors[at as usize] {
                if !can_reach[p as usize] {
                    can_reach[p as usize] = true;
                    queue.push_back(p);
                }
            }
        }
        can_reach.iter().position(|&ok| !ok).map(|i| i as u32)
    }
}

/// A step of a trace: the action, then every row as `slot:state/attempts` with its lease
/// (`L` recorded in the column, `w0`/`w1` its holder, `live` or `over`).
fn describe(s: &State) -> String {
    let rows: Vec<String> = s
        .rows
        .iter()
        .enumerate()
        .filter(|(_, r)| r.state != St::Absent)
        .map(|(i, r)| {
            let lease = match r.grant {
                None => String::new(),
                Some(g) => format!(
                    " {}w{}{}{}",
                    if r.column == Column::Last { "L:" } else { "" },
                    g.holder,
                    if g.live() { " live" } else { " over" },
                    if g.known { "" } else { " unknown-to-holder" }
                ),
            };
            let key = match (r.ordered, r.released) {
                (false, _) => "",
                (true, false) => " key",
                (true, true) => " key released",
            };
            format!("{i}:{:?}/{}{key}{lease}", r.state, r.attempts)
        })
        .collect();
    let producers = if s.direct == Direct::Ok(u8::MAX) {
        String::new()
    } else {
        format!(
            "txn {:?}, token enqueues {:?}, direct enqueue {:?}, ",
            s.txn, s.requests, s.direct
        )
    };
    format!("{producers}rows [{}]", rows.join(", "))
}

fn trace(graph: &Graph, to: u32) -> String {
    let mut out = format!("  {}\n", describe(&graph.states[0]));
    let mut at = 0u32;
    for action in graph.path(to) {
        at = graph.step(at, action);
        out += &format!(
            "  -> {action:?}\n     {}\n",
            describe(&graph.states[at as usize])
        );
    }
    out
}

/// Model-checks one configuration: every property with stateright's BFS, then "from every
/// reachable state, every intent can still be settled (and delivered)" on the explored
/// graph. A violated property is reported with its shortest trace; the number of states
/// explored is printed (`cargo test protocol -- --nocapture`).
fn check(name: &str, model: Protocol) {
    let started = Instant::now();
    let checker = model.clone().checker().spawn_bfs().join();
    let unique = checker.unique_state_count();
    let total = checker.state_count();
    let depth = checker.max_depth();
    assert!(checker.is_done());
    let checked = started.elapsed();

    let graph = explore(&model);
    assert_eq!(
        graph.states.len(),
        unique,
        "both explorations see the same states"
    );
    for property in model.properties() {
        let found = checker.discovery(property.name).is_some();
        match property.expectation {
            Expectation::Always if found => {
                let bad = graph
                    .states
                    .iter()
                    .position(|s| !(property.condition)(&model, s))
                    .expect("the violating state is in the graph");
                panic!(
                    "{name}: \"{}\" is violated; shortest trace:\n{}",
                    property.name,
                    trace(&graph, bad as u32)
                );
            }
            Expectation::Sometimes if !found => {
                panic!("{name}: no reachable state shows \"{}\"", property.name)
            }
            _ => {}
        }
    }
    for (goal, delivered_only) in [("settled", false), ("delivered", true)] {
        if let Some(stuck) = graph.stuck(|s| settled(s, delivered_only)) {
            panic!(
                "{name}: no {goal} state is reachable from the last state of:\n{}",
                trace(&graph, stuck)
            );
        }
    }
    eprintln!(
        "protocol model {name}: {unique} states ({total} generated, depth {depth}) checked in \
         {checked:?}; liveness on the graph in {:?}",
        started.elapsed() - checked
    );
}

/// Two intents enqueued directly, two workers that lose Claim responses, retry them, send
/// stale, late and duplicated reports, and lose reports; lease expiry, rescue, backoff and
/// every operator decision.
#[test]
fn the_lease_protocol_keeps_its_guarantees_in_every_interleaving() {
    check(
        "leases",
        Protocol {
            workers: 2,
            max_attempts: 2,
            direct_rows: 2,
            ordered_rows: 0,
            token_producer: false,
            direct_producer: false,
            lost_claims: true,
        },
    );
}

/// A producer transaction that commits, rolls back or crashes around an Enqueue (sent
/// twice: a retry or a duplicate) whose status check and insert the commit may fall
/// between; a direct producer with the same idempotency key; the staged promotion; two
/// workers (losing Claim responses too) and an operator.
#[test]
fn the_two_phase_token_keeps_its_guarantees_in_every_interleaving() {
    check(
        "token",
        Protocol {
            workers: 2,
            max_attempts: 2,
            direct_rows: 0,
            ordered_rows: 0,
            token_producer: true,
            direct_producer: true,
            lost_claims: true,
        },
    );
}

/// Two intents of one ordering key, enqueued directly in this order: two workers that lose
/// Claim responses and send stale, late and lost reports, lease expiry, rescue, backoff and
/// every operator decision (DEAD on the dead-lettered head too, and REQUEUE of a head given
/// up). `outbox.advance_keys` moves the key on in the Ack or decision that finished the
/// head.
#[test]
fn an_ordering_key_keeps_its_guarantees_in_every_interleaving() {
    check(
        "ordering",
        Protocol {
            workers: 2,
            max_attempts: 2,
            direct_rows: 0,
            ordered_rows: 2,
            token_producer: false,
            direct_producer: false,
            lost_claims: true,
        },
    );
}

/// A Fail repeated with the same lease is answered OK only where that outcome put the
/// intent (the README's lost-response rule): after `Fail(RETRY)`, the same lease's
/// `Fail(PERMANENT)` or `Fail(UNKNOWN)` is refused. (This once was a deviation: the server
/// accepted any outcome as a replay.)
#[test]
fn a_fail_replay_is_answered_ok_only_where_its_outcome_put_the_intent() {
    let model = Protocol {
        workers: 1,
        max_attempts: 2,
        direct_rows: 1,
        ordered_rows: 0,
        token_producer: false,
        direct_producer: false,
        lost_claims: false,
    };
    let graph = explore(&model);
    if let Some(found) = graph.states.iter().position(fail_answered_ok_elsewhere) {
        panic!(
            "Fail answered OK where its outcome does not put the intent:\n{}",
            trace(&graph, found as u32)
        );
    }
}
