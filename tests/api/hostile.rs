//! A catalogue of malformed and hostile requests against one server, each with the status
//! it must get: empty and oversized batches and messages, bad strings and bytes, wrong wire
//! types, out-of-range durations and instants, unknown enum values, bad ids and tokens,
//! other tenants' ids and leases, bad credentials. Afterwards no stored row has changed,
//! the server answers SERVING and ordinary work still goes through.
//! Run with `--nocapture` to see the table of case → status.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use outboxd::proto::v1::{self, FailOutcome, IntentState};
use prost::Message;
use prost::bytes::{Buf, BufMut};
use sqlx::Connection as _;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{Body as _, Service, http};
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_types::StatusExt;
use uuid::Uuid;

use crate::helpers::{
    TestApp, claim_request, create_key, duration, id_of, intent, lease_ref, populate_globex,
};

/// Smaller than the default 8 MiB so the oversized-message case sends little.
const MAX_MESSAGE_BYTES: usize = 2 * 1024 * 1024;
const SERVICE: &str = "/outbox.v1.OutboxService/";

// ---- what a call got, and what a case expects -----------------------------------------

/// The outcome of one call: a whole-call status, or the first item's error of a batch.
#[derive(Debug)]
struct Got {
    code: Code,
    /// ErrorInfo reason (whole call, domain outboxd) or the item's reason.
    reason: String,
    /// Fields named by the BadRequest.
    fields: Vec<String>,
    per_item: bool,
    message: String,
}

impl Got {
    fn status(status: &Status) -> Self {
        let details = status.get_error_details();
        let reason = details
            .error_info()
            .filter(|i| i.domain == "outboxd")
            .map(|i| i.reason.clone())
            .unwrap_or_default();
        let fields = details
            .bad_request()
            .map(|b| b.field_violations.iter().map(|v| v.field.clone()).collect())
            .unwrap_or_default();
        Self {
            code: status.code(),
            reason,
            fields,
            per_item: false,
            message: status.message().chars().take(160).collect(),
        }
    }

    fn ok(per_item: bool) -> Self {
        Self {
            code: Code::Ok,
            reason: String::new(),
            fields: Vec::new(),
            per_item,
            message: String::new(),
        }
    }
}

/// The whole-call outcome of a typed call.
fn whole<T>(result: Result<tonic::Response<T>, Status>) -> Got {
    match result {
        Ok(_) => Got::ok(false),
        Err(s) => Got::status(&s),
    }
}

/// The first item's outcome of a batch call (or the whole-call error).
fn item<T>(
    result: Result<tonic::Response<T>, Status>,
    first_error: impl FnOnce(T) -> Option<v1::ItemError>,
) -> Got {
    match result {
        Err(s) => Got::status(&s),
        Ok(response) => match first_error(response.into_inner()) {
            None => Got::ok(true),
            Some(e) => Got {
                code: Code::from_i32(e.code),
                reason: e.reason,
                fields: Vec::new(),
                per_item: true,
                message: e.message,
            },
        },
    }
}

fn first_lease_error(results: Vec<v1::LeaseResult>) -> Option<v1::ItemError> {
    results.into_iter().next().and_then(|r| r.error)
}

#[derive(Debug, Clone, Copy)]
struct Expect {
    code: Code,
    /// ErrorInfo reason; "" when the status carries none (transport, tonic itself).
    reason: &'static str,
    /// A field the BadRequest must name; "" for none.
    field: &'static str,
    per_item: bool,
}

fn call(code: Code, reason: &'static str, field: &'static str) -> Expect {
    Expect {
        code,
        reason,
        field,
        per_item: false,
    }
}

fn invalid(field: &'static str) -> Expect {
    call(Code::InvalidArgument, "INVALID_ARGUMENT", field)
}

fn per_item(code: Code, reason: &'static str) -> Expect {
    Expect {
        code,
        reason,
        field: "",
        per_item: true,
    }
}

impl Expect {
    fn mismatch(&self, got: &Got) -> Option<String> {
        let field_ok = self.field.is_empty() || got.fields.iter().any(|f| f == self.field);
        (got.code != self.code
            || got.reason != self.reason
            || got.per_item != self.per_item
            || !field_ok)
            .then(|| format!("expected {self:?}, got {got:?}"))
    }
}

type Run<'a> = Pin<Box<dyn Future<Output = Got> + 'a>>;

struct Case<'a> {
    name: &'static str,
    expect: Expect,
    run: Run<'a>,
}

macro_rules! case {
    ($cases:ident, $name:literal, $expect:expr, $run:expr) => {
        $cases.push(Case {
            name: $name,
            expect: $expect,
            run: Box::pin($run),
        })
    };
}

// ---- raw requests: bytes no typed client would send -----------------------------------

/// Sends and receives message bytes as they are.
#[derive(Debug, Clone, Default)]
struct RawCodec;

#[derive(Debug)]
struct RawEncoder;

#[derive(Debug)]
struct RawDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }
}

/// A channel and a key for raw calls.
struct Raw {
    channel: Channel,
    key: String,
}

impl Raw {
    /// One well-framed gRPC message of arbitrary bytes.
    async fn unary(&self, method: &str, body: Vec<u8>) -> Got {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready().await.unwrap();
        let mut request = tonic::Request::new(body);
        request.metadata_mut().insert(
            "authorization",
            MetadataValue::try_from(format!("Bearer {}", self.key)).unwrap(),
        );
        let path = http::uri::PathAndQuery::try_from(format!("{SERVICE}{method}")).unwrap();
        whole(grpc.unary(request, path, RawCodec).await)
    }

    /// An HTTP/2 request whose body is `body` as is (gRPC framing included), with extra
    /// headers; reads the status from the headers (trailers-only) or the trailers.
    async fn http(&self, method: &str, body: &str, headers: &[(&str, &[u8])]) -> Got {
        let mut builder = http::Request::builder()
            .method("POST")
            .uri(format!("{SERVICE}{method}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers");
        if !self.key.is_empty() {
            builder = builder.header("authorization", format!("Bearer {}", self.key));
        }
        for (name, value) in headers {
            builder = builder.header(
                *name,
                http::HeaderValue::from_bytes(value).expect("header value"),
            );
        }
        let request = builder
            .body(tonic::body::Body::new(body.to_owned()))
            .unwrap();
        let mut channel = self.channel.clone();
        std::future::poll_fn(|cx| channel.poll_ready(cx))
            .await
            .unwrap();
        let response = channel.call(request).await.expect("HTTP/2 response");
        if let Some(status) = Status::from_header_map(response.headers()) {
            return Got::status(&status);
        }
        let mut body = std::pin::pin!(response.into_body());
        while let Some(frame) = std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
            if let Ok(trailers) = frame.expect("response body").into_trailers()
                && let Some(status) = Status::from_header_map(&trailers)
            {
                return Got::status(&status);
            }
        }
        panic!("no grpc-status in the response to {method}");
    }
}

