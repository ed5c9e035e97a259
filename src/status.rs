//! The one mapping of outboxd's errors to gRPC statuses: code, message and `ErrorInfo`
//! details, for whole calls and per-item results alike. A leaf: it knows the domain's
//! errors and tonic, nothing of the handlers.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::outbox::{Error, IntentId, Reason};

/// Domain of every `ErrorInfo` outboxd sends.
pub const ERROR_DOMAIN: &str = "outboxd";

/// The gRPC code for a reason, for whole-call and per-item errors alike.
pub fn code_of(reason: Reason) -> Code {
    match reason {
        Reason::InvalidArgument => Code::InvalidArgument,
        Reason::Unauthenticated => Code::Unauthenticated,
        Reason::MissingScope | Reason::TenantNotAllowed | Reason::RegionNotAllowed => {
            Code::PermissionDenied
        }
        Reason::PayloadTooLarge
        | Reason::BatchTooLarge
        | Reason::StatementTimeout
        | Reason::TooManyQueues => Code::ResourceExhausted,
        Reason::NotFound => Code::NotFound,
        Reason::LeaseLost | Reason::InvalidState => Code::FailedPrecondition,
        Reason::IdempotencyConflict => Code::AlreadyExists,
        Reason::TxnAborted | Reason::IdempotencyKeyInUse => Code::Aborted,
        Reason::TxnCommitted | Reason::OrderingUnavailable => Code::FailedPrecondition,
        Reason::Unavailable | Reason::CommitOutcomeUnknown => Code::Unavailable,
        Reason::Conflict => Code::Aborted,
        Reason::Internal => Code::Internal,
    }
}

fn error_info(reason: Reason, metadata: HashMap<String, String>) -> ErrorDetails {
    ErrorDetails::with_error_info(reason.as_str(), ERROR_DOMAIN, metadata)
}

fn key_holder(reason: Reason, key: String, holder: IntentId) -> ErrorDetails {
    error_info(
        reason,
        HashMap::from([
            ("idempotency_key".to_owned(), key),
            ("intent_id".to_owned(), holder.to_string()),
        ]),
    )
}

/// A gRPC code's name, as the protocol and the docs spell it (`RESOURCE_EXHAUSTED`).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// A whole-call refusal for `reason`: its code, and the `ErrorInfo` every outboxd error
/// carries.
pub fn refusal(reason: Reason, message: impl Into<String>) -> Status {
    Status::with_error_details(code_of(reason), message, error_info(reason, HashMap::new()))
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let message = e.to_string();
        let (reason, details) = match e {
            Error::InvalidArgument(violations) => {
                let mut d = error_info(Reason::InvalidArgument, HashMap::new());
                for v in violations {
                    d.add_bad_request_violation(v.field, v.description);
                }
                (Reason::InvalidArgument, d)
            }
            Error::LimitExceeded(reason, violations) => {
                let mut d = error_info(reason, HashMap::new());
                for v in violations {
                    d.add_bad_request_violation(v.field, v.description);
                }
                (reason, d)
            }
            Error::NotFound(id) => (
                Reason::NotFound,
                error_info(
                    Reason::NotFound,
                    HashMap::from([("intent_id".to_owned(), id.to_string())]),
                ),
            ),
            Error::IdempotencyConflict { key, existing } => (
                Reason::IdempotencyConflict,
                key_holder(Reason::IdempotencyConflict, key, existing),
            ),
            Error::IdempotencyKeyInUse { key, existing } => (
                Reason::IdempotencyKeyInUse,
                key_holder(Reason::IdempotencyKeyInUse, key, existing),
            ),
            Error::KeyHeldElsewhere { key, reason } => (
                reason,
                error_info(reason, HashMap::from([("idempotency_key".to_owned(), key)])),
            ),
            Error::Unauthenticated(_) => (
                Reason::Unauthenticated,
                error_info(Reason::Unauthenticated, HashMap::new()),
            ),
            Error::PermissionDenied(reason, _) => (reason, error_info(reason, HashMap::new())),
            Error::TxnAborted(_) => (
                Reason::TxnAborted,
                error_info(Reason::TxnAborted, HashMap::new()),
            ),
            Error::TxnFinished(_) => (
                Reason::TxnCommitted,
                error_info(Reason::TxnCommitted, HashMap::new()),
            ),
            Error::OrderingUnavailable => (
                Reason::OrderingUnavailable,
                error_info(
                    Reason::OrderingUnavailable,
                    HashMap::from([("setting".to_owned(), "track_commit_timestamp".to_owned())]),
                ),
            ),
            Error::KeyHolderCommitted { key, existing } => (
                Reason::Conflict,
                key_holder(Reason::Conflict, key, existing),
            ),
            Error::KeyHolderGone { key } => (
                Reason::Conflict,
                error_info(
                    Reason::Conflict,
                    HashMap::from([("idempotency_key".to_owned(), key)]),
                ),
            ),
            Error::CommitOutcomeUnknown => (
                Reason::CommitOutcomeUnknown,
                error_info(Reason::CommitOutcomeUnknown, HashMap::new()),
            ),
            Error::Database(db) => {
                let reason = database_reason(&db);
                // The chain goes to the log; the client gets no SQL text. A conflict, the
                // queue cap or a statement timeout is an ordinary refusal (a caller can cause
                // it by the thousand): DEBUG, as the other refusals.
                match reason {
                    Reason::Unavailable | Reason::Internal => {
                        tracing::error!(error.cause_chain = ?db, error.message = %db, "database error");
                    }
                    _ => {
                        tracing::debug!(error.cause_chain = ?db, error.message = %db, "database refusal");
                    }
                }
                let message = match reason {
                    Reason::Unavailable => "the database is unavailable; retry with backoff",
                    Reason::Conflict => "a concurrent change conflicted; retry",
                    Reason::TooManyQueues => {
                        "this Enqueue would give its tenant more than 1,000 queues (kinds × \
                         priorities, each counted until found without a live intent for an hour); \
                         nothing was recorded"
                    }
                    Reason::StatementTimeout => {
                        "the call ran past OUTBOX_LIMITS__OPERATOR_TIMEOUT (or was cancelled) and \
                         changed nothing; narrow its filter"
                    }
                    _ => "internal error; see the server log",
                };
                return refusal(reason, message);
            }
        };
        Status::with_error_details(code_of(reason), message, details)
    }
}

