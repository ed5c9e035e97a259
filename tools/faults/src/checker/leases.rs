//! The workers' side: every lease rebuilt from the journals, then checked in order per
//! intent (no overlap, SUBMITTED never re-handed, stale settlements refused, the holder's
//! own ones accepted), and every final state explained by what the workers did.

use std::collections::HashMap;

use uuid::Uuid;

use super::duplicates::{UNEXPLAINED, duplicate_cause};
use super::producers::Produced;
use super::{CLOCK_TOLERANCE_US, Guarantee, Observations, Verdict, count_errors, count_retry};
use crate::cluster::{IntentRow, Snapshot};
use crate::faults::FaultRecord;
use crate::journal::{Event, FailKind, Outcome};
use crate::processes::UnexpectedExit;

/// What one lease went through, from every journal line naming it.
#[derive(Debug, Clone)]
pub(super) struct LeaseLife {
    pub(super) worker: String,
    pub(super) intent: Uuid,
    pub(super) lease: Uuid,
    pub(super) attempt: i32,
    /// Client time the Claim answered.
    pub(super) claim_t: i64,
    /// Server time the lease was minted.
    pub(super) claimed_at: i64,
    pub(super) expires: i64,
    /// Latest expiry an ExtendLease answered OK set. An attempt without an answer is no
    /// evidence: it may have been refused (the lease had been rescued) or never arrived.
    pub(super) extended_until: i64,
    pub(super) mark_sent: bool,
    pub(super) marked: Option<Outcome>,
    pub(super) performed: Option<i64>,
    pub(super) ack_sent: Option<i64>,
    pub(super) ack: Option<(Outcome, i64, Vec<String>)>,
    pub(super) fail_sent: Option<(FailKind, i64)>,
    pub(super) fail: Option<(FailKind, Outcome)>,
    /// When the worker found it lost (and reported nothing more for it).
    pub(super) lost: Option<i64>,
}

impl LeaseLife {
    /// The latest instant this lease may have been live.
    pub(super) fn end(&self) -> i64 {
        self.expires.max(self.extended_until)
    }

    pub(super) fn describe(&self) -> String {
        format!(
            "lease {} (attempt {}, {}, minted {}, live until {})",
            short(self.lease),
            self.attempt,
            self.worker,
            super::clock(self.claimed_at),
            super::clock(self.end())
        )
    }
}

fn short(id: Uuid) -> String {
    id.to_string()[..8].to_owned()
}

