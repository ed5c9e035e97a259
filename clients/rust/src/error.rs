//! The crate's error: a refused or unanswered call (with outboxd's stable reason), a
//! database error of the producer's transaction, or a misuse caught before anything is sent.

use std::error::Error as StdError;

use tonic::{Code, Status};

/// Why a call of this crate failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// outboxd answered with an error, or no answer came within the call's budget (then
    /// the last attempt's status, made on this side).
    #[error("{}", describe(.0))]
    Status(Box<Status>),
    /// The producer's transaction failed (the token query).
    #[cfg(feature = "sqlx")]
    #[error("producer transaction: {0}")]
    Database(#[from] sqlx::Error),
    /// `Outbox::enqueue` was given a savepoint (a nested `Transaction`): intents would
    /// survive a `ROLLBACK TO SAVEPOINT`, so they are not enqueued there.
    #[error(
        "enqueue needs the top-level transaction, not a savepoint (a ROLLBACK TO SAVEPOINT \
         would not take the intents back); take the token before nesting, or use a \
         transaction of your own"
    )]
    Savepoint,
    /// The arguments or the configuration cannot work (no endpoint, a bad URI, an empty
    /// batch, …); nothing was sent.
    #[error("{0}")]
    Invalid(String),
    /// A channel could not be set up (TLS configuration, URI).
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

impl Error {
    /// The gRPC code, for an `Error::Status`.
    pub fn code(&self) -> Option<Code> {
        match self {
            Self::Status(status) => Some(status.code()),
            _ => None,
        }
    }

    /// outboxd's stable reason (`google.rpc.ErrorInfo`), e.g. `LEASE_LOST`,
    /// `IDEMPOTENCY_CONFLICT`, `TXN_ABORTED`; `None` when the status carries none (a
    /// transport failure, a local deadline).
    pub fn reason(&self) -> Option<String> {
        match self {
            Self::Status(status) => reason(status),
            _ => None,
        }
    }

    /// The status, for an `Error::Status`.
    pub fn status(&self) -> Option<&Status> {
        match self {
            Self::Status(status) => Some(status),
            _ => None,
        }
    }
}

impl From<Status> for Error {
    fn from(status: Status) -> Self {
        Self::Status(Box::new(status))
    }
}

/// `CODE/REASON: message`.
fn describe(status: &Status) -> String {
    let reason = reason(status).unwrap_or_default();
    format!("{:?}/{reason}: {}", status.code(), status.message())
}

/// `google.rpc.Status` as far as this crate reads it (decoded by hand: it is not in proto/).
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// `google.rpc.ErrorInfo`'s reason.
#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
}

/// The reason of the first `google.rpc.ErrorInfo` in the status details.
pub(crate) fn reason(status: &Status) -> Option<String> {
    let details = status.details();
    if details.is_empty() {
        return None;
    }
    let decoded = <RpcStatus as prost::Message>::decode(details).ok()?;
    decoded
        .details
        .iter()
        .find(|any| any.type_url.ends_with("google.rpc.ErrorInfo"))
        .and_then(|any| <ErrorInfo as prost::Message>::decode(any.value.as_slice()).ok())
        .map(|info| info.reason)
}

/// True when the status was made on this side (a broken or refused connection, a local
/// deadline) rather than sent by a server: tonic keeps the transport error as its source.
pub(crate) fn is_local(status: &Status) -> bool {
    status.source().is_some()
}

/// True when the request never left this process: the connection could not be made, so a
/// retry cannot record anything twice, whatever the request.
pub(crate) fn never_sent(status: &Status) -> bool {
    let mut source: Option<&(dyn StdError + 'static)> = status.source();
    while let Some(error) = source {
        if error.is::<tonic::ConnectError>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Failures that the same request, sent again (maybe to another endpoint), may not see:
/// UNAVAILABLE, DEADLINE_EXCEEDED, outboxd's ABORTED/CONFLICT (a serialization conflict it
/// rolled back), and a connection that broke mid-call (UNKNOWN, INTERNAL or CANCELLED made
/// on this side; a local deadline is a CANCELLED of tonic's).
pub(crate) fn is_transient(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::DeadlineExceeded => true,
        Code::Aborted => reason(status).as_deref() == Some("CONFLICT"),
        Code::Unknown | Code::Internal | Code::Cancelled => is_local(status),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_reason(code: Code, reason: &str) -> Status {
        let info = ErrorInfo {
            reason: reason.to_owned(),
        };
        let details = RpcStatus {
            code: code as i32,
            message: "m".into(),
            details: vec![prost_types::Any {
                type_url: "type.googleapis.com/google.rpc.ErrorInfo".into(),
                value: prost::Message::encode_to_vec(&info),
            }],
        };
        Status::with_details(code, "m", prost::Message::encode_to_vec(&details).into())
    }

    #[test]
    fn the_reason_is_read_from_the_error_info_detail() {
        let status = with_reason(Code::FailedPrecondition, "LEASE_LOST");
        assert_eq!(reason(&status).as_deref(), Some("LEASE_LOST"));
        assert_eq!(reason(&Status::unavailable("down")), None);
        let error = Error::from(status);
        assert_eq!(error.reason().as_deref(), Some("LEASE_LOST"));
        assert_eq!(error.to_string(), "FailedPrecondition/LEASE_LOST: m");
    }

    #[test]
    fn only_a_conflict_of_the_aborted_codes_is_transient() {
        assert!(is_transient(&with_reason(Code::Aborted, "CONFLICT")));
        assert!(!is_transient(&with_reason(Code::Aborted, "TXN_ABORTED")));
        assert!(is_transient(&Status::unavailable("")));
        assert!(is_transient(&Status::deadline_exceeded("")));
        // A server's own INTERNAL is an answer, not a broken connection.
        assert!(!is_transient(&Status::internal("bug")));
        assert!(!is_transient(&Status::invalid_argument("")));
    }
}
