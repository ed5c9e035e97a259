//! The gRPC codec of `outbox.v1` (wired in `build.rs` with `codec_path`): protobuf through
//! prost exactly like `tonic_prost::ProstCodec`, except that a *request* that does not
//! decode (invalid UTF-8 in a string, a wrong wire type, a truncated message) is the
//! caller's fault and answers INVALID_ARGUMENT naming the field, where tonic-prost answers
//! INTERNAL. A response that does not decode (client side) stays INTERNAL: that one is the
//! server's fault, as the gRPC status code guide says.
//!
//! A request of a batch method is counted before it is decoded ([`DecodeBounds`]): a
//! message of millions of empty items (2 bytes each on the wire, hundreds in memory) is
//! refused by its count, as it would be after decoding, without building them.
//!
//! [`ClientFaults`] wraps the generated server for the framing errors tonic raises before
//! any codec runs: a message over `OUTBOX_LIMITS__MAX_MESSAGE_BYTES` answers
//! RESOURCE_EXHAUSTED (tonic: OUT_OF_RANGE), a truncated or missing request message
//! INVALID_ARGUMENT (tonic: INTERNAL).

use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use prost::Message;
use prost::bytes::Buf;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{Service, http};
use tonic::server::NamedService;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::config::Limits;
use crate::outbox::{Error, FieldViolation, Reason};
use crate::status::ERROR_DOMAIN;

/// Encodes `T` and decodes `U` with prost; see the module documentation.
#[derive(Debug, Clone)]
pub struct OutboxCodec<T, U> {
    _types: PhantomData<fn(T) -> U>,
}

impl<T, U> Default for OutboxCodec<T, U> {
    fn default() -> Self {
        Self {
            _types: PhantomData,
        }
    }
}

impl<T, U> tonic::codec::Codec for OutboxCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = OutboxEncoder<T>;
    type Decoder = OutboxDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        OutboxEncoder {
            inner: tonic_prost::ProstEncoder::default(),
        }
    }

    fn decoder(&mut self) -> Self::Decoder {
        OutboxDecoder { _type: PhantomData }
    }
}

/// Encodes `T` (tonic-prost's encoder).
#[derive(Debug, Clone)]
pub struct OutboxEncoder<T> {
    inner: tonic_prost::ProstEncoder<T>,
}

impl<T: Message> Encoder for OutboxEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        self.inner.encode(item, buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}

/// Decodes `U`, mapping decode failures with [`decode_error`].
#[derive(Debug, Clone)]
pub struct OutboxDecoder<U> {
    _type: PhantomData<fn() -> U>,
}

impl<U: Message + Default> Decoder for OutboxDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        if let Ok(bounds) = DECODE_BOUNDS.try_with(|b| *b) {
            let bytes = buf.chunk();
            // Contiguous (tonic buffers a whole message); if ever not, prost decodes alone.
            if bytes.len() == buf.remaining() {
                bounds
                    .check(message_name::<U>(), bytes)
                    .map_err(Status::from)?;
            }
        }
        U::decode(buf)
            .map(Some)
            .map_err(|e| decode_error(message_name::<U>(), &e))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

tokio::task_local! {
    /// The bounds of the request being decoded, set by `crate::gate::Gate` around the call
    /// (the generated server makes its codec with `Default`, so it cannot be handed them).
    static DECODE_BOUNDS: DecodeBounds;
}

/// Most items a request may carry, checked on its wire bytes before it is decoded.
#[derive(Debug, Clone, Copy)]
pub struct DecodeBounds {
    max_batch: usize,
    max_headers: usize,
}

impl From<&Limits> for DecodeBounds {
    fn from(limits: &Limits) -> Self {
        Self {
            max_batch: limits.max_batch,
            max_headers: limits.max_headers,
        }
    }
}

impl DecodeBounds {
    /// Runs `call` (a server call, which decodes its request) under these bounds.
    pub async fn scope<F: Future>(self, call: F) -> F::Output {
        DECODE_BOUNDS.scope(self, call).await
    }