pub(super) fn collect_leases(obs: &Observations, v: &mut Verdict) -> HashMap<Uuid, LeaseLife> {
    let mut leases: HashMap<Uuid, LeaseLife> = HashMap::new();
    for (worker, events) in &obs.workers {
        for event in events {
            if let Event::Claimed {
                t,
                duration_ms,
                tries,
                errors,
                last_try,
                leases: seen,
                ..
            } = event
            {
                count_retry(v, "Claim", *tries);
                count_errors(v, errors);
                for s in seen {
                    v.counts.handed_off += u64::from(s.handed_off);
                    let minted = s.expires - duration_ms * 1000;
                    if *tries > 1 && minted + CLOCK_TOLERANCE_US < *last_try {
                        v.counts.claim_replays += 1;
                    }
                    if let Some(other) = leases.get(&s.lease) {
                        v.violate(
                            Guarantee::NoOverlappingLeases,
                            Some(s.intent),
                            format!(
                                "lease {} returned to two claims ({} and {worker})",
                                s.lease, other.worker
                            ),
                        );
                        continue;
                    }
                    if s.state != "INTENT_STATE_LEASED" && s.state != "INTENT_STATE_SUBMITTED" {
                        v.violate(
                            Guarantee::Consistency,
                            Some(s.intent),
                            format!("Claim returned it in state {}", s.state),
                        );
                    }
                    leases.insert(
                        s.lease,
                        LeaseLife {
                            worker: worker.clone(),
                            intent: s.intent,
                            lease: s.lease,
                            attempt: s.attempt,
                            claim_t: *t,
                            claimed_at: s.expires - duration_ms * 1000,
                            expires: s.expires,
                            extended_until: s.expires,
                            mark_sent: false,
                            marked: None,
                            performed: None,
                            ack_sent: None,
                            ack: None,
                            fail_sent: None,
                            fail: None,
                            lost: None,
                        },
                    );
                }
                continue;
            }
            let Some(lease_id) = lease_of(event) else {
                continue;
            };
            let Some(l) = leases.get_mut(&lease_id) else {
                v.violate(
                    Guarantee::Consistency,
                    None,
                    format!("{worker} journaled {event:?} for a lease it never claimed"),
                );
                continue;
            };
            match event {
                Event::MarkSent { .. } => l.mark_sent = true,
                Event::Marked { result, tries, .. } => {
                    l.marked = Some(result.clone());
                    count_retry(v, "MarkSubmitted", *tries);
                }
                Event::Extended {
                    expires: Some(e), ..
                } => l.extended_until = l.extended_until.max(*e),
                Event::Performed { t, .. } => {
                    v.counts.performed += 1;
                    if l.performed.replace(*t).is_some() {
                        v.violate(
                            Guarantee::Consistency,
                            Some(l.intent),
                            "the worker performed twice under one lease",
                        );
                    }
                }
                Event::AckSent { t, .. } => {
                    l.ack_sent.get_or_insert(*t);
                }
                Event::Acked {
                    t,
                    result,
                    tries,
                    errors,
                    via,
                    ..
                } => {
                    if let Some((replica, took)) = via {
                        v.counts
                            .ack_latency
                            .entry(*replica)
                            .or_default()
                            .push(*took);
                    }
                    count_retry(v, "Ack", *tries);
                    count_errors(v, errors);
                    match result {
                        Outcome::Ok => v.counts.acks_ok += 1,
                        Outcome::LeaseLost => v.counts.acks_lease_lost += 1,
                        _ => v.counts.acks_unknown += 1,
                    }
                    l.ack = Some((result.clone(), *t, errors.clone()));
                }
                Event::FailSent { t, outcome, .. } => {
                    l.fail_sent.get_or_insert((*outcome, *t));
                }
                Event::Failed {
                    outcome,
                    result,
                    tries,
                    ..
                } => {
                    count_retry(v, "Fail", *tries);
                    if *result == Outcome::LeaseLost {
                        v.counts.fails_lease_lost += 1;
                    }
                    l.fail = Some((*outcome, result.clone()));
                }
                Event::LeaseLost { t, .. } => {
                    v.counts.lost += 1;
                    l.lost.get_or_insert(*t);
                }
                _ => {}
            }
        }
    }
    v.counts.leases = leases.len() as u64;
    leases
}

fn lease_of(event: &Event) -> Option<Uuid> {
    match event {
        Event::MarkSent { lease, .. }
        | Event::Marked { lease, .. }
        | Event::Extended { lease, .. }
        | Event::LeaseLost { lease, .. }
        | Event::Performed { lease, .. }
        | Event::AckSent { lease, .. }
        | Event::Acked { lease, .. }
        | Event::FailSent { lease, .. }
        | Event::Failed { lease, .. } => Some(*lease),
        _ => None,
    }
}

pub(super) fn check_leases(
    snapshot: &Snapshot,
    produced: &Produced,
    leases: &HashMap<Uuid, LeaseLife>,
    faults: &[FaultRecord],
    exits: &[UnexpectedExit],
    v: &mut Verdict,
) {
    let mut by_intent: HashMap<Uuid, Vec<&LeaseLife>> = HashMap::new();
    for l in leases.values() {
        by_intent.entry(l.intent).or_default().push(l);
    }
    for (intent, mut ls) in by_intent {
        ls.sort_by_key(|l| (l.attempt, l.claimed_at));
        let row = snapshot.intents.get(&intent);
        if row.is_none() {
            v.violate(
                Guarantee::Consistency,
                Some(intent),
                "claimed, but not in outbox.all_intents",
            );
        }
        if produced.aborted.contains(&intent) {
            let performed = ls.iter().any(|l| l.performed.is_some());
            v.violate(
                Guarantee::AbortedNeverClaimed,
                Some(intent),
                format!(
                    "its producer transaction aborted, yet {} claimed it{}",
                    ls[0].worker,
                    if performed {
                        " and the side effect was performed"
                    } else {
                        ""
                    }
                ),
            );
        }
        check_lease_sequence(intent, &ls, v);
        for (i, l) in ls.iter().enumerate() {
            check_settlement(intent, l, &ls[i + 1..], row, v);
        }
        let performances: Vec<&LeaseLife> = ls
            .iter()
            .copied()
            .filter(|l| l.performed.is_some())
            .collect();
        if let Some((_, earlier)) = performances.split_last() {
            for l in earlier {
                let cause = duplicate_cause(l, faults, exits);
                if cause == UNEXPLAINED {
                    v.violate(
                        Guarantee::DuplicatesExplained,
                        Some(intent),
                        format!(
                            "performed under {} and again later; no fault explains it",
                            l.describe()
                        ),
                    );
                }
                *v.duplicates.entry(cause).or_default() += 1;
            }
        }
    }
}

