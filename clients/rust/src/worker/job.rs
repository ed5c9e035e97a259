//! What a handler gets (`Job`: one leased intent) and what it returns on failure
//! (`Failure`: which `Fail` outcome to report, or nothing when the lease is lost).

use std::collections::HashMap;
use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;

use super::Shared;
use super::lease::LeaseState;
use crate::proto;

/// One leased intent, as a handler gets it.
///
/// The worker extends its lease while the handler runs. [`Job::submitting`] marks it
/// `SUBMITTED` before a non-idempotent external call.
pub struct Job {
    intent: proto::Intent,
    lease_id: String,
    attempt: u32,
    pub(super) lease: Arc<LeaseState>,
    pub(super) shared: Arc<Shared>,
}

impl Job {
    pub(super) fn new(
        intent: proto::Intent,
        lease_id: String,
        attempt: i32,
        lease: Arc<LeaseState>,
        shared: Arc<Shared>,
    ) -> Self {
        Self {
            intent,
            lease_id,
            attempt: u32::try_from(attempt).unwrap_or(0),
            lease,
            shared,
        }
    }

    /// The intent's id (a UUID).
    pub fn id(&self) -> &str {
        &self.intent.id
    }

    /// The routing key it was enqueued with, e.g. `email.send`.
    pub fn kind(&self) -> &str {
        &self.intent.kind
    }

    /// The bytes the producer sent.
    pub fn payload(&self) -> &[u8] {
        &self.intent.payload
    }

    /// The payload's media type, e.g. `application/json` (empty when none was given).
    pub fn content_type(&self) -> &str {
        &self.intent.content_type
    }

    /// The producer's headers (a W3C `traceparent` among them, when it sent one).
    pub fn headers(&self) -> &HashMap<String, String> {
        &self.intent.headers
    }

    /// The intent's tenant: which of its tenants a key acting for several claimed it for.
    pub fn tenant(&self) -> &str {
        &self.intent.tenant
    }

    /// The intent's region (empty: any).
    pub fn region(&self) -> &str {
        &self.intent.region
    }

    /// The idempotency key it was enqueued with (empty when none).
    pub fn idempotency_key(&self) -> &str {
        &self.intent.idempotency_key
    }

    /// The ordering key it was enqueued with (empty when none).
    pub fn ordering_key(&self) -> &str {
        &self.intent.ordering_key
    }

    /// The priority it was enqueued with, from -10 to 10 (0 when none was given).
    pub fn priority(&self) -> i32 {
        self.intent.priority
    }

    /// This claim's attempt number, from 1.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Claims allowed before the intent is dead-lettered.
    pub fn max_attempts(&self) -> u32 {
        u32::try_from(self.intent.max_attempts).unwrap_or(0)
    }

    /// When the intent was enqueued.
    pub fn created_at(&self) -> Option<SystemTime> {
        self.intent
            .created_at
            .and_then(|t| SystemTime::try_from(t).ok())
    }

    /// The lease's fencing token.
    pub fn lease_id(&self) -> &str {
        &self.lease_id
    }

    /// The intent as the server sent it, every field included.
    pub fn intent(&self) -> &proto::Intent {
        &self.intent
    }

    /// The worker's id (sent with Claim, shown in listings).
    pub fn worker_id(&self) -> &str {
        &self.shared.config.worker_id
    }

    /// True once the lease is known lost (refused heartbeat, or expired before one got
    /// through): whatever the handler does now is not reported.
    pub fn lease_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// True once [`Job::submitting`] succeeded.
    pub fn is_submitted(&self) -> bool {
        self.lease.is_submitted()
    }

    /// Fires when the lease is lost or the shutdown grace ends; the handler's task is
    /// aborted right after. For work the handler spawned that must stop with it.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.lease.token.clone()
    }

    /// Calls `MarkSubmitted`: from now on an outcome nobody knows (the handler fails with
    /// anything but [`Failure::retry`] or [`Failure::permanent`], the worker dies, the
    /// lease expires) sends the intent to `NEEDS_RECONCILE`, never to a blind retry. Call
    /// it just before the non-idempotent external call, and propagate its error with `?`:
    ///
    /// ```no_run
    /// # async fn charge(_: &[u8]) -> Result<(), std::io::Error> { Ok(()) }
    /// # async fn handler(job: outboxd_client::Job) -> Result<(), outboxd_client::Failure> {
    /// job.submitting().await?; // the call never starts on a lease someone else may hold
    /// charge(job.payload()).await?; // an error here → Fail UNKNOWN → NEEDS_RECONCILE
    /// # Ok(()) }
    /// ```
    ///
    /// Calling it again is a no-op.
    ///
    /// # Errors
    /// The lease is lost (a failure that reports nothing), or `MarkSubmitted` got no
    /// answer or was refused for another reason (a retry: the call has not started).
    pub async fn submitting(&self) -> Result<(), Failure> {
        self.shared.mark_submitted(&self.lease).await
    }
}

