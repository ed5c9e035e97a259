//! What every page shares: the frame, the error pages, and how values are shown.

use askama::Template;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use chrono::{DateTime, Utc};
use tonic_types::StatusExt;

use crate::proto::v1;

/// The frame of a signed-in page: who, the navigation, the sign-out form's token.
pub(super) struct Chrome {
    pub key_name: String,
    pub admin: bool,
    pub csrf: String,
    pub active: &'static str,
    /// The longest reason the API takes (`OUTBOX_LIMITS__MAX_TEXT_LENGTH`): the reason
    /// boxes' `maxlength`.
    pub max_text: usize,
}

/// Renders `page` with `status`.
pub(super) fn render(status: StatusCode, page: &impl Template) -> Response {
    match page.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(e) => {
            tracing::error!(error.message = %e, "a console page did not render");
            (StatusCode::INTERNAL_SERVER_ERROR, "the page did not render").into_response()
        }
    }
}

#[derive(Template)]
#[template(path = "console/error.html")]
struct ErrorPage<'a> {
    status: u16,
    message: &'a str,
    violations: Vec<(String, String)>,
}

/// A page that says what went wrong, and that nothing was changed where it applies.
pub(super) fn error_page(status: StatusCode, message: &str) -> Response {
    render(
        status,
        &ErrorPage {
            status: status.as_u16(),
            message,
            violations: Vec::new(),
        },
    )
}

/// The page of a refused or failed call: its message and field violations.
pub(super) fn failure(status: &tonic::Status) -> Response {
    let http = match status.code() {
        tonic::Code::InvalidArgument | tonic::Code::OutOfRange => StatusCode::BAD_REQUEST,
        tonic::Code::NotFound => StatusCode::NOT_FOUND,
        tonic::Code::PermissionDenied => StatusCode::FORBIDDEN,
        tonic::Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        tonic::Code::FailedPrecondition | tonic::Code::Aborted | tonic::Code::AlreadyExists => {
            StatusCode::CONFLICT
        }
        tonic::Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    // Listed unless the message already says it (the API's messages name their fields).
    let violations = status
        .get_details_bad_request()
        .map(|b| {
            b.field_violations
                .into_iter()
                .filter(|v| {
                    !status
                        .message()
                        .contains(&format!("{}: {}", v.field, v.description))
                })
                .map(|v| (v.field, v.description))
                .collect()
        })
        .unwrap_or_default();
    render(
        http,
        &ErrorPage {
            status: http.as_u16(),
            message: status.message(),
            violations,
        },
    )
}

#[derive(Template)]
#[template(path = "console/sign_in.html")]
struct SignInPage<'a> {
    error: Option<&'a str>,
    next: &'a str,
}

/// The sign-in page, with why the last try failed (or why a session ended), and the page
/// to return to once signed in (checked by `session::safe_next`; "" for the overview).
pub(super) fn sign_in(status: StatusCode, error: Option<&str>, next: &str) -> Response {
    render(status, &SignInPage { error, next })
}

/// A wire timestamp as `2026-12-05 04:22:18 UTC` ("" when unset).
pub(super) fn timestamp(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(|t| DateTime::<Utc>::from_timestamp(t.seconds, u32::try_from(t.nanos).ok()?))
        .map(|t| time(&t))
        .unwrap_or_default()
}

/// A wire timestamp exactly, `seconds.nanos` ("" when unset): what a form sends back so
/// that a change is not made on a value changed since the page was read.
pub(super) fn seen(t: Option<&prost_types::Timestamp>) -> String {
    t.map(|t| format!("{}.{:09}", t.seconds, t.nanos))
        .unwrap_or_default()
}

/// The timestamp a form sent back in the form of [`seen`].
pub(super) fn parse_seen(seen: &str) -> Option<prost_types::Timestamp> {
    let (seconds, nanos) = seen.trim().split_once('.')?;
    Some(prost_types::Timestamp {
        seconds: seconds.parse().ok()?,
        nanos: nanos.parse().ok()?,
    })
}

