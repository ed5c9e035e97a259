//! The outbox domain: intents, their states and leases, and the errors of its operations.
//! Wire types never reach this module; `crate::proto` converts at the edge.

pub mod claim;
pub mod clock;
pub mod enqueue;
pub mod group_commit;
pub mod maintenance;
pub mod notify;
pub mod promotion;
pub mod store;
pub mod token;

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

pub use clock::Clock;

/// True for identifier-like names: 1..=`max` ASCII letters, digits and `. _ - : /`
/// (no commas or quotes, so a name is always safe inside a setting or a header).
pub fn is_name(value: &str, max: usize) -> bool {
    !value.is_empty()
        && value.len() <= max
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-:/".contains(&b))
}

/// Identifier of an intent (a UUIDv7 minted at enqueue).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, sqlx::Type)]
#[sqlx(transparent)]
pub struct IntentId(pub Uuid);

impl fmt::Display for IntentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Fencing token minted by each claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(transparent)]
pub struct LeaseId(pub Uuid);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Lifecycle state of an intent, as in docs/design.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "outbox.intent_state", rename_all = "snake_case")]
pub enum IntentState {
    /// Enqueued inside a producer transaction that has not finished.
    Staged,
    /// Claimable once `available_at` has passed.
    Pending,
    /// Claimed; the side effect has not started.
    Leased,
    /// The worker said the external call is starting.
    Submitted,
    /// The side effect happened.
    Delivered,
    /// Outcome unknown; an operator decides.
    NeedsReconcile,
    /// Given up; an operator may requeue.
    DeadLettered,
    /// The producer transaction aborted.
    Discarded,
    /// Behind an earlier intent of its ordering key that has not finished.
    Waiting,
    /// An operator cancelled it before it was delivered.
    Cancelled,
}

impl IntentState {
    /// Every state, in lifecycle order.
    pub const ALL: [IntentState; 10] = [
        Self::Staged,
        Self::Waiting,
        Self::Pending,
        Self::Leased,
        Self::Submitted,
        Self::Delivered,
        Self::NeedsReconcile,
        Self::DeadLettered,
        Self::Discarded,
        Self::Cancelled,
    ];

    /// States an operator can resolve with `Reconcile`.
    pub fn awaits_decision(self) -> bool {
        matches!(self, Self::NeedsReconcile | Self::DeadLettered)
    }

    /// States of a live lease: LEASED or SUBMITTED.
    pub fn is_live_lease(self) -> bool {
        matches!(self, Self::Leased | Self::Submitted)
    }

    /// States an operator can `Reconcile` with CANCEL: not leased, not finished.
    pub fn cancellable(self) -> bool {
        matches!(self, Self::Staged | Self::Waiting | Self::Pending)
    }

    /// The lowercase name used in SQL, logs and the CLI.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Staged => "staged",
            Self::Pending => "pending",
            Self::Leased => "leased",
            Self::Submitted => "submitted",
            Self::Delivered => "delivered",
            Self::NeedsReconcile => "needs_reconcile",
            Self::DeadLettered => "dead_lettered",
            Self::Discarded => "discarded",
            Self::Waiting => "waiting",
            Self::Cancelled => "cancelled",
        }
    }
}

impl fmt::Display for IntentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// When a new intent becomes claimable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// As soon as it is committed.
    Now,
    /// This long after the enqueue.
    Delay(Duration),
    /// From this instant on.
    At(DateTime<Utc>),
}

/// An intent as a producer submits it, already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct NewIntent {
    /// Routing key.
    pub kind: String,
    /// Opaque body.
    pub payload: Vec<u8>,
    /// Media type of the payload ('' when not given).
    pub content_type: String,
    /// Region ('' = any).
    pub region: String,
    /// Per-tenant deduplication key.
    pub idempotency_key: Option<String>,
    /// Intents of one tenant with the same key are delivered one at a time, in commit
    /// order (docs/ordering.md).
    pub ordering_key: Option<String>,
    /// Higher first among the claimable intents of its (tenant, kind); 0 by default.
    pub priority: i16,
    /// Headers carried to the worker.
    pub headers: BTreeMap<String, String>,
    /// Claims allowed before dead-lettering.
    pub max_attempts: i32,
    /// When it becomes claimable.
    pub schedule: Schedule,
}