impl fmt::Debug for Job {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.intent.id)
            .field("kind", &self.intent.kind)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

/// What a handler reports when it does not succeed; its `Err`.
///
/// Any error converts into one with `?` (reported as [`Failure::retry`] with the server's
/// backoff, or as [`Failure::unknown`] once [`Job::submitting`] succeeded). Construct one
/// to say more:
///
/// | The handler returns | The worker reports | The intent |
/// |---|---|---|
/// | `Ok(())` | `Ack` | `DELIVERED` |
/// | `Err(Failure::retry(msg))`, `.after(d)` | `Fail RETRY` (`retry_after`) | `PENDING` after the backoff; dead-lettered once attempts run out |
/// | `Err(Failure::permanent(msg))` | `Fail PERMANENT` | `DEAD_LETTERED` |
/// | `Err(Failure::unknown(msg))` | `Fail UNKNOWN` | `NEEDS_RECONCILE` |
/// | any other error (`?`) | `Fail RETRY`, `UNKNOWN` once submitted | as above |
/// | a panic | as any other error | as above |
/// | the error of a lost lease ([`Job::submitting`]) | nothing | someone else may hold it |
pub struct Failure {
    kind: FailureKind,
    message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// An error the handler did not classify, and the retry delay it was given: a retry,
    /// or `UNKNOWN` once submitted.
    Error(Option<Duration>),
    Retry(Option<Duration>),
    Permanent,
    Unknown,
    LeaseLost,
}

impl Failure {
    /// The side effect did not happen; try again after the server's backoff.
    pub fn retry(message: impl fmt::Display) -> Self {
        Self::new(FailureKind::Retry(None), message)
    }

    /// The side effect did not happen and never will: dead-letter now.
    pub fn permanent(message: impl fmt::Display) -> Self {
        Self::new(FailureKind::Permanent, message)
    }

    /// The side effect may or may not have happened: an operator decides
    /// (`NEEDS_RECONCILE`).
    pub fn unknown(message: impl fmt::Display) -> Self {
        Self::new(FailureKind::Unknown, message)
    }

    /// A retry no sooner than `delay` from now, instead of the server's backoff (only
    /// for [`Failure::retry`] and plain errors; a plain error after [`Job::submitting`]
    /// still goes to `NEEDS_RECONCILE`, its delay unused).
    pub fn after(mut self, delay: Duration) -> Self {
        self.kind = match self.kind {
            FailureKind::Retry(_) => FailureKind::Retry(Some(delay)),
            FailureKind::Error(_) => FailureKind::Error(Some(delay)),
            kind => kind,
        };
        self
    }

    pub(crate) fn lease_lost(message: impl fmt::Display) -> Self {
        Self::new(FailureKind::LeaseLost, message)
    }

    fn new(kind: FailureKind, message: impl fmt::Display) -> Self {
        Self {
            kind,
            message: message.to_string(),
        }
    }

    /// The text kept as the intent's `last_error` (sent with control characters as spaces,
    /// cut to 4096 characters: the server refuses either).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// True for the failure of a lost lease, which reports nothing.
    pub fn is_lease_lost(&self) -> bool {
        self.kind == FailureKind::LeaseLost
    }

    pub(crate) fn kind(&self) -> FailureKind {
        self.kind
    }
}

impl<E> From<E> for Failure
where
    E: Into<Box<dyn StdError + Send + Sync>>,
{
    fn from(error: E) -> Self {
        let error: Box<dyn StdError + Send + Sync> = error.into();
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Self::new(FailureKind::Error(None), message)
    }
}

impl fmt::Debug for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Failure")
            .field("kind", &self.kind)
            .field("message", &self.message)
            .finish()
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.kind {
            FailureKind::Error(_) => "error",
            FailureKind::Retry(_) => "retry",
            FailureKind::Permanent => "permanent",
            FailureKind::Unknown => "unknown",
            FailureKind::LeaseLost => "lease lost",
        };
        write!(f, "{kind}: {}", self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_becomes_a_failure_with_its_causes() {
        #[derive(Debug, thiserror::Error)]
        #[error("charge failed")]
        struct Charge(#[source] std::io::Error);
        let failure = Failure::from(Charge(std::io::Error::other("timed out")));
        assert_eq!(failure.kind(), FailureKind::Error(None));
        assert_eq!(failure.message(), "charge failed: timed out");
        let later = Failure::from("busy").after(Duration::from_secs(3));
        assert_eq!(
            later.kind(),
            FailureKind::Error(Some(Duration::from_secs(3)))
        );
        let retry = Failure::retry("busy").after(Duration::from_secs(3));
        assert_eq!(
            retry.kind(),
            FailureKind::Retry(Some(Duration::from_secs(3)))
        );
        // Only retries get a delay.
        let permanent = Failure::permanent("no").after(Duration::from_secs(3));
        assert_eq!(permanent.kind(), FailureKind::Permanent);
    }
}
