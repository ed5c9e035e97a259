//! What an `outbox.v1` call must pass before its request message is decoded: the API key
//! (from the headers alone, so an unauthenticated call costs no body at all), and the
//! method's own size limit on the request bytes. A decoded message is many times its wire
//! size (an empty `LeaseRef` is 2 bytes on the wire and ~50 in memory; an empty
//! `NewIntent` ~300), so each method accepts only what its largest valid request needs.
//!
//! The caller the key resolved to travels to the handler in the request's extensions
//! ([`Authenticated`]): the handler does not look the key up again.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http_body::Frame;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::{Bytes, Service, http};
use tonic::metadata::MetadataMap;
use tonic::server::NamedService;

use crate::auth::{Authenticator, Caller, Permission};
use crate::codec::DecodeBounds;
use crate::config::Limits;
use crate::outbox::Reason;
use crate::status::refusal;

/// The caller a request's API key resolved to, put into the request's extensions by
/// [`Gate`] before its message was decoded.
#[derive(Debug, Clone)]
pub struct Authenticated(pub Caller);

/// gRPC's message prefix: a compression flag and a big-endian u32 length.
const FRAME_HEADER: usize = 5;

/// The longest valid id on the wire: a UUID in its longest accepted form
/// (`urn:uuid:…`, 45 characters) with its tag and length.
const ID_FIELD: usize = 2 + 45;
/// A `google.protobuf.Timestamp` (seconds and nanos at their longest) with its tag and
/// length: `ReconcileIds.updated_at`, one per id.
const TIMESTAMP_FIELD: usize = 2 + 11 + 6;
/// A `LeaseRef` of two such ids, with its own tag and length.
const LEASE_REF: usize = 2 + 2 * ID_FIELD;
/// Room for the small fields of a message (durations, enums, flags, tags) and a little
/// slack, so that no valid request comes near its limit.
const SMALL_FIELDS: usize = 1024;

/// The `outbox.v1.OutboxService` methods, by the size of what they may ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// Enqueue and Fail: up to `max_message_bytes` (payloads, failure texts).
    Large(&'static str),
    /// Ack, MarkSubmitted, ExtendLease: `max_batch` lease references.
    Leases(&'static str),
    /// Claim: a worker id, a region, up to `max_kinds` kinds, a request id.
    Claim,
    /// Reconcile: up to `max_batch` ids or a filter, an actor and a reason.
    Reconcile,
    /// GetIntent, ListIntents, GetQueueStats, ListQueuePolicies: an id or a filter.
    Inspect(&'static str),
    /// SetQueuePolicy: a kind, numbers, an actor and a reason.
    Policy,
}

impl Method {
    /// The method a request path names (`/outbox.v1.OutboxService/Ack`), if one of ours.
    pub fn of(path: &str) -> Option<Self> {
        let name = path.strip_prefix("/outbox.v1.OutboxService/")?;
        Some(match name {
            "Enqueue" => Self::Large("Enqueue"),
            "Fail" => Self::Large("Fail"),
            "Ack" => Self::Leases("Ack"),
            "MarkSubmitted" => Self::Leases("MarkSubmitted"),
            "ExtendLease" => Self::Leases("ExtendLease"),
            "Claim" => Self::Claim,
            "Reconcile" => Self::Reconcile,
            "GetIntent" => Self::Inspect("GetIntent"),
            "ListIntents" => Self::Inspect("ListIntents"),
            "GetQueueStats" => Self::Inspect("GetQueueStats"),
            "ListQueuePolicies" => Self::Inspect("ListQueuePolicies"),
            "SetQueuePolicy" => Self::Policy,
            _ => return None,
        })
    }

    /// The method's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Large(n) | Self::Leases(n) | Self::Inspect(n) => n,
            Self::Claim => "Claim",
            Self::Reconcile => "Reconcile",
            Self::Policy => "SetQueuePolicy",
        }
    }

    /// The scope a key needs for this method (or `admin`).
    pub fn permission(self) -> Permission {
        match self {
            Self::Large("Enqueue") => Permission::Produce,
            Self::Large(_) | Self::Leases(_) | Self::Claim => Permission::Consume,
            Self::Reconcile | Self::Inspect(_) | Self::Policy => Permission::Operate,
        }
    }

    /// Largest request message of this method, in bytes: what `limits.max_batch` (or
    /// `max_kinds`) items of the largest valid size take, strings counted at 4 bytes a
    /// character. With the default limits: Enqueue and Fail 8 MiB (`max_message_bytes`),
    /// the lease calls 97,024 B, Claim 82,894 B, Reconcile 85,080 B, the inspection calls
    /// 1,939 B.
    pub fn max_request_bytes(self, limits: &Limits) -> usize {
        let name = 2 + 4 * limits.max_name_length;
        let region = 2 + limits.max_region_length;
        let bytes = match self {
            Self::Large(_) => return limits.max_message_bytes,
            Self::Leases(_) => limits.max_batch * LEASE_REF + SMALL_FIELDS,
            Self::Claim => (limits.max_kinds + 2) * name + region + SMALL_FIELDS,
            Self::Reconcile => {
                limits.max_batch * (ID_FIELD + TIMESTAMP_FIELD)
                    + 2 * name
                    + region
                    + 2
                    + 4 * limits.max_text_length
                    + SMALL_FIELDS
            }
            Self::Inspect(_) => name + region + ID_FIELD + SMALL_FIELDS,
            Self::Policy => 2 * name + 2 + 4 * limits.max_text_length + SMALL_FIELDS,
        };
        bytes.min(limits.max_message_bytes)
    }
}