/// A stored intent.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Intent {
    /// Its id.
    pub id: IntentId,
    /// Its state.
    pub state: IntentState,
    /// Routing key.
    pub kind: String,
    /// Body (empty when a listing left it out).
    pub payload: Vec<u8>,
    /// Media type.
    pub content_type: String,
    /// Region ('' = any).
    pub region: String,
    /// Deduplication key.
    pub idempotency_key: Option<String>,
    /// Headers.
    pub headers: sqlx::types::Json<BTreeMap<String, String>>,
    /// Claims so far.
    pub attempts: i32,
    /// Claims allowed.
    pub max_attempts: i32,
    /// Not claimable before.
    pub available_at: DateTime<Utc>,
    /// Enqueued at.
    pub created_at: DateTime<Utc>,
    /// Last state change.
    pub updated_at: DateTime<Utc>,
    /// Current or last lease.
    pub lease_id: Option<LeaseId>,
    /// Expiry of a live lease.
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// Worker holding or last holding it.
    pub worker_id: Option<String>,
    /// Last reported error.
    pub last_error: Option<String>,
    /// Ordering key.
    pub ordering_key: Option<String>,
    /// Priority (higher first within its tenant and kind).
    pub priority: i16,
    /// Its tenant.
    pub tenant: String,
}

impl Intent {
    /// Where it comes in a claim's reply: higher priorities first, then oldest.
    pub fn claim_order(&self) -> (std::cmp::Reverse<i16>, DateTime<Utc>, IntentId) {
        (std::cmp::Reverse(self.priority), self.available_at, self.id)
    }
}

/// A LEASED intent as a claim returns it, now, for unit tests.
#[cfg(test)]
pub(crate) fn leased_intent(id: IntentId) -> Intent {
    let now = Utc::now();
    Intent {
        id,
        state: IntentState::Leased,
        kind: "x".to_owned(),
        payload: Vec::new(),
        content_type: String::new(),
        region: String::new(),
        idempotency_key: None,
        headers: sqlx::types::Json(BTreeMap::new()),
        attempts: 1,
        max_attempts: 1,
        available_at: now,
        created_at: now,
        updated_at: now,
        lease_id: Some(LeaseId(Uuid::new_v4())),
        lease_expires_at: Some(now),
        worker_id: Some("a".to_owned()),
        last_error: None,
        ordering_key: None,
        priority: 0,
        tenant: "t".to_owned(),
    }
}

/// Result of enqueueing one intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// Id of the (possibly pre-existing) intent.
    pub id: IntentId,
    /// Its state as the call recorded it: STAGED or PENDING for a new intent (a PENDING
    /// one may be leased already, see `handed_off`), WAITING for a new ordered one behind
    /// an earlier one of its key; the current one for a deduplicated one.
    pub state: IntentState,
    /// True when an idempotency key matched an intent already stored.
    pub deduplicated: bool,
    /// True when the enqueue leased it at once to a Claim of this server waiting for it
    /// ([`claim::handoff`]): PENDING and claimed in one commit.
    pub handed_off: bool,
}

/// A lease as the caller presents it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRef {
    /// The leased intent.
    pub intent_id: IntentId,
    /// The fencing token from Claim.
    pub lease_id: LeaseId,
}

/// What a worker knows about a failed side effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOutcome {
    /// Did not happen; retry after backoff.
    Retry,
    /// Did not happen and never will.
    Permanent,
    /// May have happened.
    Unknown,
}

impl FailOutcome {
    /// Lowercase name, as in SQL and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Permanent => "permanent",
            Self::Unknown => "unknown",
        }
    }
}

/// One failure report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The failed lease.
    pub lease: LeaseRef,
    /// What went wrong.
    pub error: String,
    /// What is known.
    pub outcome: FailOutcome,
    /// RETRY only: the worker's minimum wait instead of the backoff.
    pub retry_after: Option<Duration>,
}

/// An operator's ruling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// It happened.
    Delivered,
    /// Deliver again (redrive).
    Requeue,
    /// Give up.
    Dead,
    /// Never deliver an intent not delivered yet.
    Cancel,
}

impl Decision {
    /// The name stored in `outbox.resolution.decision`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Delivered => "delivered",
            Self::Requeue => "requeue",
            Self::Dead => "dead",
            Self::Cancel => "cancel",
        }
    }

    /// Parses the stored name.
    pub fn from_db(s: &str) -> Option<Self> {
        match s {
            "delivered" => Some(Self::Delivered),
            "requeue" => Some(Self::Requeue),
            "dead" => Some(Self::Dead),
            "cancel" => Some(Self::Cancel),
            _ => None,
        }
    }
}

/// A recorded operator decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// The ruling.
    pub decision: Decision,
    /// State before the ruling.
    pub from_state: IntentState,
    /// Who, as the caller named them.
    pub actor: String,
    /// The name of the API key that made the call (empty for decisions recorded before outboxd kept it).
    pub api_key: String,
    /// Why.
    pub reason: String,
    /// When.
    pub resolved_at: DateTime<Utc>,
}