/// An instant as `2026-12-05 04:22:18 UTC`.
pub(super) fn time(t: &DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// A wire state without its prefix: `NEEDS_RECONCILE`.
pub(super) fn state(state: i32) -> String {
    v1::IntentState::try_from(state)
        .map(|s| s.as_str_name())
        .unwrap_or("UNKNOWN")
        .trim_start_matches("INTENT_STATE_")
        .to_owned()
}

/// A wire decision without its prefix: `DELIVERED`.
pub(super) fn decision(decision: i32) -> String {
    v1::Decision::try_from(decision)
        .map(|d| d.as_str_name())
        .unwrap_or("UNKNOWN")
        .trim_start_matches("DECISION_")
        .to_owned()
}

/// Most payload bytes a page shows.
pub(super) const PAYLOAD_SHOWN: usize = 64 * 1024;

/// Most bytes of a JSON payload once indented; past it, the payload is shown as stored.
const INDENTED_SHOWN: usize = 4 * PAYLOAD_SHOWN;

/// A payload as shown: pretty JSON when it is JSON, its text when it is UTF-8, hex
/// otherwise; at most [`PAYLOAD_SHOWN`] bytes of it. Escaped by the template.
pub(super) struct Payload {
    pub format: &'static str,
    pub text: String,
    pub size: usize,
    pub truncated: bool,
}

impl Payload {
    pub fn of(bytes: &[u8]) -> Self {
        let size = bytes.len();
        if size <= PAYLOAD_SHOWN
            && serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_ok()
            && let Ok(json) = std::str::from_utf8(bytes)
        {
            return Self {
                format: "JSON",
                // Indentation deep enough to outweigh the payload: shown as stored.
                text: indent_json(json, INDENTED_SHOWN).unwrap_or_else(|| json.to_owned()),
                size,
                truncated: false,
            };
        }
        let shown = &bytes[..size.min(PAYLOAD_SHOWN)];
        let text = match std::str::from_utf8(shown) {
            Ok(text) => Some(text),
            // The cut fell inside a character: the text up to it.
            Err(e) if e.error_len().is_none() && size > shown.len() => {
                std::str::from_utf8(&shown[..e.valid_up_to()]).ok()
            }
            Err(_) => None,
        };
        match text {
            Some(text) => Self {
                format: "text",
                text: text.to_owned(),
                size,
                truncated: size > shown.len(),
            },
            None => {
                let shown = &bytes[..size.min(PAYLOAD_SHOWN / 4)];
                let text = shown
                    .chunks(16)
                    .enumerate()
                    .map(|(row, chunk)| {
                        let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
                        format!("{:08x}  {}", row * 16, hex.join(" "))
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                Self {
                    format: "hex",
                    text,
                    size,
                    truncated: size > shown.len(),
                }
            }
        }
    }
}

/// The trace id of a W3C `traceparent` header, if any.
pub(super) fn trace_id(headers: &std::collections::HashMap<String, String>) -> String {
    headers
        .get("traceparent")
        .and_then(|t| t.split('-').nth(1))
        .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_default()
        .to_owned()
}

/// `json` (valid JSON) indented by two spaces, its tokens as they are: keys in their order,
/// repeated ones kept, numbers as written (a parsed value would sort its keys and round
/// large numbers); `None` once it would pass `max_len` bytes.
fn indent_json(json: &str, max_len: usize) -> Option<String> {
    let mut out = String::with_capacity(json.len() * 2);
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = json.chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', 2 * depth));
    };
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.next_if(char::is_ascii_whitespace).is_some() {}
                if let Some(close) = chars.next_if(|c| matches!(c, '}' | ']')) {
                    out.push(close);
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_ascii_whitespace() => {}
            c => out.push(c),
        }
        if out.len() > max_len {
            return None;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::{INDENTED_SHOWN, PAYLOAD_SHOWN, Payload};

    #[test]
    fn json_is_indented_with_its_keys_numbers_and_strings_as_stored() {
        let stored = r#"{"z":1,"a":[ ],"n":12345678901234567890123,"s":"a \"{,:}\" b","z":{}, "l":[1,{"k":null}]}"#;
        let payload = Payload::of(stored.as_bytes());
        assert_eq!(payload.format, "JSON");
        let expected = r#"{
  "z": 1,
  "a": [],
  "n": 12345678901234567890123,
  "s": "a \"{,:}\" b",
  "z": {},
  "l": [
    1,
    {
      "k": null
    }
  ]
}"#;
        assert_eq!(payload.text, expected);
        let plain: serde_json::Value = serde_json::from_str(r#"{"b":[1,2],"a":"x"}"#).unwrap();
        assert_eq!(
            Payload::of(br#"{"b":[1,2],"a":"x"}"#).text,
            serde_json::to_string_pretty(&plain).unwrap().replace(
                "\"a\": \"x\",\n  \"b\": [\n    1,\n    2\n  ]",
                "\"b\": [\n    1,\n    2\n  ],\n  \"a\": \"x\""
            )
        );
    }

    #[test]
    fn json_nested_deep_enough_to_outgrow_its_indentation_budget_is_shown_as_stored() {
        // 127 levels deep (serde_json's most), 64 KiB in all: indented, ~8 MiB.
        let depth = 127;
        let items = (PAYLOAD_SHOWN - 2 * depth - 1) / 2;
        let stored = format!(
            "{}{}0{}",
            "[".repeat(depth),
            "0,".repeat(items),
            "]".repeat(depth)
        );
        let payload = Payload::of(stored.as_bytes());
        assert_eq!(payload.format, "JSON");
        assert_eq!(payload.text, stored);
        assert!(payload.text.len() <= INDENTED_SHOWN);
        // Shallow, the same size is indented.
        let shallow = format!("[{}0]", "0,".repeat(items));
        assert!(Payload::of(shallow.as_bytes()).text.contains("\n  0,"));
    }

    #[test]
    fn a_long_text_cut_inside_a_character_is_shown_as_text_up_to_it() {
        // 3-byte characters: 64 KiB is not a multiple of 3.
        let payload = Payload::of("€".repeat(PAYLOAD_SHOWN).as_bytes());
        assert_eq!(payload.format, "text");
        assert!(payload.truncated);
        assert_eq!(payload.text.len(), PAYLOAD_SHOWN / 3 * 3);
    }

    #[test]
    fn bytes_that_are_not_utf8_are_shown_as_hex() {
        let payload = Payload::of(&[0xff, 0xfe, b'a']);
        assert_eq!(payload.format, "hex");
        assert_eq!(payload.text, "00000000  ff fe 61");
    }
}