/// The tower layer of [`Gate`].
#[derive(Debug, Clone)]
pub struct GateLayer {
    auth: Arc<Authenticator>,
    limits: Limits,
}

impl GateLayer {
    /// Gates with `auth` and `limits`.
    pub fn new(auth: Arc<Authenticator>, limits: Limits) -> Self {
        Self { auth, limits }
    }
}

impl<S> tower::Layer<S> for GateLayer {
    type Service = Gate<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Gate::new(inner, self.auth.clone(), self.limits.clone())
    }
}

/// Wraps the generated `OutboxService` server: authenticates each call from its headers
/// and bounds its request bytes by [`Method::max_request_bytes`]; see the module
/// documentation. Paths that are not `OutboxService` methods pass untouched.
#[derive(Debug, Clone)]
pub struct Gate<S> {
    inner: S,
    auth: Arc<Authenticator>,
    limits: Arc<Limits>,
}

impl<S> Gate<S> {
    /// Gates `inner` with `auth` and `limits`.
    pub fn new(inner: S, auth: Arc<Authenticator>, limits: Limits) -> Self {
        Self {
            inner,
            auth,
            limits: Arc::new(limits),
        }
    }
}

impl<S: NamedService> NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Gate<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The clone takes the readiness `poll_ready` gave `self.inner` (tower's pattern).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(method) = Method::of(request.uri().path()) else {
            return Box::pin(inner.call(request));
        };
        let auth = self.auth.clone();
        let limits = self.limits.clone();
        Box::pin(async move {
            let metadata = MetadataMap::from_headers(request.headers().clone());
            // A key without the method's scope, or naming a tenant not its own, is refused
            // before its body is read or decoded (the handler checks both again).
            let caller = match auth.authenticate(&metadata).await.and_then(|caller| {
                caller.require(method.permission())?;
                caller.scope(&metadata)?;
                Ok(caller)
            }) {
                Ok(caller) => caller,
                Err(e) => {
                    tracing::debug!(rpc.method = method.name(), error = %e, "call refused before its body");
                    return Ok(Status::from(e).into_http());
                }
            };
            let (mut parts, body) = request.into_parts();
            parts.extensions.insert(Authenticated(caller));
            let body = Capped::new(body, method, method.max_request_bytes(&limits));
            let request = http::Request::from_parts(parts, Body::new(body));
            DecodeBounds::from(&*limits)
                .scope(inner.call(request))
                .await
        })
    }
}

/// A request body that fails, with the status the caller gets, as soon as a message's
/// length prefix is over the method's limit or a second message begins (a unary call
/// carries one): tonic then never buffers, let alone decodes, it.
struct Capped {
    inner: Body,
    method: Method,
    limit: usize,
    /// Bytes of the current message's length prefix read so far.
    header: [u8; FRAME_HEADER],
    header_read: usize,
    /// Bytes of the current message still to come.
    message_left: usize,
    messages: usize,
    failed: bool,
}