    /// Refuses an Enqueue of more than `max_batch` intents or of more headers than
    /// `max_batch` intents of `max_headers` each, and a Fail of more than `max_batch` failures, as validation
    /// would (same reasons and fields). The methods whose items are bounded by their
    /// request size alone (`crate::gate::Method::max_request_bytes`) are not counted.
    ///
    /// # Errors
    /// [`Error::LimitExceeded`] (BATCH_TOO_LARGE) or [`Error::InvalidArgument`].
    pub fn check(self, message: &str, bytes: &[u8]) -> Result<(), Error> {
        let batch = |field: &str, n: usize| {
            if n > self.max_batch {
                return Err(Error::LimitExceeded(
                    Reason::BatchTooLarge,
                    vec![FieldViolation::new(
                        field,
                        format!("{n} items; at most {} per request", self.max_batch),
                    )],
                ));
            }
            Ok(())
        };
        match message {
            "EnqueueRequest" => {
                batch("intents", count(bytes, 1))?;
                // Headers are bounded in all (validation names each intent over the limit
                // along with every other problem of the request).
                let mut headers = Vec::new();
                walk(bytes, 1, |intent| headers.push(count(intent, 6)));
                if headers.iter().sum::<usize>() <= self.max_batch * self.max_headers {
                    return Ok(());
                }
                let (i, n) = headers
                    .into_iter()
                    .enumerate()
                    .find(|(_, n)| *n > self.max_headers)
                    .unwrap_or_default();
                Err(Error::InvalidArgument(vec![FieldViolation::new(
                    format!("intents[{i}].headers"),
                    format!("{n} headers; at most {}", self.max_headers),
                )]))
            }
            "FailRequest" => batch("failures", count(bytes, 1)),
            _ => Ok(()),
        }
    }
}

/// How many times the length-delimited field `number` occurs at the top level of `bytes`.
fn count(bytes: &[u8], number: u64) -> usize {
    let mut n = 0;
    walk(bytes, number, |_| n += 1);
    n
}

/// Calls `each` with the contents of every length-delimited field `number` at the top
/// level of `bytes`, skipping every other field. Stops at the first malformed field:
/// prost reports it when it decodes.
fn walk<'a>(mut bytes: &'a [u8], number: u64, mut each: impl FnMut(&'a [u8])) {
    while !bytes.is_empty() {
        let Ok(key) = prost::encoding::decode_varint(&mut bytes) else {
            return;
        };
        let skip = match key & 7 {
            0 => match prost::encoding::decode_varint(&mut bytes) {
                Ok(_) => 0,
                Err(_) => return,
            },
            1 => 8,
            2 => match prost::encoding::decode_varint(&mut bytes) {
                Ok(len) if len <= bytes.len() as u64 => {
                    let len = len as usize;
                    if key >> 3 == number {
                        each(&bytes[..len]);
                    }
                    len
                }
                _ => return,
            },
            5 => 4,
            _ => return,
        };
        if skip > bytes.len() {
            return;
        }
        bytes = &bytes[skip..];
    }
}

/// Short name of a generated message type, e.g. `EnqueueRequest`.
pub fn message_name<U>() -> &'static str {
    let full = std::any::type_name::<U>();
    // Generic parameters never occur in generated message types; keep the last path segment.
    full.rsplit("::").next().unwrap_or(full)
}

/// The status for bytes that are not a valid `message` (a short message type name).
/// Requests (every type not named `…Response`) answer INVALID_ARGUMENT with an ErrorInfo
/// (reason INVALID_ARGUMENT, domain outboxd, metadata `message`) and a BadRequest violation
/// whose field is the path to the failure when prost located it (`intents.kind`), else
/// empty: the request as a whole.
/// Responses answer INTERNAL, as tonic-prost does.
pub fn decode_error(message: &str, error: &prost::DecodeError) -> Status {
    let (path, what) = located(error);
    if message.ends_with("Response") {
        return Status::internal(format!("response is not a valid {message}: {error}"));
    }
    let description = if path.is_empty() {
        what.clone()
    } else {
        format!("{path}: {what}")
    };
    let mut details = ErrorDetails::with_error_info(
        Reason::InvalidArgument.as_str(),
        ERROR_DOMAIN,
        HashMap::from([("message".to_owned(), format!("outbox.v1.{message}"))]),
    );
    details.add_bad_request_violation(path, what);
    Status::with_error_details(
        tonic::Code::InvalidArgument,
        format!("request is not a valid {message}: {description}"),
        details,
    )
}

/// Splits prost's `failed to decode Protobuf message: Inner.field: Outer.field: what` into
/// the field path from the outermost message (`field.field`) and `what`.
fn located(error: &prost::DecodeError) -> (String, String) {
    let text = error.to_string();
    let rest = text
        .strip_prefix("failed to decode Protobuf message: ")
        .unwrap_or(&text);
    let mut fields = Vec::new();
    let mut what = rest;
    while let Some((segment, tail)) = what.split_once(": ") {
        match segment.split_once('.') {
            Some((m, f)) if is_identifier(m) && is_identifier(f) => {
                fields.push(f);
                what = tail;
            }
            _ => break,
        }
    }
    fields.reverse();
    (fields.join("."), what.to_owned())
}