/// Consecutive leases of one intent: distinct attempts, minted in order, never overlapping.
fn check_lease_sequence(intent: Uuid, ls: &[&LeaseLife], v: &mut Verdict) {
    for pair in ls.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        v.counts.lease_pairs += 1;
        if a.attempt == b.attempt {
            v.violate(
                Guarantee::NoOverlappingLeases,
                Some(intent),
                format!(
                    "two leases counted as the same attempt: {} and {}",
                    a.describe(),
                    b.describe()
                ),
            );
        }
        if b.claimed_at < a.claimed_at {
            v.violate(
                Guarantee::NoOverlappingLeases,
                Some(intent),
                format!(
                    "{} minted before the earlier attempt's {}",
                    b.describe(),
                    a.describe()
                ),
            );
        }
        // A lease ends when it expires (and is rescued) or when its holder fails it.
        let failed_before = a
            .fail_sent
            .is_some_and(|(_, t)| t <= b.claimed_at + CLOCK_TOLERANCE_US);
        if b.claimed_at < a.end() && !failed_before {
            v.violate(
                Guarantee::NoOverlappingLeases,
                Some(intent),
                format!(
                    "{} minted while {} was live and not failed",
                    b.describe(),
                    a.describe()
                ),
            );
        }
        // After MarkSubmitted only a definite outcome from the holder (or an operator)
        // frees the intent for another worker.
        let definite_fail_before = matches!(
            a.fail_sent,
            Some((FailKind::Retry | FailKind::Permanent, t)) if t <= b.claimed_at + CLOCK_TOLERANCE_US
        );
        if a.marked == Some(Outcome::Ok) && !definite_fail_before {
            v.violate(
                Guarantee::SubmittedNotReHanded,
                Some(intent),
                format!(
                    "marked SUBMITTED under {}, then handed out again as {}",
                    a.describe(),
                    b.describe()
                ),
            );
        }
        if a.fail == Some((FailKind::Unknown, Outcome::Ok)) {
            v.violate(
                Guarantee::SubmittedNotReHanded,
                Some(intent),
                format!(
                    "Fail UNKNOWN accepted for {}, then handed out again as {}",
                    a.describe(),
                    b.describe()
                ),
            );
        }
    }
}