/// `message` encoded, with the bytes of `marker` replaced by as many of `with` (lengths
/// stay right, so only the content is wrong).
fn patched(message: &impl Message, marker: &str, with: u8) -> Vec<u8> {
    let mut bytes = message.encode_to_vec();
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker.as_bytes())
        .expect("marker in the encoding");
    bytes[at..at + marker.len()].fill(with);
    bytes
}

/// A gRPC frame header (uncompressed unless `compressed`) announcing `len` bytes.
fn frame(compressed: bool, len: u32, body: &str) -> String {
    let mut s = String::from(if compressed { '\u{1}' } else { '\u{0}' });
    for b in len.to_be_bytes() {
        assert!(b < 0x80, "keep the frame valid UTF-8 for the String body");
        s.push(char::from(b));
    }
    s.push_str(body);
    s
}

// ---- seed data ------------------------------------------------------------------------

struct Seed {
    acme_lease: v1::Lease,
    globex_pending: String,
    globex_lease: v1::Lease,
    globex_waiting: String,
    committed_token: String,
    aborted_token: String,
    cluster_id: String,
    /// `outbox.server_incarnation()`, the third part of a token.
    incarnation: i64,
    produce_key: String,
    consume_key: String,
    eu_key: String,
    two_tenant_key: String,
    revoked_key: String,
    raw: Raw,
}

async fn seed(app: &TestApp) -> Seed {
    app.enqueue_n("seed", 3).await;
    let acme_lease = app.claim_n("seed-worker", 1).await.remove(0);

    let globex = populate_globex(app).await;

    let mut producer = app.producer().await;
    let token = |committed: bool| {
        let url = app.url.clone();
        async move {
            let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
            let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
            let token: String = sqlx::query_scalar("SELECT outbox.txn_token()")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            if committed {
                tx.commit().await.unwrap();
            } else {
                tx.rollback().await.unwrap();
            }
            token
        }
    };
    let committed_token = token(true).await;
    let aborted_token = token(false).await;
    let cluster_id: String =
        sqlx::query_scalar("SELECT system_identifier::text FROM pg_control_system()")
            .fetch_one(&mut producer)
            .await
            .unwrap();

    let revoked_key = create_key(&app.pool, "hostile-revoked", &["acme"], &["admin"], &[]).await;
    outboxd::outbox::store::revoke_api_key(&app.pool, "hostile-revoked")
        .await
        .unwrap();
    Seed {
        acme_lease,
        globex_pending: globex.pending,
        globex_lease: globex.leased,
        globex_waiting: globex.waiting,
        committed_token,
        aborted_token,
        cluster_id,
        incarnation: sqlx::query_scalar("SELECT outbox.server_incarnation()")
            .fetch_one(&mut producer)
            .await
            .unwrap(),
        produce_key: app.key(&["acme"], &["produce"], &[]).await,
        consume_key: app.key(&["acme"], &["consume"], &[]).await,
        eu_key: app.key(&["acme"], &["produce"], &["eu"]).await,
        two_tenant_key: app.key(&["acme", "globex"], &["admin"], &[]).await,
        revoked_key,
        raw: Raw {
            channel: app.client_channel().await,
            key: app.key(&["acme"], &["admin"], &[]).await,
        },
    }
}

/// Every row of every table of the outbox schema, as text.
async fn every_row(app: &TestApp) -> Vec<String> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables \
         WHERE table_schema = 'outbox' AND table_type = 'BASE TABLE' ORDER BY 1",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let mut rows = Vec::new();
    for table in tables {
        // Names come from the catalogue, not from input.
        let sql =
            format!("SELECT '{table}: ' || row_to_json(t)::text FROM outbox.{table} t ORDER BY 1");
        rows.extend(
            sqlx::query_scalar::<_, String>(&sql)
                .fetch_all(&app.pool)
                .await
                .unwrap(),
        );
    }
    rows
}

// ---- request builders -----------------------------------------------------------------

fn enqueue_of(intents: Vec<v1::NewIntent>) -> v1::EnqueueRequest {
    v1::EnqueueRequest {
        intents,
        txn_token: String::new(),
    }
}

fn one(f: impl FnOnce(&mut v1::NewIntent)) -> v1::EnqueueRequest {
    let mut i = intent("hostile.test", "{}");
    f(&mut i);
    enqueue_of(vec![i])
}

fn with_token(token: String) -> v1::EnqueueRequest {
    v1::EnqueueRequest {
        intents: vec![intent("hostile.test", "{}")],
        txn_token: token,
    }
}

fn claim_with(f: impl FnOnce(&mut v1::ClaimRequest)) -> v1::ClaimRequest {
    let mut c = claim_request("hostile-worker", 1);
    // Nothing is claimable for this kind, so even an accepted claim would change nothing.
    c.kinds = vec!["hostile.none".into()];
    f(&mut c);
    c
}

fn pd(seconds: i64, nanos: i32) -> prost_types::Duration {
    prost_types::Duration { seconds, nanos }
}

fn lease(intent_id: &str, lease_id: &str) -> v1::LeaseRef {
    v1::LeaseRef {
        intent_id: intent_id.to_owned(),
        lease_id: lease_id.to_owned(),
    }
}

fn random_ref() -> v1::LeaseRef {
    lease(&Uuid::now_v7().to_string(), &Uuid::now_v7().to_string())
}

fn reconcile_ids(ids: Vec<String>) -> v1::ReconcileRequest {
    v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Ids(v1::ReconcileIds {
            ids,
            ..Default::default()
        })),
        decision: v1::Decision::Delivered as i32,
        actor: "mallory".into(),
        reason: "hostile".into(),
        limit: 0,
    }
}

fn reconcile_filter(f: impl FnOnce(&mut v1::ReconcileFilter)) -> v1::ReconcileRequest {
    let mut filter = v1::ReconcileFilter {
        states: vec![IntentState::NeedsReconcile as i32],
        ..Default::default()
    };
    f(&mut filter);
    v1::ReconcileRequest {
        target: Some(v1::reconcile_request::Target::Filter(filter)),
        ..reconcile_ids(vec![])
    }
}