/// Classifies database failures: transient conflicts may be retried at once, outages with
/// backoff, anything else is a bug.
fn database_reason(e: &sqlx::Error) -> Reason {
    if is_outage(e) {
        return Reason::Unavailable;
    }
    match e {
        sqlx::Error::Database(db) if matches!(db.code().as_deref(), Some("40001" | "40P01")) => {
            Reason::Conflict
        }
        sqlx::Error::Database(db) if db.code().as_deref() == Some("OBX01") => Reason::TooManyQueues,
        // query_canceled: statement_timeout, or pg_cancel_backend.
        sqlx::Error::Database(db) if db.code().as_deref() == Some("57014") => {
            Reason::StatementTimeout
        }
        _ => Reason::Internal,
    }
}

/// Whether the database could not be reached or used, rather than refused the statement:
/// every connection-level failure (refused, reset, closed mid-handshake or mid-statement,
/// as by a proxy or load balancer with no live backend during a failover; TLS; a garbled
/// or truncated reply; the pool's timeout or closing; its connection task gone), and what
/// PostgreSQL says while it cannot serve (connection errors, shutdown, crash recovery, too
/// many connections, a server still in recovery or demoted to a standby).
fn is_outage(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => match db.code().as_deref() {
            // 08: connection exception; 57P: operator intervention (shutdown, crash,
            // cannot connect now); 53300: too many connections; 25006: read-only
            // transaction (the address still leads to a standby, or a demoted primary).
            Some(c) => c.starts_with("08") || c.starts_with("57P") || c == "53300" || c == "25006",
            None => false,
        },
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_connection_level_failure_is_unavailable() {
        let eof = || std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        for e in [
            sqlx::Error::Io(eof()),
            sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)),
            sqlx::Error::Tls(Box::new(eof())),
            sqlx::Error::Protocol("unexpected end of file".into()),
            sqlx::Error::PoolTimedOut,
            sqlx::Error::PoolClosed,
            sqlx::Error::WorkerCrashed,
        ] {
            assert_eq!(database_reason(&e), Reason::Unavailable, "{e:?}");
        }
        assert_eq!(database_reason(&sqlx::Error::RowNotFound), Reason::Internal);
        assert_eq!(
            database_reason(&sqlx::Error::ColumnNotFound("x".into())),
            Reason::Internal
        );
    }
}