/// An accepted Ack or Fail must have come from the current lease; a rejected one from a
/// stale lease.
fn check_settlement(
    intent: Uuid,
    l: &LeaseLife,
    later: &[&LeaseLife],
    row: Option<&IntentRow>,
    v: &mut Verdict,
) {
    if let Some((Outcome::Ok, _, _)) = &l.ack {
        if let Some(b) = later.first() {
            v.violate(
                Guarantee::StaleSettleRejected,
                Some(intent),
                format!(
                    "Ack of {} accepted, yet the intent was leased again as {}",
                    l.describe(),
                    b.describe()
                ),
            );
        }
        if let Some(row) = row
            && (row.state != "delivered" || row.lease_id != Some(l.lease))
        {
            v.violate(
                Guarantee::StaleSettleRejected,
                Some(intent),
                format!(
                    "Ack of {} accepted, but the intent ended {} with lease {:?}",
                    l.describe(),
                    row.state,
                    row.lease_id
                ),
            );
        }
    }
    if let (Some((kind, Outcome::Ok)), Some((_, sent))) = (&l.fail, l.fail_sent) {
        if let Some(b) = later
            .iter()
            .find(|b| b.claimed_at + CLOCK_TOLERANCE_US < sent)
        {
            v.violate(
                Guarantee::StaleSettleRejected,
                Some(intent),
                format!(
                    "Fail {kind:?} of {} accepted, though {} had been minted before it was sent",
                    l.describe(),
                    b.describe()
                ),
            );
        }
        if *kind == FailKind::Permanent
            && let Some(row) = row
            && later.is_empty()
            && row.state != "dead_lettered"
        {
            v.violate(
                Guarantee::Consistency,
                Some(intent),
                format!(
                    "Fail PERMANENT of {} accepted, but it ended {}",
                    l.describe(),
                    row.state
                ),
            );
        }
    }
    // A replayed Ack of an intent this lease delivered answers OK; the last holder of a
    // NEEDS_RECONCILE intent may still Ack it. Either refused is the holder refused.
    if let Some((Outcome::LeaseLost, _, errors)) = &l.ack
        && let Some(row) = row
        && row.lease_id == Some(l.lease)
    {
        let detail = match row.state.as_str() {
            "delivered" => format!(
                "Ack of {} answered LEASE_LOST, yet the intent is DELIVERED by this very lease: \
                 an earlier attempt applied and the retry ({} transient errors before it) was \
                 refused instead of answered OK as a replay",
                l.describe(),
                errors.len()
            ),
            "needs_reconcile" => format!(
                "Ack of {} answered LEASE_LOST, though it is the last holder of the \
                 NEEDS_RECONCILE intent",
                l.describe()
            ),
            _ => String::new(),
        };
        if !detail.is_empty() {
            v.violate(Guarantee::HolderAckRefused, Some(intent), detail);
        }
    }
}

/// Every final DEAD_LETTERED, NEEDS_RECONCILE and DELIVERED intent must be explained by
/// what workers did.
pub(super) fn check_final_states(
    snapshot: &Snapshot,
    leases: &HashMap<Uuid, LeaseLife>,
    v: &mut Verdict,
) {
    let mut of_intent: HashMap<Uuid, Vec<&LeaseLife>> = HashMap::new();
    for l in leases.values() {
        of_intent.entry(l.intent).or_default().push(l);
    }
    // The run's operator releases ordering keys: a NEEDS_RECONCILE head it decided DEAD
    // ends DEAD_LETTERED without a Fail PERMANENT.
    let decided_dead: std::collections::HashSet<Uuid> = snapshot
        .resolutions
        .iter()
        .filter(|r| r.decision == "dead")
        .map(|r| r.intent_id)
        .collect();
    let none = Vec::new();
    for row in snapshot.intents.values() {
        let ls = of_intent.get(&row.id).unwrap_or(&none);
        let performed = ls.iter().any(|l| l.performed.is_some());
        match row.state.as_str() {
            "delivered" if !performed => v.violate(
                Guarantee::Consistency,
                Some(row.id),
                "DELIVERED, but no worker performed its side effect",
            ),
            "dead_lettered" => {
                let failed = ls.iter().any(|l| {
                    matches!(l.fail_sent, Some((FailKind::Permanent, _)))
                        || matches!(l.fail_sent, Some((FailKind::Retry, _)) if row.attempts >= row.max_attempts)
                });
                if !failed && row.attempts < row.max_attempts && !decided_dead.contains(&row.id) {
                    v.violate(
                        Guarantee::Consistency,
                        Some(row.id),
                        format!(
                            "DEAD_LETTERED with {}/{} attempts and no Fail PERMANENT",
                            row.attempts, row.max_attempts
                        ),
                    );
                }
            }
            "needs_reconcile" => {
                let ambiguous = ls
                    .iter()
                    .any(|l| l.mark_sent || matches!(l.fail_sent, Some((FailKind::Unknown, _))));
                if !ambiguous {
                    v.violate(
                        Guarantee::Consistency,
                        Some(row.id),
                        format!(
                            "NEEDS_RECONCILE, but no worker marked it submitted or failed it UNKNOWN ({:?})",
                            row.last_error
                        ),
                    );
                }
                v.reconcile.push((row.id, performed));
            }
            _ => {}
        }
    }
    v.reconcile.sort();
}