impl Capped {
    fn new(inner: Body, method: Method, limit: usize) -> Self {
        Self {
            inner,
            method,
            limit,
            header: [0; FRAME_HEADER],
            header_read: 0,
            message_left: 0,
            messages: 0,
            failed: false,
        }
    }

    /// Follows the message framing through `data`.
    fn check(&mut self, mut data: &[u8]) -> Result<(), Status> {
        while !data.is_empty() {
            if self.message_left > 0 {
                let n = self.message_left.min(data.len());
                self.message_left -= n;
                data = &data[n..];
                continue;
            }
            if self.header_read == 0 {
                self.messages += 1;
                if self.messages > 1 {
                    return Err(refusal(
                        Reason::InvalidArgument,
                        format!("a {} call carries one request message", self.method.name()),
                    ));
                }
            }
            let n = (FRAME_HEADER - self.header_read).min(data.len());
            self.header[self.header_read..self.header_read + n].copy_from_slice(&data[..n]);
            self.header_read += n;
            data = &data[n..];
            if self.header_read == FRAME_HEADER {
                self.header_read = 0;
                let len = u32::from_be_bytes([
                    self.header[1],
                    self.header[2],
                    self.header[3],
                    self.header[4],
                ]) as usize;
                if len > self.limit {
                    return Err(too_large(self.method, len, self.limit));
                }
                self.message_left = len;
            }
        }
        Ok(())
    }
}

/// RESOURCE_EXHAUSTED (reason PAYLOAD_TOO_LARGE) for a request message over its method's limit.
fn too_large(method: Method, len: usize, limit: usize) -> Status {
    let why = match method {
        Method::Large(_) => "OUTBOX_LIMITS__MAX_MESSAGE_BYTES".to_owned(),
        _ => format!(
            "what the largest valid {} request takes at the configured limits",
            method.name()
        ),
    };
    refusal(
        Reason::PayloadTooLarge,
        format!(
            "request message of {len} bytes is over the limit of {}: {limit} bytes ({why})",
            method.name()
        ),
    )
}

impl http_body::Body for Capped {
    type Data = Bytes;
    type Error = tonic::codegen::StdError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(status)) => return Poll::Ready(Some(Err(Box::new(status)))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref()
            && let Err(status) = self.check(data)
        {
            self.failed = true;
            return Poll::Ready(Some(Err(Box::new(status))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_limits_give_each_method_its_request_size() {
        let limits = Limits::default();
        let of = |path: &str| Method::of(path).unwrap().max_request_bytes(&limits);
        let got: Vec<usize> = [
            "Enqueue",
            "Fail",
            "Ack",
            "MarkSubmitted",
            "ExtendLease",
            "Claim",
            "Reconcile",
            "GetIntent",
            "ListIntents",
            "GetQueueStats",
        ]
        .iter()
        .map(|m| of(&format!("/outbox.v1.OutboxService/{m}")))
        .collect();
        let mib8 = 8 * 1024 * 1024;
        let leases = 97_024;
        assert_eq!(
            got,
            [
                mib8, mib8, leases, leases, leases, 82_894, 85_080, 1_939, 1_939, 1_939
            ]
        );
        assert_eq!(Method::of("/grpc.health.v1.Health/Check"), None);
    }

    #[test]
    fn a_message_over_the_limit_or_a_second_message_fails_at_its_prefix() {
        let capped = || Capped::new(Body::empty(), Method::Leases("Ack"), 100);
        let prefix = |len: u32| {
            let mut p = vec![0u8];
            p.extend(len.to_be_bytes());
            p
        };
        let mut c = capped();
        // A prefix split across frames, then the message in pieces.
        c.check(&prefix(100)[..2]).unwrap();
        c.check(&prefix(100)[2..]).unwrap();
        c.check(&[0; 60]).unwrap();
        c.check(&[0; 40]).unwrap();
        let second = c.check(&prefix(1)).unwrap_err();
        assert_eq!(second.code(), tonic::Code::InvalidArgument);

        let over = capped().check(&prefix(101)).unwrap_err();
        assert_eq!(over.code(), tonic::Code::ResourceExhausted);
        assert!(
            over.message()
                .contains("101 bytes is over the limit of Ack"),
            "{}",
            over.message()
        );
    }
}
