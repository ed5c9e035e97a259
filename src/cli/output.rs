//! How the operator commands print: text a person can read, or JSON with `--json`.

use serde_json::{Value, json};
use tonic_types::StatusExt;

use super::ClientArgs;
use crate::proto::{from_timestamp, v1};

pub(super) fn print(args: &ClientArgs, value: Value, text: impl FnOnce()) -> anyhow::Result<()> {
    if args.json {
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        text();
    }
    Ok(())
}

/// Prints per-item results; fails the command when any item failed, so scripts notice.
pub(super) fn print_results(args: &ClientArgs, results: &[v1::LeaseResult]) -> anyhow::Result<()> {
    print(args, json!(results.iter().map(|r| json!({
        "intent_id": r.intent_id,
        "state": state_name(r.state),
        "error": r.error.as_ref().map(|e| json!({"code": e.code, "reason": e.reason, "message": e.message})),
    })).collect::<Vec<_>>()), || {
        for r in results {
            match &r.error {
                None => println!("{}  ok  now {}", r.intent_id, state_name(r.state)),
                Some(e) => println!("{}  {}  {}", r.intent_id, e.reason, e.message),
            }
        }
    })?;
    let failed = results.iter().filter(|r| r.error.is_some()).count();
    anyhow::ensure!(
        failed == 0,
        "{failed} of {} items were not applied",
        results.len()
    );
    Ok(())
}

pub(super) fn print_intent_detail(i: &v1::Intent) {
    println!("id:              {}", i.id);
    println!("state:           {}", state_name(i.state));
    println!("kind:            {}", i.kind);
    println!(
        "region:          {}",
        if i.region.is_empty() {
            "(any)"
        } else {
            &i.region
        }
    );
    println!("attempts:        {}/{}", i.attempts, i.max_attempts);
    println!("idempotency key: {}", i.idempotency_key);
    println!("ordering key:    {}", i.ordering_key);
    println!("priority:        {}", i.priority);
    println!("created at:      {}", time(i.created_at.as_ref()));
    println!("available at:    {}", time(i.available_at.as_ref()));
    println!("worker:          {}", i.worker_id);
    println!("last error:      {}", i.last_error);
    println!("content type:    {}", i.content_type);
    println!("payload:         {}", printable(&i.payload));
}

/// A payload as text for a terminal: control characters (escape sequences a producer could
/// send to an operator's terminal, line ends) escaped as `\u{1b}`, `\n`.
pub(super) fn printable(payload: &[u8]) -> String {
    String::from_utf8_lossy(payload)
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

pub(super) fn intent_json(i: &v1::Intent) -> Value {
    json!({
        "id": i.id,
        "state": state_name(i.state),
        "kind": i.kind,
        "region": i.region,
        "payload": String::from_utf8_lossy(&i.payload),
        "content_type": i.content_type,
        "idempotency_key": i.idempotency_key,
        "ordering_key": i.ordering_key,
        "priority": i.priority,
        "headers": i.headers,
        "attempts": i.attempts,
        "max_attempts": i.max_attempts,
        "available_at": time_json(i.available_at.as_ref()),
        "created_at": time_json(i.created_at.as_ref()),
        "updated_at": time_json(i.updated_at.as_ref()),
        "lease_expires_at": time_json(i.lease_expires_at.as_ref()),
        "worker_id": i.worker_id,
        "last_error": i.last_error,
    })
}

pub(super) fn state_name(state: i32) -> String {
    v1::IntentState::try_from(state)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("INTENT_STATE_")
                .to_owned()
        })
        .unwrap_or_else(|_| state.to_string())
}

pub(super) fn decision_name(decision: i32) -> String {
    v1::Decision::try_from(decision)
        .map(|d| d.as_str_name().trim_start_matches("DECISION_").to_owned())
        .unwrap_or_else(|_| decision.to_string())
}

/// An instant for `--json`: RFC 3339, or null when unset.
pub(super) fn time_json(t: Option<&prost_types::Timestamp>) -> Value {
    t.and_then(from_timestamp)
        .map_or(Value::Null, |t| Value::String(t.to_rfc3339()))
}

/// An instant for people: RFC 3339, or `-` when unset.
pub(super) fn time(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(from_timestamp)
        .map(|t| t.to_rfc3339())
        .unwrap_or_else(|| "-".to_owned())
}

/// Who made a decision: the actor the caller named, and the API key that made the call
/// when it is another name.
pub(super) fn who(actor: &str, api_key: &str) -> String {
    if api_key.is_empty() || api_key == actor {
        actor.to_owned()
    } else {
        format!("{actor} (key {api_key})")
    }
}

/// An error as one line, its causes after it (`outer: inner`); a gRPC status as its code
/// and the reason of its `ErrorInfo`, as docs/api.md names them
/// (`RESOURCE_EXHAUSTED/BATCH_TOO_LARGE: <message>`), the reason left out where it is the
/// code's own name (`INVALID_ARGUMENT: <message>`).
pub(super) fn error_line(e: &anyhow::Error) -> String {
    e.chain()
        .map(|cause| match cause.downcast_ref::<tonic::Status>() {
            Some(status) => status_line(status),
            None => cause.to_string(),
        })
        .collect::<Vec<_>>()
        .join(": ")
}

fn status_line(status: &tonic::Status) -> String {
    let code = crate::status::code_name(status.code());
    let reason = status
        .get_error_details()
        .error_info()
        .map(|info| info.reason.clone())
        .filter(|reason| !reason.is_empty() && reason != code);
    let message = if status.message().is_empty() {
        status.code().description()
    } else {
        status.message()
    };
    let message = message.replace(['\r', '\n'], " ");
    match reason {
        Some(reason) => format!("{code}/{reason}: {message}"),
        None => format!("{code}: {message}"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use anyhow::Context;
    use tonic::{Code, Status};
    use tonic_types::{ErrorDetails, StatusExt};

    use super::{error_line, printable};

    #[test]
    fn a_payload_reaches_the_terminal_without_its_control_characters() {
        assert_eq!(
            printable(b"hi\x1b]0;pwned\x07\x1b[2J\n\xff"),
            "hi\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\n\u{fffd}"
        );
        assert_eq!(
            printable("caf\u{e9} {\"a\":1}".as_bytes()),
            "caf\u{e9} {\"a\":1}"
        );
    }

    fn refusal(code: Code, reason: &str, message: &str) -> anyhow::Error {
        let details = ErrorDetails::with_error_info(reason, "outboxd", HashMap::new());
        Status::with_error_details(code, message, details).into()
    }

    #[test]
    fn a_refusal_prints_its_code_and_reason_on_one_line() {
        let e = refusal(
            Code::ResourceExhausted,
            "BATCH_TOO_LARGE",
            "limit exceeded: page_size: at most 1000",
        );
        assert_eq!(
            error_line(&e),
            "RESOURCE_EXHAUSTED/BATCH_TOO_LARGE: limit exceeded: page_size: at most 1000"
        );
        let e = refusal(
            Code::InvalidArgument,
            "INVALID_ARGUMENT",
            "invalid\nrequest",
        );
        assert_eq!(error_line(&e), "INVALID_ARGUMENT: invalid request");
        let e = anyhow::Error::from(Status::unavailable("")).context("calling outboxd");
        assert_eq!(
            error_line(&e),
            format!(
                "calling outboxd: UNAVAILABLE: {}",
                Code::Unavailable.description()
            )
        );
        let e: anyhow::Error = Err::<(), _>(std::io::Error::other("gone"))
            .context("cannot read ca.pem")
            .unwrap_err();
        assert_eq!(error_line(&e), "cannot read ca.pem: gone");
    }
}
