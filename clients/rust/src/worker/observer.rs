//! A hook on what the managed worker does with each lease, for journals, audits, metrics
//! and tests that must see the loop from outside: which leases a Claim returned, each call
//! naming a lease as it is sent and as it is answered, and each lease found lost.

use std::time::Duration;

use crate::connection::Attempts;
use crate::error::Error;
use crate::proto::{self, FailOutcome};

/// Told what a [`Worker`](crate::Worker) does, as it does it; set with
/// [`WorkerBuilder::observer`](crate::WorkerBuilder::observer). Every method has a no-op
/// default, so an observer implements only what it needs.
///
/// The methods are called on the worker's own tasks, in the order the worker acts (for
/// one lease: `claimed`, then `sending` and `answered` of each call, or `lease_lost`):
/// they must return quickly and not block. Hand slow work (a database write, a network
/// call) to a task of your own through a channel. A worker without an observer builds
/// none of these events.
///
/// ```no_run
/// # fn f(builder: outboxd_client::WorkerBuilder) -> outboxd_client::WorkerBuilder {
/// use outboxd_client::{Answer, LeaseCall, LeaseId, WorkerObserver};
///
/// struct Audit;
///
/// impl WorkerObserver for Audit {
///     fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
///         if call == LeaseCall::Ack && answer.is_ok() {
///             println!("{} delivered", lease.intent_id);
///         }
///     }
/// }
///
/// builder.observer(Audit)
/// # }
/// ```
pub trait WorkerObserver: Send + Sync + 'static {
    /// A Claim was answered (with or without leases), before any of its leases is
    /// handled.
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        let _ = claim;
    }

    /// A call naming `lease` is about to be sent (its first attempt; retries send the
    /// same request).
    fn sending(&self, lease: LeaseId<'_>, call: LeaseCall) {
        let _ = (lease, call);
    }

    /// The call naming `lease` ended: the server's result for this lease, or the error of
    /// the whole call (no answer within its budget, or a refusal).
    fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
        let _ = (lease, call, answer);
    }

    /// The worker found `lease` lost (a call answered that it is not ours, or its local
    /// expiry passed before an extension got through): its handler is cancelled and
    /// nothing more is reported for it. `why` says which.
    fn lease_lost(&self, lease: LeaseId<'_>, why: &str) {
        let _ = (lease, why);
    }
}

/// One observer shared by several workers.
impl<T: WorkerObserver + ?Sized> WorkerObserver for std::sync::Arc<T> {
    fn claimed(&self, claim: &ClaimEvent<'_>) {
        (**self).claimed(claim);
    }

    fn sending(&self, lease: LeaseId<'_>, call: LeaseCall) {
        (**self).sending(lease, call);
    }

    fn answered(&self, lease: LeaseId<'_>, call: LeaseCall, answer: &Answer<'_>) {
        (**self).answered(lease, call, answer);
    }

    fn lease_lost(&self, lease: LeaseId<'_>, why: &str) {
        (**self).lease_lost(lease, why);
    }
}

/// The intent and lease an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseId<'a> {
    /// The intent's id.
    pub intent_id: &'a str,
    /// The lease's fencing token.
    pub lease_id: &'a str,
}

impl<'a> LeaseId<'a> {
    pub(crate) fn new(intent_id: &'a str, lease_id: &'a str) -> Self {
        Self {
            intent_id,
            lease_id,
        }
    }
}

/// A call that names leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseCall {
    /// `MarkSubmitted`, from [`Job::submitting`](crate::Job::submitting).
    MarkSubmitted,
    /// A heartbeat's `ExtendLease`.
    ExtendLease,
    /// `Ack`: the handler returned `Ok`.
    Ack,
    /// `Fail` with this outcome.
    Fail(FailOutcome),
}

/// An answered Claim.
#[derive(Debug)]
#[non_exhaustive]
pub struct ClaimEvent<'a> {
    /// The Claim's `request_id` (`None`: a plain long poll, see
    /// [`WorkerBuilder::replay_claims`](crate::WorkerBuilder::replay_claims)).
    pub request_id: Option<&'a str>,
    /// The leases asked for (`max_intents`: the free slots it claimed for).
    pub max_intents: usize,
    /// The lease asked for.
    pub lease_duration: Duration,
    /// The leases, as the server sent them (possibly none).
    pub leases: &'a [proto::Lease],
    /// Its attempts (retried with the same `request_id`, if it has one).
    pub attempts: &'a Attempts,
}

/// How a call naming a lease ended, for that lease.
#[derive(Debug)]
#[non_exhaustive]
pub struct Answer<'a> {
    /// The server's result for the lease (its `error` unset when applied; the new
    /// `lease_expires_at` for `ExtendLease`), or the error of the whole call.
    pub result: Result<&'a proto::LeaseResult, &'a Error>,
    /// The call's attempts.
    pub attempts: &'a Attempts,
}

impl Answer<'_> {
    /// True when the server applied the call to this lease.
    pub fn is_ok(&self) -> bool {
        matches!(self.result, Ok(result) if result.error.is_none())
    }
}
