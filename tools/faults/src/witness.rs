//! The SDK worker's observer: each event of `outboxd-client`'s managed loop (a Claim
//! answered, a call naming a lease sent and answered, a lease found lost) as a journal
//! line, and each OK handed to the read-back. The journal records what the SDK did, so the
//! checker judges the SDK and the server together.

use std::sync::Arc;
use std::time::SystemTime;

use outboxd_client::{Answer, ClaimEvent, Error, LeaseCall, LeaseId, WorkerObserver, proto};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::journal::{Event, FailKind, Journal, LeaseSeen, Outcome, Settle, now_us, timestamp_us};
use crate::read_back::ReadBack;
use crate::rpc::{describe, is_transient, reason};

/// Journals the worker's events.
pub struct Witness {
    pub journal: Arc<Journal>,
    /// OKs to read back (none without a database URL).
    pub read_backs: Option<mpsc::UnboundedSender<ReadBack>>,
    /// The worker's endpoints are the replicas' rotated left by this much: undone, so the
    /// journal names the replica.
    pub rotation: usize,
    pub replicas: usize,
}

impl WorkerObserver for Witness {
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        let leases: Vec<LeaseSeen> = claim.leases.iter().filter_map(seen).collect();
        let tries = claim.attempts.count;
        if leases.is_empty() && tries <= 1 {
            return;
        }
        self.journal.log(&Event::Claimed {
            t: now_us(),
            request: claim.request_id.and_then(|id| id.parse().ok()),
            duration_ms: claim.lease_duration.as_millis() as i64,
            tries,
            errors: claim.attempts.retried.iter().map(describe).collect(),
            last_try: micros(claim.attempts.last_sent),
            leases,
        });
    }

    fn sending(&self, lease: LeaseId<'_>, call: LeaseCall) {
        let Some((intent, lease)) = ids(lease) else {
            return;
        };
        let t = now_us();
        let event = match call {
            LeaseCall::MarkSubmitted => Event::MarkSent { t, intent, lease },
            LeaseCall::Ack => Event::AckSent { t, intent, lease },
            LeaseCall::Fail(outcome) => Event::FailSent {
                t,
                intent,
                lease,
                outcome: fail_kind(outcome),
            },
            // Only an answered extension is evidence (see `Event::Extended`).
            _ => return,
        };
        self.journal.log(&event);
    }

    fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
        let Some((intent, lease)) = ids(lease) else {
            return;
        };
        let t = now_us();
        let result = outcome(answer);
        let tries = answer.attempts.count;
        let ok = result == Outcome::Ok;
        let (event, settle) = match call {
            LeaseCall::MarkSubmitted => (
                Event::Marked {
                    t,
                    intent,
                    lease,
                    result,
                    tries,
                },
                Settle::MarkSubmitted,
            ),
            LeaseCall::ExtendLease => {
                let expires = answer
                    .result
                    .ok()
                    .and_then(|r| r.lease_expires_at.as_ref())
                    .map(timestamp_us)
                    .filter(|_| ok);
                let event = Event::Extended {
                    t,
                    intent,
                    lease,
                    result,
                    expires,
                };
                self.journal.log(&event);
                return;
            }
            LeaseCall::Ack => {
                let (errors, via) = match answer.result {
                    Ok(_) => {
                        let a = answer.attempts;
                        let replica = (a.endpoint + self.rotation) % self.replicas;
                        let took = a.last_took.as_micros() as i64;
                        (
                            a.retried.iter().map(describe).collect(),
                            Some((replica, took)),
                        )
                    }
                    Err(error) => (vec![describe_error(error, tries)], None),
                };
                let event = Event::Acked {
                    t,
                    intent,
                    lease,
                    result,
                    tries,
                    errors,
                    via,
                };
                (event, Settle::Ack)
            }
            LeaseCall::Fail(kind) => (
                Event::Failed {
                    t,
                    intent,
                    lease,
                    outcome: fail_kind(kind),
                    result,
                    tries,
                },
                Settle::Fail,
            ),
            _ => return,
        };
        self.journal.log(&event);
        if ok && let Some(read_backs) = &self.read_backs {
            let _ = read_backs.send(ReadBack {
                call: settle,
                intent,
                lease,
            });
        }
    }

    fn lease_lost(&self, lease: LeaseId<'_>, why: &str) {
        let Some((intent, lease)) = ids(lease) else {
            return;
        };
        self.journal.log(&Event::LeaseLost {
            t: now_us(),
            intent,
            lease,
            why: why.to_owned(),
        });
    }
}

fn ids(lease: LeaseId<'_>) -> Option<(Uuid, Uuid)> {
    Some((lease.intent_id.parse().ok()?, lease.lease_id.parse().ok()?))
}

fn micros(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

fn fail_kind(outcome: proto::FailOutcome) -> FailKind {
    match outcome {
        proto::FailOutcome::Permanent => FailKind::Permanent,
        proto::FailOutcome::Unknown => FailKind::Unknown,
        _ => FailKind::Retry,
    }
}

/// The lease as the journal keeps it.
fn seen(lease: &proto::Lease) -> Option<LeaseSeen> {
    let intent = lease.intent.as_ref()?;
    Some(LeaseSeen {
        intent: intent.id.parse().ok()?,
        lease: lease.lease_id.parse().ok()?,
        kind: intent.kind.clone(),
        attempt: lease.attempt,
        expires: timestamp_us(lease.lease_expires_at.as_ref()?),
        state: intent.state().as_str_name().to_owned(),
        handed_off: lease.attempt == 1
            && intent.created_at.is_some()
            && intent.updated_at == intent.created_at,
    })
}

/// The per-lease outcome as the client saw it.
fn outcome(answer: &Answer<'_>) -> Outcome {
    match answer.result {
        Ok(proto::LeaseResult { error: None, .. }) => Outcome::Ok,
        Ok(proto::LeaseResult {
            error: Some(error), ..
        }) if error.reason == "LEASE_LOST" => Outcome::LeaseLost,
        Ok(proto::LeaseResult {
            error: Some(error), ..
        }) => Outcome::Rejected(error.reason.clone()),
        Err(error) => match error.status() {
            Some(status) if is_transient(status) => {
                Outcome::Unknown(describe_error(error, answer.attempts.count))
            }
            Some(status) => Outcome::Rejected(reason(status)),
            None => Outcome::Rejected(error.to_string()),
        },
    }
}

/// As `rpc::CallError::describe`: a call that got no definite answer says after how many
/// tries.
fn describe_error(error: &Error, tries: u32) -> String {
    match error.status() {
        Some(status) if is_transient(status) => {
            format!("no answer after {tries} tries: {}", describe(status))
        }
        Some(status) => describe(status),
        None => error.to_string(),
    }
}