/// Stable, machine-readable reasons carried in `ErrorInfo` and per-item errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The request is malformed; see the field violations.
    InvalidArgument,
    /// A payload exceeds the configured limit.
    PayloadTooLarge,
    /// A batch exceeds the configured limit.
    BatchTooLarge,
    /// No such intent for this tenant.
    NotFound,
    /// The lease expired and was rescued, or was never this caller's.
    LeaseLost,
    /// The intent is not in a state the operation applies to.
    InvalidState,
    /// An idempotency key is already used for a different intent.
    IdempotencyConflict,
    /// An idempotency key is held by a producer transaction that has not finished.
    IdempotencyKeyInUse,
    /// No valid API key.
    Unauthenticated,
    /// The key lacks the scope the call needs.
    MissingScope,
    /// The key may not act for that tenant.
    TenantNotAllowed,
    /// The key may not act in that region.
    RegionNotAllowed,
    /// The producer transaction named by the token rolled back.
    TxnAborted,
    /// The producer transaction named by the token already committed.
    TxnCommitted,
    /// Ordering keys need the database to record commit times.
    OrderingUnavailable,
    /// The database is unreachable or overloaded; retry.
    Unavailable,
    /// The connection failed while the call's transaction committed: it may have
    /// committed. Retrying is safe only with idempotency keys.
    CommitOutcomeUnknown,
    /// A transient conflict (serialization, deadlock); retry.
    Conflict,
    /// An Enqueue would give its tenant more than 1,000 queues (kinds × priorities).
    TooManyQueues,
    /// An operator call's statement ran past `OUTBOX_LIMITS__OPERATOR_TIMEOUT` (or was
    /// cancelled by an administrator): it changed nothing.
    StatementTimeout,
    /// A bug or an unexpected database error.
    Internal,
}

impl Reason {
    /// The stable string form.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidArgument => "INVALID_ARGUMENT",
            Self::PayloadTooLarge => "PAYLOAD_TOO_LARGE",
            Self::BatchTooLarge => "BATCH_TOO_LARGE",
            Self::NotFound => "NOT_FOUND",
            Self::LeaseLost => "LEASE_LOST",
            Self::InvalidState => "INVALID_STATE",
            Self::IdempotencyConflict => "IDEMPOTENCY_CONFLICT",
            Self::IdempotencyKeyInUse => "IDEMPOTENCY_KEY_IN_USE",
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::MissingScope => "MISSING_SCOPE",
            Self::TenantNotAllowed => "TENANT_NOT_ALLOWED",
            Self::RegionNotAllowed => "REGION_NOT_ALLOWED",
            Self::TxnAborted => "TXN_ABORTED",
            Self::TxnCommitted => "TXN_COMMITTED",
            Self::OrderingUnavailable => "ORDERING_UNAVAILABLE",
            Self::Unavailable => "UNAVAILABLE",
            Self::CommitOutcomeUnknown => "COMMIT_OUTCOME_UNKNOWN",
            Self::Conflict => "CONFLICT",
            Self::StatementTimeout => "STATEMENT_TIMEOUT",
            Self::TooManyQueues => "TOO_MANY_QUEUES",
            Self::Internal => "INTERNAL",
        }
    }
}

/// Why one item of a batch was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemError {
    /// Stable reason.
    pub reason: Reason,
    /// Human-readable explanation.
    pub message: String,
}

impl ItemError {
    /// No intent with this id for the caller's tenant.
    pub fn not_found(id: IntentId) -> Self {
        Self {
            reason: Reason::NotFound,
            message: format!("intent {id} not found"),
        }
    }

    /// The lease is not (or no longer) the live lease of the intent.
    pub fn lease_lost(id: IntentId, state: IntentState) -> Self {
        Self {
            reason: Reason::LeaseLost,
            message: format!(
                "lease on intent {id} is no longer held (the intent is {state}); \
                 do not report this attempt again"
            ),
        }
    }

    /// The intent reached a state the operation applies to while the operation ran, after
    /// it had been passed over.
    pub fn changed_meanwhile(id: IntentId, state: IntentState) -> Self {
        Self {
            reason: Reason::Conflict,
            message: format!("intent {id} became {state} while this call ran; retry"),
        }
    }

    /// The intent changed after the caller read it: a decision is not taken on a stale view.
    pub fn changed_since_read(id: IntentId, state: IntentState) -> Self {
        Self {
            reason: Reason::Conflict,
            message: format!(
                "intent {id} changed after it was read (it is {state} now); read it again \
                 before deciding"
            ),
        }
    }

    /// The intent is in a state the operation does not apply to.
    pub fn invalid_state(id: IntentId, state: IntentState, wanted: &str) -> Self {
        Self {
            reason: Reason::InvalidState,
            message: format!("intent {id} is {state}; {wanted}"),
        }
    }
}

