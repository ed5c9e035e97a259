//! Why a side effect was performed again: each duplicate delivery is traced to the fault
//! that made its lease end without an accepted Ack.

use super::leases::LeaseLife;
use crate::faults::{FaultKind, FaultRecord};
use crate::journal::Outcome;
use crate::processes::UnexpectedExit;

pub(super) const UNEXPLAINED: &str = "UNEXPLAINED";

/// Why the side effect performed under `l` was performed again under a later lease.
pub(super) fn duplicate_cause(
    l: &LeaseLife,
    faults: &[FaultRecord],
    exits: &[UnexpectedExit],
) -> &'static str {
    let until = l.ack.as_ref().map_or(i64::MAX, |a| a.1);
    let hit = |kind: FaultKind| {
        faults.iter().any(|f| {
            f.kind == kind && f.target == l.worker && f.start <= until && f.end >= l.claim_t
        })
    };
    // The service faults that may have held the Ack up: first those overlapping the Ack
    // call itself, then any since the claim.
    let overlapping = |from: i64| -> Vec<FaultKind> {
        faults
            .iter()
            .filter(|f| f.kind.disrupts_service() && f.start <= until && f.end >= from)
            .map(|f| f.kind)
            .collect()
    };
    let held_up = [l.ack_sent.unwrap_or(l.claim_t), l.claim_t]
        .into_iter()
        .find_map(|from| {
            let kinds = overlapping(from);
            HOLD_UP_PRIORITY.iter().find(|k| kinds.contains(k)).copied()
        });
    match &l.ack {
        Some((Outcome::Ok, _, _)) => "after an accepted Ack (violation)",
        _ if hit(FaultKind::WorkerStop) => {
            "worker SIGSTOPped past its lease; its late Ack was refused"
        }
        None if hit(FaultKind::WorkerKill) => {
            "worker SIGKILLed between the side effect and its Ack"
        }
        None if exits.iter().any(|e| e.name == l.worker) => {
            "worker exited between the side effect and its Ack"
        }
        None if l.fail_sent.is_some() => "outcome reported by Fail after the lease was lost",
        None => l.lost.map_or(UNEXPLAINED, |lost| lost_to(l, lost, faults)),
        Some(_) if held_up.is_some() => held_up_by(held_up.expect("checked")),
        Some((_, _, errors)) if !errors.is_empty() => {
            "Ack retried (lost response, replica or PostgreSQL down) until the lease had expired"
        }
        Some(_) => "lease expired under load before the Ack",
    }
}

/// A lease the worker found lost after its side effect, so it sent no Ack: explained only
/// by a service fault while it was held (its heartbeats or its Ack could not get through).
fn lost_to(l: &LeaseLife, lost: i64, faults: &[FaultRecord]) -> &'static str {
    let kinds: Vec<FaultKind> = faults
        .iter()
        .filter(|f| f.kind.disrupts_service() && f.start <= lost && f.end >= l.claim_t)
        .map(|f| f.kind)
        .collect();
    match HOLD_UP_PRIORITY.iter().find(|k| kinds.contains(k)) {
        Some(FaultKind::OutboxdStop) => "lease lost: heartbeats held by a frozen replica",
        Some(FaultKind::LockStall) => "lease lost: heartbeats blocked behind a row-lock stall",
        Some(FaultKind::PostgresCrash) => "lease lost: heartbeats held up by the PostgreSQL crash",
        Some(FaultKind::OutboxdKill) => "lease lost: heartbeats held up by a killed replica",
        Some(FaultKind::LostResponses) => "lease lost: heartbeat responses lost",
        Some(_) => "lease lost: heartbeats held up by terminated sessions",
        None if kinds.contains(&FaultKind::CancelStorm) => "lease lost during a cancel storm",
        None => UNEXPLAINED,
    }
}

/// Which fault to blame first when several overlap a late Ack: the most direct cause.
const HOLD_UP_PRIORITY: [FaultKind; 6] = [
    FaultKind::OutboxdStop,
    FaultKind::LockStall,
    FaultKind::PostgresCrash,
    FaultKind::OutboxdKill,
    FaultKind::LostResponses,
    FaultKind::OutboxdSessionsKilled,
];

fn held_up_by(kind: FaultKind) -> &'static str {
    match kind {
        FaultKind::OutboxdStop => "Ack held by a frozen replica (SIGSTOP) past the lease",
        FaultKind::LockStall => "Ack blocked behind a row-lock stall past the lease",
        FaultKind::PostgresCrash => "Ack held up by the PostgreSQL crash past the lease",
        FaultKind::OutboxdKill => "Ack held up by a killed replica past the lease",
        FaultKind::LostResponses => "Ack response lost; the retry came after the lease",
        _ => "Ack held up by terminated sessions past the lease",
    }
}