/// Year -10000: valid for chrono, refused by PostgreSQL's timestamptz.
const ANCIENT: prost_types::Timestamp = prost_types::Timestamp {
    seconds: -377_705_116_800,
    nanos: 0,
};

// ---- the catalogue --------------------------------------------------------------------

#[tokio::test]
async fn hostile_requests_get_their_status_and_change_nothing() {
    let app = TestApp::spawn_with(|s| s.limits.max_message_bytes = MAX_MESSAGE_BYTES).await;
    let seed = seed(&app).await;
    let before = every_row(&app).await;
    let intents_before = app.snapshot().await;
    let (a, s) = (&app, &seed);
    let lim = &app.settings.limits;
    let mut cases: Vec<Case<'_>> = Vec::new();

    // -- Enqueue: batches, sizes, strings.
    case!(
        cases,
        "Enqueue: empty batch",
        invalid("intents"),
        async move { whole(a.client().enqueue(enqueue_of(vec![])).await) }
    );
    case!(
        cases,
        "Enqueue: batch of max_batch + 1 intents",
        call(Code::ResourceExhausted, "BATCH_TOO_LARGE", "intents"),
        async move {
            let many = vec![intent("hostile.test", "{}"); lim.max_batch + 1];
            whole(a.client().enqueue(enqueue_of(many)).await)
        }
    );
    case!(
        cases,
        "Enqueue: payload of max_payload_bytes + 1",
        call(
            Code::ResourceExhausted,
            "PAYLOAD_TOO_LARGE",
            "intents[0].payload"
        ),
        async move {
            let big = lim.max_payload_bytes + 1;
            whole(
                a.client()
                    .enqueue(one(|i| i.payload = vec![b'x'; big]))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Enqueue: message over OUTBOX_LIMITS__MAX_MESSAGE_BYTES",
        call(Code::ResourceExhausted, "PAYLOAD_TOO_LARGE", ""),
        async move {
            let huge = vec![b'x'; MAX_MESSAGE_BYTES + 1024];
            whole(a.client().enqueue(one(|i| i.payload = huge)).await)
        }
    );
    case!(
        cases,
        "Enqueue: 1000 intents, every one invalid (bounded error)",
        invalid("intents[0].kind"),
        async move {
            let bad = vec![intent("bad kind\u{0}", "{}"); lim.max_batch];
            whole(a.client().enqueue(enqueue_of(bad)).await)
        }
    );
    case!(
        cases,
        "Enqueue: max_headers + 1 headers",
        invalid("intents[0].headers"),
        async move {
            let req = one(|i| {
                i.headers = (0..=lim.max_headers)
                    .map(|n| (format!("h{n}"), "v".into()))
                    .collect()
            });
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: header name over the length limit",
        call(Code::InvalidArgument, "INVALID_ARGUMENT", ""),
        async move {
            let key = "k".repeat(lim.max_header_key_length + 1);
            let req = one(|i| {
                i.headers.insert(key, "v".into());
            });
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: header value over the length limit",
        invalid("intents[0].headers[\"x-big\"]"),
        async move {
            let value = "v".repeat(lim.max_header_value_length + 1);
            let req = one(|i| {
                i.headers.insert("x-big".into(), value);
            });
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: header name with a space and unicode",
        invalid("intents[0].headers[\"x bad é\"]"),
        async move {
            let req = one(|i| {
                i.headers.insert("x bad é".into(), "v".into());
            });
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: NUL in a header value",
        invalid("intents[0].headers[\"x-note\"]"),
        async move {
            let req = one(|i| {
                i.headers.insert("x-note".into(), "a\0b".into());
            });
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: empty kind",
        invalid("intents[0].kind"),
        async move { whole(a.client().enqueue(one(|i| i.kind.clear())).await) }
    );
    case!(
        cases,
        "Enqueue: kind over the name length limit",
        invalid("intents[0].kind"),
        async move {
            let kind = "k".repeat(lim.max_name_length + 1);
            whole(a.client().enqueue(one(|i| i.kind = kind)).await)
        }
    );
    case!(
        cases,
        "Enqueue: newline in the idempotency key",
        invalid("intents[0].idempotency_key"),
        async move {
            let req = one(|i| i.idempotency_key = "line\nbreak".into());
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: ordering key over the name length limit",
        invalid("intents[0].ordering_key"),
        async move {
            let key = "o".repeat(lim.max_name_length + 1);
            whole(a.client().enqueue(one(|i| i.ordering_key = key)).await)
        }
    );
    case!(
        cases,
        "Enqueue: tab in the ordering key",
        invalid("intents[0].ordering_key"),
        async move {
            let req = one(|i| i.ordering_key = "order\t7".into());
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: ordering key over the name length limit",
        invalid("ordering_key"),
        async move {
            let req = v1::ListIntentsRequest {
                ordering_key: "o".repeat(lim.max_name_length + 1),
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: NUL in the content type",
        invalid("intents[0].content_type"),
        async move {
            let req = one(|i| i.content_type = "application/json\0".into());
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: region with a space",
        invalid("intents[0].region"),
        async move {
            whole(
                a.client()
                    .enqueue(one(|i| i.region = "eu west".into()))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Enqueue: one idempotency key twice in a batch",
        invalid("intents[1].idempotency_key"),
        async move {
            let mut i = intent("hostile.test", "{}");
            i.idempotency_key = "twice".into();
            whole(a.client().enqueue(enqueue_of(vec![i.clone(), i])).await)
        }
    );
    case!(
        cases,
        "Enqueue: max_attempts -1",
        invalid("intents[0].max_attempts"),
        async move { whole(a.client().enqueue(one(|i| i.max_attempts = -1)).await) }
    );
    case!(
        cases,
        "Enqueue: delay of i64::MAX seconds",
        invalid("intents[0].delay"),
        async move {
            let req = one(|i| {
                i.schedule = Some(v1::new_intent::Schedule::Delay(pd(i64::MAX, 999_999_999)))
            });
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: delay with negative nanos",
        invalid("intents[0].delay"),
        async move {
            let req = one(|i| i.schedule = Some(v1::new_intent::Schedule::Delay(pd(0, -1))));
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: available_at in the year -10000",
        invalid("intents[0].available_at"),
        async move {
            let req = one(|i| i.schedule = Some(v1::new_intent::Schedule::AvailableAt(ANCIENT)));
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: available_at two years ahead",
        invalid("intents[0].available_at"),
        async move {
            let at = prost_types::Timestamp {
                seconds: chrono::Utc::now().timestamp() + 2 * 366 * 86_400,
                nanos: 0,
            };
            let req = one(|i| i.schedule = Some(v1::new_intent::Schedule::AvailableAt(at)));
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: available_at with nanos out of range",
        invalid("intents[0].available_at"),
        async move {
            let at = prost_types::Timestamp {
                seconds: 0,
                nanos: 2_000_000_000,
            };
            let req = one(|i| i.schedule = Some(v1::new_intent::Schedule::AvailableAt(at)));
            whole(a.client().enqueue(req).await)
        }
    );
    case!(
        cases,
        "Enqueue: available_at with nanos of a leap second (1.5e9, which chrono would take)",
        invalid("intents[0].available_at"),
        async move {
            let at = prost_types::Timestamp {
                seconds: chrono::Utc::now().timestamp(),
                nanos: 1_500_000_000,
            };
            let req = one(|i| i.schedule = Some(v1::new_intent::Schedule::AvailableAt(at)));
            whole(a.client().enqueue(req).await)
        }
    );

    // -- Enqueue: bytes a typed client cannot send.
    case!(
        cases,
        "Enqueue: invalid UTF-8 in kind",
        invalid("intents.kind"),
        async move {
            let req = enqueue_of(vec![intent("MARKMARK", "{}")]);
            s.raw
                .unary("Enqueue", patched(&req, "MARKMARK", 0xff))
                .await
        }
    );
    case!(
        cases,
        "Enqueue: invalid UTF-8 in idempotency_key",
        invalid("intents.idempotency_key"),
        async move {
            let req = one(|i| i.idempotency_key = "MARKMARK".into());
            s.raw
                .unary("Enqueue", patched(&req, "MARKMARK", 0xc3))
                .await
        }
    );
    case!(
        cases,
        "Enqueue: invalid UTF-8 in a header name",
        invalid("intents.headers"),
        async move {
            let req = one(|i| {
                i.headers.insert("MARKMARK".into(), "v".into());
            });
            s.raw
                .unary("Enqueue", patched(&req, "MARKMARK", 0xfe))
                .await
        }
    );
    case!(
        cases,
        "Enqueue: intents sent as a varint (wrong wire type)",
        invalid("intents"),
        async move { s.raw.unary("Enqueue", vec![0x08, 0x01]).await }
    );
    case!(
        cases,
        "Enqueue: truncated protobuf (length past the end)",
        invalid("intents"),
        async move { s.raw.unary("Enqueue", vec![0x0a, 0x0a, 0x01, 0x02]).await }
    );
    case!(cases, "Enqueue: field number 0", invalid(""), async move {
        s.raw.unary("Enqueue", vec![0x02, 0x00]).await
    });
    case!(cases, "Enqueue: garbage bytes", invalid(""), async move {
        s.raw.unary("Enqueue", vec![0xff; 16]).await
    });
    case!(
        cases,
        "Enqueue: gRPC frame announcing more bytes than sent",
        invalid(""),
        async move {
            s.raw
                .http("Enqueue", &frame(false, 100, "\n\u{1}"), &[])
                .await
        }
    );
    case!(
        cases,
        "Enqueue: no request message at all",
        invalid(""),
        async move { s.raw.http("Enqueue", "", &[]).await }
    );
    case!(
        cases,
        "Enqueue: compressed flag, no grpc-encoding (INTERNAL: gRPC spec)",
        call(Code::Internal, "", ""),
        async move { s.raw.http("Enqueue", &frame(true, 2, "\n\u{0}"), &[]).await }
    );
    case!(
        cases,
        "Enqueue: unsupported grpc-encoding",
        call(Code::Unimplemented, "", ""),
        async move {
            let body = frame(true, 2, "\n\u{0}");
            s.raw
                .http("Enqueue", &body, &[("grpc-encoding", b"snappy-ish")])
                .await
        }
    );

    // -- Enqueue: two-phase tokens.
    case!(
        cases,
        "Enqueue: garbage txn_token",
        invalid("txn_token"),
        async move { whole(a.client().enqueue(with_token("v2.abc.def.1".into())).await) }
    );
    case!(
        cases,
        "Enqueue: a v1 txn_token (retired: not crash-safe)",
        invalid("txn_token"),
        async move {
            let token = format!("v1.{}.1000", s.cluster_id);
            whole(a.client().enqueue(with_token(token)).await)
        }
    );
    case!(
        cases,
        "Enqueue: txn_token of another cluster",
        invalid("txn_token"),
        async move {
            let other = s.cluster_id.parse::<i64>().unwrap().wrapping_add(1);
            whole(
                a.client()
                    .enqueue(with_token(format!("v2.{other}.{}.1000", s.incarnation)))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Enqueue: txn_token of a future transaction",
        invalid("txn_token"),
        async move {
            let token = format!(
                "v2.{}.{}.{}",
                s.cluster_id,
                s.incarnation,
                (1u64 << 40) + 1000
            );
            whole(a.client().enqueue(with_token(token)).await)
        }
    );
    case!(
        cases,
        "Enqueue: txn_token naming a reserved xid (epoch 256, xid 0)",
        invalid("txn_token"),
        async move {
            let token = format!("v2.{}.{}.{}", s.cluster_id, s.incarnation, 1u64 << 40);
            whole(a.client().enqueue(with_token(token)).await)
        }
    );
    case!(
        cases,
        "Enqueue: txn_token naming the frozen xid 2",
        invalid("txn_token"),
        async move {
            let token = format!("v2.{}.{}.2", s.cluster_id, s.incarnation);
            whole(a.client().enqueue(with_token(token)).await)
        }
    );
    case!(
        cases,
        "Enqueue: txn_token of a rolled-back transaction",
        call(Code::Aborted, "TXN_ABORTED", ""),
        async move {
            whole(
                a.client()
                    .enqueue(with_token(s.aborted_token.clone()))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Enqueue: txn_token of a committed transaction",
        call(Code::FailedPrecondition, "TXN_COMMITTED", ""),
        async move {
            whole(
                a.client()
                    .enqueue(with_token(s.committed_token.clone()))
                    .await,
            )
        }
    );

    // -- Claim.
    case!(
        cases,
        "Claim: empty worker_id",
        invalid("worker_id"),
        async move { whole(a.client().claim(claim_with(|c| c.worker_id.clear())).await) }
    );
    case!(
        cases,
        "Claim: max_intents 0",
        invalid("max_intents"),
        async move { whole(a.client().claim(claim_with(|c| c.max_intents = 0)).await) }
    );
    case!(
        cases,
        "Claim: max_intents -5",
        invalid("max_intents"),
        async move { whole(a.client().claim(claim_with(|c| c.max_intents = -5)).await) }
    );
    case!(
        cases,
        "Claim: max_intents over the batch limit",
        call(Code::ResourceExhausted, "BATCH_TOO_LARGE", "max_intents"),
        async move {
            whole(
                a.client()
                    .claim(claim_with(|c| c.max_intents = i32::MAX))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Claim: zero lease",
        invalid("lease_duration"),
        async move {
            let req = claim_with(|c| c.lease_duration = Some(pd(0, 0)));
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: lease under a millisecond",
        invalid("lease_duration"),
        async move {
            let req = claim_with(|c| c.lease_duration = Some(pd(0, 999_999)));
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: lease over OUTBOX_LEASE__MAX",
        invalid("lease_duration"),
        async move {
            let too_long = duration(lim.max_lease + Duration::from_secs(1));
            whole(
                a.client()
                    .claim(claim_with(|c| c.lease_duration = Some(too_long)))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Claim: negative lease",
        invalid("lease_duration"),
        async move {
            let req = claim_with(|c| c.lease_duration = Some(pd(-1, 0)));
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: lease of i64::MAX seconds",
        invalid("lease_duration"),
        async move {
            let req = claim_with(|c| c.lease_duration = Some(pd(i64::MAX, 0)));
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: wait over OUTBOX_CLAIM__MAX_WAIT",
        invalid("wait"),
        async move {
            let too_long = duration(lim.max_wait + Duration::from_secs(1));
            whole(
                a.client()
                    .claim(claim_with(|c| c.wait = Some(too_long)))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Claim: wait nanos 1e9",
        invalid("wait"),
        async move {
            let req = claim_with(|c| c.wait = Some(pd(0, 1_000_000_000)));
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: max_kinds + 1 kinds",
        invalid("kinds"),
        async move {
            let req =
                claim_with(|c| c.kinds = (0..=lim.max_kinds).map(|n| format!("k{n}")).collect());
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: NUL in a kind",
        invalid("kinds[0]"),
        async move {
            whole(
                a.client()
                    .claim(claim_with(|c| c.kinds = vec!["a\0".into()]))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Claim: control character in request_id",
        invalid("request_id"),
        async move {
            let req = claim_with(|c| c.request_id = "r\u{7}".into());
            whole(a.client().claim(req).await)
        }
    );
    case!(
        cases,
        "Claim: invalid UTF-8 in worker_id",
        invalid("worker_id"),
        async move {
            let req = claim_with(|c| c.worker_id = "MARKMARK".into());
            s.raw.unary("Claim", patched(&req, "MARKMARK", 0x80)).await
        }
    );
    case!(
        cases,
        "Claim: max_intents sent length-delimited (wrong wire type)",
        invalid("max_intents"),
        async move { s.raw.unary("Claim", vec![0x22, 0x01, 0x01]).await }
    );

    // -- ExtendLease.
    case!(
        cases,
        "ExtendLease: no leases",
        invalid("leases"),
        async move {
            let req = v1::ExtendLeaseRequest::default();
            whole(a.client().extend_lease(req).await)
        }
    );
    case!(
        cases,
        "ExtendLease: malformed UUID",
        invalid("leases[0].intent_id"),
        async move {
            let req = v1::ExtendLeaseRequest {
                leases: vec![lease("not-a-uuid", &Uuid::now_v7().to_string())],
                lease_duration: None,
            };
            whole(a.client().extend_lease(req).await)
        }
    );
    case!(
        cases,
        "ExtendLease: nil UUIDs",
        invalid("leases[0].lease_id"),
        async move {
            let nil = Uuid::nil().to_string();
            let req = v1::ExtendLeaseRequest {
                leases: vec![lease(&nil, &nil)],
                lease_duration: None,
            };
            whole(a.client().extend_lease(req).await)
        }
    );
    case!(
        cases,
        "ExtendLease: lease_duration of i64::MAX seconds",
        invalid("lease_duration"),
        async move {
            let req = v1::ExtendLeaseRequest {
                leases: vec![lease_ref(&s.acme_lease)],
                lease_duration: Some(pd(i64::MAX, 999_999_999)),
            };
            whole(a.client().extend_lease(req).await)
        }
    );
    case!(
        cases,
        "ExtendLease: another tenant's lease",
        per_item(Code::NotFound, "NOT_FOUND"),
        async move {
            let req = v1::ExtendLeaseRequest {
                leases: vec![lease_ref(&s.globex_lease)],
                lease_duration: None,
            };
            item(a.client().extend_lease(req).await, |r| {
                first_lease_error(r.results)
            })
        }
    );

    // -- MarkSubmitted.
    case!(
        cases,
        "MarkSubmitted: one intent twice in a batch",
        invalid("leases[1].intent_id"),
        async move {
            let r = lease_ref(&s.acme_lease);
            let req = v1::MarkSubmittedRequest {
                leases: vec![r.clone(), r],
            };
            whole(a.client().mark_submitted(req).await)
        }
    );
    case!(
        cases,
        "MarkSubmitted: batch of max_batch + 1 leases",
        call(Code::ResourceExhausted, "BATCH_TOO_LARGE", "leases"),
        async move {
            let req = v1::MarkSubmittedRequest {
                leases: (0..=lim.max_batch).map(|_| random_ref()).collect(),
            };
            whole(a.client().mark_submitted(req).await)
        }
    );
    case!(
        cases,
        "MarkSubmitted: another tenant's lease",
        per_item(Code::NotFound, "NOT_FOUND"),
        async move {
            let req = v1::MarkSubmittedRequest {
                leases: vec![lease_ref(&s.globex_lease)],
            };
            item(a.client().mark_submitted(req).await, |r| {
                first_lease_error(r.results)
            })
        }
    );

    // -- Ack.
    case!(
        cases,
        "Ack: another tenant's lease",
        per_item(Code::NotFound, "NOT_FOUND"),
        async move {
            let req = v1::AckRequest {
                leases: vec![lease_ref(&s.globex_lease)],
            };
            item(a.client().ack(req).await, |r| first_lease_error(r.results))
        }
    );
    case!(
        cases,
        "Ack: own intent with a made-up lease id",
        per_item(Code::FailedPrecondition, "LEASE_LOST"),
        async move {
            let req = v1::AckRequest {
                leases: vec![lease(id_of(&s.acme_lease), &Uuid::now_v7().to_string())],
            };
            item(a.client().ack(req).await, |r| first_lease_error(r.results))
        }
    );
    case!(
        cases,
        "Ack: lease of an intent that does not exist",
        per_item(Code::NotFound, "NOT_FOUND"),
        async move {
            let req = v1::AckRequest {
                leases: vec![random_ref()],
            };
            item(a.client().ack(req).await, |r| first_lease_error(r.results))
        }
    );

    // -- Fail.
    let failure = |f: &dyn Fn(&mut v1::Failure)| {
        let mut failure = crate::helpers::failure(&seed.acme_lease, FailOutcome::Retry);
        f(&mut failure);
        v1::FailRequest {
            failures: vec![failure],
        }
    };
    let unknown_outcome = failure(&|f| f.outcome = 42);
    case!(
        cases,
        "Fail: outcome 42",
        invalid("failures[0].outcome"),
        async move { whole(a.client().fail(unknown_outcome).await) }
    );
    let unspecified = failure(&|f| f.outcome = 0);
    case!(
        cases,
        "Fail: outcome unspecified",
        invalid("failures[0].outcome"),
        async move { whole(a.client().fail(unspecified).await) }
    );
    let no_lease = failure(&|f| f.lease = None);
    case!(
        cases,
        "Fail: no lease",
        invalid("failures[0].lease"),
        async move { whole(a.client().fail(no_lease).await) }
    );
    let retry_after_permanent = failure(&|f| {
        f.outcome = FailOutcome::Permanent as i32;
        f.retry_after = Some(pd(5, 0));
    });
    case!(
        cases,
        "Fail: retry_after with PERMANENT",
        invalid("failures[0].retry_after"),
        async move { whole(a.client().fail(retry_after_permanent).await) }
    );
    let overflowing = failure(&|f| f.retry_after = Some(pd(i64::MAX, 0)));
    case!(
        cases,
        "Fail: retry_after of i64::MAX seconds",
        invalid("failures[0].retry_after"),
        async move { whole(a.client().fail(overflowing).await) }
    );
    let nul = failure(&|f| f.error = "bad\0error".into());
    case!(
        cases,
        "Fail: NUL in the error text",
        invalid("failures[0].error"),
        async move { whole(a.client().fail(nul).await) }
    );
    let long = lim.max_text_length + 1;
    let long_error = failure(&|f| f.error = "e".repeat(long));
    case!(
        cases,
        "Fail: error text over the length limit",
        invalid("failures[0].error"),
        async move { whole(a.client().fail(long_error).await) }
    );
    case!(
        cases,
        "Fail: another tenant's lease",
        per_item(Code::NotFound, "NOT_FOUND"),
        async move {
            let req = v1::FailRequest {
                failures: vec![crate::helpers::failure(
                    &s.globex_lease,
                    FailOutcome::Permanent,
                )],
            };
            item(a.client().fail(req).await, |r| first_lease_error(r.results))
        }
    );

    // -- Reconcile.
    case!(
        cases,
        "Reconcile: decision 7",
        invalid("decision"),
        async move {
            let mut req = reconcile_ids(vec![s.globex_waiting.clone()]);
            req.decision = 7;
            whole(a.client().reconcile(req).await)
        }
    );
    case!(
        cases,
        "Reconcile: no target",
        invalid("target"),
        async move {
            let req = v1::ReconcileRequest {
                target: None,
                ..reconcile_ids(vec![])
            };
            whole(a.client().reconcile(req).await)
        }
    );
    case!(
        cases,
        "Reconcile: empty actor",
        invalid("actor"),
        async move {
            let mut req = reconcile_ids(vec![s.globex_waiting.clone()]);
            req.actor.clear();
            whole(a.client().reconcile(req).await)
        }
    );
    case!(
        cases,
        "Reconcile: filter on PENDING (no decision awaited)",
        invalid("filter.states[0]"),
        async move {
            let req = reconcile_filter(|f| f.states = vec![IntentState::Pending as i32]);
            whole(a.client().reconcile(req).await)
        }
    );
    case!(
        cases,
        "Reconcile: filter on state 99",
        invalid("filter.states[0]"),
        async move {
            whole(
                a.client()
                    .reconcile(reconcile_filter(|f| f.states = vec![99]))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Reconcile: filter naming a thousand states",
        invalid("filter.states"),
        async move {
            let states = vec![IntentState::DeadLettered as i32; 1_000];
            whole(
                a.client()
                    .reconcile(reconcile_filter(|f| f.states = states))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Reconcile: filter naming a million states (over Reconcile's request limit)",
        call(Code::ResourceExhausted, "PAYLOAD_TOO_LARGE", ""),
        async move {
            let states = vec![IntentState::DeadLettered as i32; 1_000_000];
            whole(
                a.client()
                    .reconcile(reconcile_filter(|f| f.states = states))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Reconcile: created_before in the year -10000",
        invalid("filter.created_before"),
        async move {
            let req = reconcile_filter(|f| f.created_before = Some(ANCIENT));
            whole(a.client().reconcile(req).await)
        }
    );
    case!(cases, "Reconcile: limit -1", invalid("limit"), async move {
        let mut req = reconcile_filter(|_| {});
        req.limit = -1;
        whole(a.client().reconcile(req).await)
    });
    case!(
        cases,
        "Reconcile: malformed id",
        invalid("ids.ids[0]"),
        async move {
            whole(
                a.client()
                    .reconcile(reconcile_ids(vec!["0xdeadbeef".into()]))
                    .await,
            )
        }
    );
    case!(
        cases,
        "Reconcile: another tenant's intent",
        per_item(Code::NotFound, "NOT_FOUND"),
        async move {
            let req = reconcile_ids(vec![s.globex_waiting.clone()]);
            item(a.client().reconcile(req).await, |r| {
                r.results.into_iter().next().and_then(|r| r.error)
            })
        }
    );
    case!(
        cases,
        "Reconcile: with a consume-only key",
        call(Code::PermissionDenied, "MISSING_SCOPE", ""),
        async move {
            let mut c = a.client_with(Some(&s.consume_key), None).await;
            whole(
                c.reconcile(reconcile_ids(vec![s.globex_waiting.clone()]))
                    .await,
            )
        }
    );

    // -- GetIntent.
    case!(
        cases,
        "GetIntent: malformed id",
        invalid("id"),
        async move {
            let req = v1::GetIntentRequest {
                id: "'; DROP TABLE outbox.intent; --".into(),
            };
            whole(a.client().get_intent(req).await)
        }
    );
    case!(cases, "GetIntent: nil id", invalid("id"), async move {
        let req = v1::GetIntentRequest {
            id: Uuid::nil().to_string(),
        };
        whole(a.client().get_intent(req).await)
    });
    case!(
        cases,
        "GetIntent: another tenant's intent",
        call(Code::NotFound, "NOT_FOUND", ""),
        async move {
            let req = v1::GetIntentRequest {
                id: s.globex_pending.clone(),
            };
            whole(a.client().get_intent(req).await)
        }
    );
    case!(
        cases,
        "GetIntent: invalid UTF-8 in id",
        invalid("id"),
        async move { s.raw.unary("GetIntent", vec![0x0a, 0x02, 0xc3, 0x28]).await }
    );

    // -- ListIntents.
    case!(
        cases,
        "ListIntents: garbage page_token",
        invalid("page_token"),
        async move {
            let req = v1::ListIntentsRequest {
                page_token: "garbage".into(),
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: state 99",
        invalid("states[0]"),
        async move {
            let req = v1::ListIntentsRequest {
                states: vec![99],
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: a thousand states",
        invalid("states"),
        async move {
            let req = v1::ListIntentsRequest {
                states: vec![IntentState::Pending as i32; 1_000],
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: a million states (over ListIntents' request limit)",
        call(Code::ResourceExhausted, "PAYLOAD_TOO_LARGE", ""),
        async move {
            let req = v1::ListIntentsRequest {
                states: vec![IntentState::Pending as i32; 1_000_000],
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: page_size -1",
        invalid("page_size"),
        async move {
            let req = v1::ListIntentsRequest {
                page_size: -1,
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: page_size over the batch limit",
        call(Code::ResourceExhausted, "BATCH_TOO_LARGE", "page_size"),
        async move {
            let req = v1::ListIntentsRequest {
                page_size: i32::MAX,
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );
    case!(
        cases,
        "ListIntents: SQL injection attempt in kind",
        invalid("kind"),
        async move {
            let req = v1::ListIntentsRequest {
                kind: "%' OR 1=1 --".into(),
                ..Default::default()
            };
            whole(a.client().list_intents(req).await)
        }
    );

    // -- GetQueueStats and credentials.
    case!(
        cases,
        "GetQueueStats: 1000 nested unknown groups",
        invalid(""),
        async move { s.raw.unary("GetQueueStats", vec![0x7b; 1_000]).await }
    );
    case!(
        cases,
        "GetQueueStats: 100 000 nested unknown groups (over its request limit)",
        call(Code::ResourceExhausted, "PAYLOAD_TOO_LARGE", ""),
        async move { s.raw.unary("GetQueueStats", vec![0x7b; 100_000]).await }
    );
    case!(
        cases,
        "GetQueueStats: no API key",
        call(Code::Unauthenticated, "UNAUTHENTICATED", ""),
        async move {
            let mut c = a.client_with(None, None).await;
            whole(c.get_queue_stats(v1::GetQueueStatsRequest {}).await)
        }
    );
    case!(
        cases,
        "GetQueueStats: unknown API key",
        call(Code::Unauthenticated, "UNAUTHENTICATED", ""),
        async move {
            let mut c = a.client_with(Some("obx_not-a-real-key"), None).await;
            whole(c.get_queue_stats(v1::GetQueueStatsRequest {}).await)
        }
    );
    case!(
        cases,
        "GetQueueStats: 8 KiB garbage API key",
        call(Code::Unauthenticated, "UNAUTHENTICATED", ""),
        async move {
            let key = format!("obx_{}", "x".repeat(8192));
            let mut c = a.client_with(Some(&key), None).await;
            whole(c.get_queue_stats(v1::GetQueueStatsRequest {}).await)
        }
    );
    case!(
        cases,
        "GetQueueStats: revoked API key",
        call(Code::Unauthenticated, "UNAUTHENTICATED", ""),
        async move {
            let mut c = a.client_with(Some(&s.revoked_key), None).await;
            whole(c.get_queue_stats(v1::GetQueueStatsRequest {}).await)
        }
    );
    case!(
        cases,
        "GetQueueStats: Basic instead of Bearer",
        call(Code::Unauthenticated, "UNAUTHENTICATED", ""),
        async move {
            let raw = Raw {
                channel: s.raw.channel.clone(),
                key: String::new(),
            };
            let body = frame(false, 0, "");
            raw.http(
                "GetQueueStats",
                &body,
                &[("authorization", b"Basic YWRtaW46YWRtaW4=")],
            )
            .await
        }
    );
    case!(
        cases,
        "GetQueueStats: x-outbox-tenant naming another tenant",
        call(Code::PermissionDenied, "TENANT_NOT_ALLOWED", ""),
        async move {
            let mut c = a.client_with(Some(&s.raw.key), Some("globex")).await;
            whole(c.get_queue_stats(v1::GetQueueStatsRequest {}).await)
        }
    );
    case!(
        cases,
        "GetQueueStats: x-outbox-tenant that is not UTF-8",
        call(Code::PermissionDenied, "TENANT_NOT_ALLOWED", ""),
        async move {
            let body = frame(false, 0, "");
            s.raw
                .http("GetQueueStats", &body, &[("x-outbox-tenant", b"acme\xff")])
                .await
        }
    );
    case!(
        cases,
        "GetQueueStats: x-outbox-tenant given twice",
        invalid("x-outbox-tenant"),
        async move {
            let body = frame(false, 0, "");
            let twice: [(&str, &[u8]); 2] =
                [("x-outbox-tenant", b"acme"), ("x-outbox-tenant", b"globex")];
            s.raw.http("GetQueueStats", &body, &twice).await
        }
    );
    case!(
        cases,
        "GetQueueStats: authorization given twice",
        call(Code::Unauthenticated, "UNAUTHENTICATED", ""),
        async move {
            let body = frame(false, 0, "");
            let other = format!("Bearer {}", s.produce_key);
            s.raw
                .http(
                    "GetQueueStats",
                    &body,
                    &[("authorization", other.as_bytes())],
                )
                .await
        }
    );
    case!(
        cases,
        "Claim: with a produce-only key",
        call(Code::PermissionDenied, "MISSING_SCOPE", ""),
        async move {
            let mut c = a.client_with(Some(&s.produce_key), None).await;
            whole(c.claim(claim_with(|_| {})).await)
        }
    );
    // A key without the scope, or naming another tenant, is refused before its body is
    // read: not told its body's size, batch or bytes were wrong.
    case!(
        cases,
        "Ack: a produce-only key's oversized body",
        call(Code::PermissionDenied, "MISSING_SCOPE", ""),
        async move {
            let produce = Raw {
                channel: s.raw.channel.clone(),
                key: s.produce_key.clone(),
            };
            produce.unary("Ack", [0x0a, 0x00].repeat(100_000)).await
        }
    );
    case!(
        cases,
        "Ack: a produce-only key's garbage bytes",
        call(Code::PermissionDenied, "MISSING_SCOPE", ""),
        async move {
            let produce = Raw {
                channel: s.raw.channel.clone(),
                key: s.produce_key.clone(),
            };
            produce.unary("Ack", vec![0xff; 16]).await
        }
    );
    case!(
        cases,
        "Enqueue: a consume-only key's batch of 1,001",
        call(Code::PermissionDenied, "MISSING_SCOPE", ""),
        async move {
            let consume = Raw {
                channel: s.raw.channel.clone(),
                key: s.consume_key.clone(),
            };
            consume.unary("Enqueue", [0x0a, 0x00].repeat(1001)).await
        }
    );
    case!(
        cases,
        "Enqueue: another tenant named, a message announced over the limit",
        call(Code::PermissionDenied, "TENANT_NOT_ALLOWED", ""),
        async move {
            let produce = Raw {
                channel: s.raw.channel.clone(),
                key: s.produce_key.clone(),
            };
            let body = frame(false, 0x7f_00_00_00, "");
            produce
                .http("Enqueue", &body, &[("x-outbox-tenant", b"globex")])
                .await
        }
    );
    case!(
        cases,
        "Enqueue: region outside the key's regions",
        call(Code::PermissionDenied, "REGION_NOT_ALLOWED", ""),
        async move {
            let mut c = a.client_with(Some(&s.eu_key), None).await;
            whole(c.enqueue(one(|i| i.region = "us".into())).await)
        }
    );
    case!(
        cases,
        "Enqueue: two-tenant key without x-outbox-tenant",
        invalid("x-outbox-tenant"),
        async move {
            let mut c = a.client_with(Some(&s.two_tenant_key), None).await;
            whole(c.enqueue(one(|_| {})).await)
        }
    );
    case!(
        cases,
        "Unknown method",
        call(Code::Unimplemented, "", ""),
        async move { s.raw.unary("DropEverything", vec![]).await }
    );

    assert!(cases.len() >= 40, "{} cases", cases.len());
    let mut failures = Vec::new();
    eprintln!("\n{:<4} {:<72} {:<20} reason", "#", "case", "code");
    for (n, case) in cases.into_iter().enumerate() {
        let got = tokio::time::timeout(Duration::from_secs(30), case.run)
            .await
            .unwrap_or_else(|_| panic!("{} did not answer", case.name));
        let item = if got.per_item { " (item)" } else { "" };
        let verdict = case.expect.mismatch(&got);
        eprintln!(
            "{:<4} {:<72} {:<20} {}{item}{}",
            n + 1,
            case.name,
            format!("{:?}", got.code),
            got.reason,
            if verdict.is_some() {
                "  <-- MISMATCH"
            } else {
                ""
            },
        );
        if verdict.is_some() {
            eprintln!("     {}", got.message);
        }
        if let Some(why) = verdict {
            failures.push(format!("{}: {why}", case.name));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));

    assert_eq!(app.snapshot().await, intents_before, "an intent changed");
    assert_eq!(every_row(&app).await, before, "a stored row changed");

    let mut health = tonic_health::pb::health_client::HealthClient::new(app.client_channel().await);
    let serving = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: "outbox.v1.OutboxService".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        serving.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let id = app.enqueue_one("after.hostile", "{}").await;
    let mut request = claim_request("after-worker", 1);
    request.kinds = vec!["after.hostile".into()];
    let leases = app.claim(request).await.unwrap();
    assert_eq!(id_of(&leases[0]), id);
    assert!(app.ack(&[&leases[0]]).await[0].error.is_none());
    assert_eq!(app.state(&id).await, IntentState::Delivered);
}

/// Limits configured through `Settings` are the ones the server enforces, each violation
/// naming its field.
#[tokio::test]
async fn configured_limits_are_enforced_with_the_field_named() {
    let app = TestApp::spawn_with(|s| {
        let l = &mut s.limits;
        l.max_message_bytes = 64 * 1024;
        l.max_payload_bytes = 32 * 1024;
        l.max_headers = 1;
        l.max_header_key_length = 4;
        l.max_header_value_length = 4;
        // "application/json", the content type of the helpers' intents, still fits.
        l.max_name_length = 16;
        l.max_region_length = 2;
        l.max_text_length = 5;
        l.max_kinds = 1;
        l.max_delay = Duration::from_secs(60);
    })
    .await;
    let mut c = app.client();
    let mut bad = intent("seventeen-chars-x", "{}");
    bad.region = "eu1".into();
    bad.idempotency_key = "seventeen-chars-x".into();
    bad.headers.insert("a".into(), "1".into());
    bad.headers.insert("bbbbb".into(), "22222".into());
    bad.schedule = Some(v1::new_intent::Schedule::Delay(pd(61, 0)));
    let status = c.enqueue(enqueue_of(vec![bad])).await.unwrap_err();
    crate::helpers::assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &[
            "intents[0].kind",
            "intents[0].region",
            "intents[0].idempotency_key",
            "intents[0].headers",
            "intents[0].headers[\"bbbbb\"]",
            "intents[0].delay",
        ],
    );
    let status = c
        .enqueue(one(|i| i.payload = vec![b'x'; 40 * 1024]))
        .await
        .unwrap_err();
    crate::helpers::assert_status(
        &status,
        Code::ResourceExhausted,
        "PAYLOAD_TOO_LARGE",
        &["intents[0].payload"],
    );
    let status = c
        .enqueue(one(|i| i.payload = vec![b'x'; 80 * 1024]))
        .await
        .unwrap_err();
    crate::helpers::assert_status(&status, Code::ResourceExhausted, "PAYLOAD_TOO_LARGE", &[]);
    let status = c
        .claim(claim_with(|c| {
            c.kinds = vec!["a".into(), "b".into()];
            c.worker_id = "seventeen-chars-x".into();
        }))
        .await
        .unwrap_err();
    crate::helpers::assert_status(
        &status,
        Code::InvalidArgument,
        "INVALID_ARGUMENT",
        &["kinds", "worker_id"],
    );
    assert!(app.snapshot().await.is_empty());
}