/// Outcome of one item of a lease batch call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemResult {
    /// The intent.
    pub intent_id: IntentId,
    /// State after the call; `None` when not found.
    pub state: Option<IntentState>,
    /// Set when not applied.
    pub error: Option<ItemError>,
    /// This call made the transition: false for errors and for replays of a call whose
    /// response was lost (OK, but counted once, by the call that applied).
    pub applied: bool,
    /// New expiry (ExtendLease).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The producer's trace context stored with the intent, when the item applied.
    pub traceparent: Option<String>,
}

/// One invalid field of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldViolation {
    /// Path of the field, e.g. `intents[2].kind`.
    pub field: String,
    /// What is wrong and what is allowed.
    pub description: String,
}

impl FieldViolation {
    /// Builds a violation.
    pub fn new(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            description: description.into(),
        }
    }
}

/// Errors of outbox operations; mapped to gRPC statuses in exactly one place (`crate::grpc`).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request is malformed.
    #[error("invalid request: {}", describe(.0))]
    InvalidArgument(Vec<FieldViolation>),
    /// The request is well formed but exceeds a configured limit.
    #[error("limit exceeded: {}", describe(.1))]
    LimitExceeded(Reason, Vec<FieldViolation>),
    /// No such intent.
    #[error("intent {0} not found")]
    NotFound(IntentId),
    /// An idempotency key is already used by an intent with a different kind, payload or
    /// region.
    #[error(
        "idempotency key {key:?} is already used by intent {existing} with a different kind, payload or region"
    )]
    IdempotencyConflict {
        /// The key.
        key: String,
        /// The intent that holds it.
        existing: IntentId,
    },
    /// An idempotency key is held by a STAGED intent of another producer transaction that
    /// has not finished yet.
    #[error(
        "idempotency key {key:?} is held by intent {existing} of a producer transaction that has \
         not finished; retry once it commits or rolls back"
    )]
    IdempotencyKeyInUse {
        /// The key.
        key: String,
        /// The intent that holds it.
        existing: IntentId,
    },
    /// An idempotency key is held by a STAGED intent whose producer transaction committed:
    /// it becomes PENDING within the promotion's interval, and a retry is its replay.
    #[error(
        "idempotency key {key:?} is held by intent {existing}, whose producer transaction has \
         committed; it is being promoted: retry, and the call is answered as its replay"
    )]
    KeyHolderCommitted {
        /// The key.
        key: String,
        /// The intent that holds it.
        existing: IntentId,
    },
    /// [`Self::IdempotencyConflict`] or [`Self::IdempotencyKeyInUse`] (`reason`) for a caller
    /// bound to regions the holding intent is not of: its id is not the caller's to see.
    #[error(
        "idempotency key {key:?} is already used by an intent of a region outside this API \
         key's ({reason:?}); nothing was recorded"
    )]
    KeyHeldElsewhere {
        /// The key.
        key: String,
        /// Why the key could not be used.
        reason: Reason,
    },
    /// The intent that held an idempotency key when this call's insert met it finished
    /// (discarded, or purged) before it could be read: the key is free now.
    #[error(
        "the intent holding idempotency key {key:?} was discarded or purged while this call ran, \
         or its producer transaction rolled back; retry, and the key will be yours"
    )]
    KeyHolderGone {
        /// The key.
        key: String,
    },
    /// No valid credentials.
    #[error("{0}")]
    Unauthenticated(String),
    /// Valid credentials that do not allow this call.
    #[error("{1}")]
    PermissionDenied(Reason, String),
    /// The producer transaction of a two-phase enqueue rolled back.
    #[error("{0}")]
    TxnAborted(String),
    /// The producer transaction of a two-phase enqueue is no longer open.
    #[error("{0}")]
    TxnFinished(String),
    /// The connection to the database failed while a transaction committed: it may or may
    /// not have committed (the cause is logged where it happened).
    #[error(
        "the database connection failed while committing: the intents may or may not have been \
         recorded; retry with the same idempotency keys (an intent without one may then be \
         recorded twice)"
    )]
    CommitOutcomeUnknown,
    /// Ordered intents need the database to record commit times, and it does not.
    #[error(
        "ordering keys need PostgreSQL's track_commit_timestamp = on (set it in postgresql.conf \
         and restart PostgreSQL); this database does not record commit times"
    )]
    OrderingUnavailable,
    /// A database failure.
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

fn describe(violations: &[FieldViolation]) -> String {
    violations
        .iter()
        .map(|v| format!("{}: {}", v.field, v.description))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Result of outbox operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