/// A gRPC service whose transport-level decode failures caused by the client answer the
/// codes the gRPC status guide gives them instead of tonic's; see the module documentation.
#[derive(Debug, Clone)]
pub struct ClientFaults<S> {
    inner: S,
}

impl<S> ClientFaults<S> {
    /// Wraps `inner` (a generated `…Server`).
    pub fn new(inner: S) -> Self {
        Self { inner }
    }
}

/// The tower layer of [`ClientFaults`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientFaultsLayer;

impl<S> tower::Layer<S> for ClientFaultsLayer {
    type Service = ClientFaults<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ClientFaults::new(inner)
    }
}

impl<S: NamedService> NamedService for ClientFaults<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B, R> Service<http::Request<B>> for ClientFaults<S>
where
    S: Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let response = self.inner.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            // A failed unary decode answers "trailers-only": the status is in the headers.
            if let Some(status) = Status::from_header_map(response.headers())
                && let Some(replacement) = client_fault(&status)
            {
                let headers = response.headers_mut();
                for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
                    headers.remove(name);
                }
                if replacement.add_header(headers).is_err() {
                    status.add_header(headers).ok();
                }
            }
            Ok(response)
        })
    }
}

/// The status a client-caused transport failure should have had, if `status` is one.
/// Matched on tonic 0.14's messages: `tests/api/hostile.rs` notices if they change.
pub fn client_fault(status: &Status) -> Option<Status> {
    let message = status.message();
    let (code, reason, text) = match status.code() {
        Code::OutOfRange if message.starts_with("Error, decoded message length too large") => (
            Code::ResourceExhausted,
            Reason::PayloadTooLarge,
            format!(
                "request message too large (OUTBOX_LIMITS__MAX_MESSAGE_BYTES): {}",
                message.trim_start_matches("Error, decoded message length too large: ")
            ),
        ),
        Code::Internal if message == "Unexpected EOF decoding stream." => (
            Code::InvalidArgument,
            Reason::InvalidArgument,
            "request is truncated: the stream ended inside a message".to_owned(),
        ),
        Code::Internal if message == "Missing request message." => (
            Code::InvalidArgument,
            Reason::InvalidArgument,
            "request carries no message".to_owned(),
        ),
        _ => return None,
    };
    let details = ErrorDetails::with_error_info(reason.as_str(), ERROR_DOMAIN, HashMap::new());
    Some(Status::with_error_details(code, text, details))
}

fn is_identifier(s: &str) -> bool {
    s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::v1;

    #[test]
    fn invalid_utf8_in_a_nested_string_names_the_field_path() {
        // EnqueueRequest.intents[0] = NewIntent { kind: b"\xff" }
        let bytes = [0x0a, 0x03, 0x0a, 0x01, 0xff];
        let error = v1::EnqueueRequest::decode(&bytes[..]).unwrap_err();
        let status = decode_error(message_name::<v1::EnqueueRequest>(), &error);
        assert_eq!(status.code(), Code::InvalidArgument);
        assert!(
            status
                .message()
                .starts_with("request is not a valid EnqueueRequest: intents.kind: "),
            "{}",
            status.message()
        );
        let details = status.get_error_details();
        assert_eq!(details.error_info().unwrap().reason, "INVALID_ARGUMENT");
        assert_eq!(details.error_info().unwrap().domain, "outboxd");
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations[0].field, "intents.kind");
    }

    #[test]
    fn bytes_that_are_no_message_at_all_get_a_violation_of_the_whole_request() {
        let error = v1::AckRequest::decode(&[0xff; 4][..]).unwrap_err();
        let status = decode_error(message_name::<v1::AckRequest>(), &error);
        assert_eq!(status.code(), Code::InvalidArgument);
        let details = status.get_error_details();
        let violations = &details.bad_request().unwrap().field_violations;
        assert_eq!(violations.len(), 1);
        assert_eq!(violations[0].field, "");
        assert!(
            violations[0].description.contains("varint"),
            "{violations:?}"
        );
    }

    #[test]
    fn an_undecodable_response_stays_internal() {
        let error = v1::EnqueueResponse::decode(&[0x0a, 0x05][..]).unwrap_err();
        let status = decode_error(message_name::<v1::EnqueueResponse>(), &error);
        assert_eq!(status.code(), Code::Internal);
    }
}
