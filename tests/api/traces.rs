//! Traces: spans follow the messaging conventions (send at Enqueue, receive at Claim,
//! settle at Ack/Fail), and the producer's W3C trace context travels with the intent so
//! the worker's spans link back to it. Spans go to an in-memory exporter here, and over
//! OTLP from a real `outboxd` process to a collector in the test (`otlp`).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry::trace::SpanKind;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::{self as otlp, span::SpanKind as SpanKindProto};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
use outboxd::client::Credentials;
use outboxd::config::LogFormat;
use outboxd::proto::v1::{self, FailOutcome};
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;

use crate::helpers::{
    TENANT, TestApp, create_key, failure, fleet_url, fresh_database, intent, lease_ref, service_url,
};

/// One exporter for the whole test process: the subscriber is global.
fn exported() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider =
            outboxd::telemetry::tracer_provider(|b| b.with_simple_exporter(exporter.clone()));
        outboxd::telemetry::install(LogFormat::Text, "off", Some(provider));
        exporter
    })
}

/// Waits, with a deadline, for a finished span named `name` that `matches`.
async fn span(name: &str, matches: impl Fn(&SpanData) -> bool) -> SpanData {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let spans = exported().get_finished_spans().unwrap();
        if let Some(s) = spans.into_iter().find(|s| s.name == name && matches(s)) {
            return s;
        }
        assert!(Instant::now() < deadline, "no {name} span");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn links_to(span: &SpanData, trace_id: &str) -> bool {
    span.links
        .links
        .iter()
        .any(|l| l.span_context.trace_id().to_string() == trace_id)
}

#[tokio::test]
async fn the_workers_receive_and_settle_spans_link_back_to_the_producers_trace() {
    exported();
    let app = TestApp::spawn().await;
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let producer_span = "00f067aa0ba902b7";
    // A producer's tracestate without its traceparent: not paired with outboxd's.
    let mut lone_state = intent("email.send", "{}");
    lone_state
        .headers
        .insert("tracestate".to_owned(), "vendor=stale".to_owned());
    let mut request = tonic::Request::new(v1::EnqueueRequest {
        intents: vec![intent("email.send", "{}"), lone_state],
        txn_token: String::new(),
    });
    let traceparent = format!("00-{trace_id}-{producer_span}-01");
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    app.client().enqueue(request).await.unwrap();

    let leases = app.claim_n("w", 2).await;
    for lease in &leases {
        let headers = &lease.intent.as_ref().unwrap().headers;
        assert!(headers["traceparent"].contains(&trace_id), "{headers:?}");
        assert!(!headers.contains_key("tracestate"), "{headers:?}");
    }
    app.ack(&[&leases[0]]).await;
    app.fail(&leases[1], FailOutcome::Retry).await;

    let send = span("enqueue email.send", |s| {
        s.span_context.trace_id().to_string() == trace_id
    })
    .await;
    assert_eq!(
        send.parent_span_id.to_string(),
        producer_span,
        "send is a child of the producer's call"
    );
    assert_eq!(send.span_kind, SpanKind::Producer);
    let receive = span("claim", |s| links_to(s, &trace_id)).await;
    assert_eq!(receive.span_kind, SpanKind::Client, "a pull-based receive");
    let ack = span("ack", |s| links_to(s, &trace_id)).await;
    let fail = span("fail", |s| links_to(s, &trace_id)).await;
    for settle in [&ack, &fail] {
        assert_eq!(settle.span_kind, SpanKind::Client);
    }
    for s in [&send, &receive] {
        assert!(
            s.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "messaging.system" && kv.value.as_str() == "outboxd")
        );
    }
}

#[tokio::test]
async fn a_call_that_fails_records_its_status_as_the_error_type_of_its_span() {
    exported();
    let app = TestApp::spawn().await;
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let mut request = tonic::Request::new(v1::AckRequest {
        leases: vec![v1::LeaseRef {
            intent_id: "not an id".to_owned(),
            lease_id: String::new(),
        }],
    });
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{trace_id}-00f067aa0ba902b7-01")
            .parse()
            .unwrap(),
    );
    let refused = app.client().ack(request).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

    let ack = span("ack", |s| s.span_context.trace_id().to_string() == trace_id).await;
    let error_type = ack
        .attributes
        .iter()
        .find(|kv| kv.key.as_str() == "error.type")
        .map(|kv| kv.value.as_str().into_owned());
    assert_eq!(error_type.as_deref(), Some("InvalidArgument"));
    assert!(
        matches!(ack.status, opentelemetry::trace::Status::Error { .. }),
        "a failed call's span is marked failed: {:?}",
        ack.status
    );
}

/// An OTLP/gRPC collector: keeps every span exported to it.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<otlp::Span>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| value(kv.value.as_ref()));
            assert_eq!(service.as_deref(), Some("outboxd"), "the resource");
            spans.extend(resource.scope_spans.into_iter().flat_map(|s| s.spans));
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    /// Serves on 127.0.0.1 until the test ends; its endpoint URL.
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(TcpListenerStream::new(listener)),
        );
        format!("http://{addr}")
    }

    /// Waits, with a deadline, for an exported span named `name` in trace `trace_id`.
    async fn span(&self, name: &str, trace_id: &str) -> otlp::Span {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let found = self
                .0
                .lock()
                .unwrap()
                .iter()
                .find(|s| s.name == name && hex(&s.trace_id) == trace_id)
                .cloned();
            if let Some(span) = found {
                return span;
            }
            assert!(
                Instant::now() < deadline,
                "no {name} span in trace {trace_id}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A string attribute value; an integer one as its digits preceded by `int:`, so that a
/// number exported as text does not pass for an integer.
fn value(v: Option<&AnyValue>) -> Option<String> {
    match v?.value.as_ref()? {
        any_value::Value::StringValue(s) => Some(s.clone()),
        any_value::Value::IntValue(i) => Some(format!("int:{i}")),
        _ => None,
    }
}

fn attribute(span: &otlp::Span, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| value(kv.value.as_ref()))
}

fn assert_attributes(span: &otlp::Span, expected: &[(&str, &str)]) {
    for (key, want) in expected {
        assert_eq!(
            attribute(span, key).as_deref(),
            Some(*want),
            "{key} of {}",
            span.name
        );
    }
}

/// An `outboxd serve` process exporting spans to `otlp_endpoint`; killed when dropped.
struct Process(std::process::Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `outboxd serve` on `url`'s database; a client of it with `key`, once it answers.
async fn serve(url: &str, otlp_endpoint: &str, key: &str) -> (Process, outboxd::client::Client) {
    serve_logging(url, otlp_endpoint, key, "info").await
}

/// [`serve`] with `OUTBOX_LOG__FILTER=log_filter`.
async fn serve_logging(
    url: &str,
    otlp_endpoint: &str,
    key: &str,
    log_filter: &str,
) -> (Process, outboxd::client::Client) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let log = crate::helpers::scratch_dir().join(format!("outboxd-otlp-{port}.log"));
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"));
    // It refuses OUTBOX_* variables it does not know (the tests' own).
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("OUTBOX_") {
            command.env_remove(name);
        }
    }
    let child = command
        .arg("serve")
        .env("OUTBOX_DATABASE__URL", service_url(url))
        .env("OUTBOX_DATABASE__FLEET_URL", fleet_url(url))
        .env("OUTBOX_LISTEN_ADDR", format!("127.0.0.1:{port}"))
        .env("OUTBOX_METRICS__LISTEN_ADDR", "127.0.0.1:0")
        .env("OUTBOX_OTEL__ENDPOINT", otlp_endpoint)
        .env("OUTBOX_LOG__FILTER", log_filter)
        // The SDK's own variable: export batches every 50 ms rather than every 5 s.
        .env("OTEL_BSP_SCHEDULE_DELAY", "50")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let process = Process(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(channel) = Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
        {
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
            if health
                .check(tonic_health::pb::HealthCheckRequest::default())
                .await
                .is_ok()
            {
                let credentials = Credentials::new(Some(key), None).unwrap();
                return (process, outboxd::client::client(channel, credentials));
            }
        }
        assert!(
            Instant::now() < deadline,
            "outboxd did not start: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `message` with W3C trace-context metadata.
fn traced<T>(message: T, traceparent: &str, tracestate: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    let metadata = request.metadata_mut();
    metadata.insert("traceparent", traceparent.parse().unwrap());
    metadata.insert("tracestate", tracestate.parse().unwrap());
    request
}

fn new_trace_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

#[tokio::test]
async fn a_collector_gets_the_workers_calls_in_the_workers_trace_linked_to_the_producers() {
    let collector = Collector::default();
    let endpoint = collector.start().await;
    let url = fresh_database().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let key = create_key(&pool, "both", &[TENANT], &["produce", "consume"], &[]).await;
    let (_process, mut client) = serve(&url, &endpoint, &key).await;

    let producer_trace = new_trace_id();
    let producer_call = "00f067aa0ba902b7";
    client
        .enqueue(traced(
            v1::EnqueueRequest {
                intents: vec![intent("email.send", "{}"), intent("email.send", "{}")],
                txn_token: String::new(),
            },
            &format!("00-{producer_trace}-{producer_call}-01"),
            "vendor=producer",
        ))
        .await
        .unwrap();

    let worker_trace = new_trace_id();
    let [claim_call, ack_call, fail_call] =
        ["1111111111111111", "2222222222222222", "3333333333333333"];
    let worker_call = |span: &str| format!("00-{worker_trace}-{span}-01");
    let leases = client
        .claim(traced(
            v1::ClaimRequest {
                worker_id: "w1".to_owned(),
                max_intents: 2,
                kinds: vec!["email.send".to_owned()],
                ..Default::default()
            },
            &worker_call(claim_call),
            "vendor=worker",
        ))
        .await
        .unwrap()
        .into_inner()
        .leases;
    assert_eq!(leases.len(), 2);
    for lease in &leases {
        let headers = &lease.intent.as_ref().unwrap().headers;
        assert!(
            headers["traceparent"].contains(&producer_trace),
            "{headers:?}"
        );
        assert_eq!(
            headers["tracestate"], "vendor=producer",
            "stored and forwarded"
        );
    }
    let intent_id = |lease: &v1::Lease| lease.intent.as_ref().unwrap().id.clone();
    client
        .ack(traced(
            v1::AckRequest {
                leases: vec![lease_ref(&leases[0])],
            },
            &worker_call(ack_call),
            "vendor=worker",
        ))
        .await
        .unwrap();
    client
        .fail(traced(
            v1::FailRequest {
                failures: vec![failure(&leases[1], FailOutcome::Retry)],
            },
            &worker_call(fail_call),
            "vendor=worker",
        ))
        .await
        .unwrap();

    let enqueue = collector.span("enqueue email.send", &producer_trace).await;
    assert_eq!(hex(&enqueue.parent_span_id), producer_call);
    assert_eq!(enqueue.kind, SpanKindProto::Producer as i32);
    assert_eq!(enqueue.trace_state, "vendor=producer");
    assert_attributes(
        &enqueue,
        &[
            ("messaging.system", "outboxd"),
            ("messaging.operation.name", "enqueue"),
            ("messaging.operation.type", "send"),
            ("messaging.destination.name", "email.send"),
            ("messaging.batch.message_count", "int:2"),
        ],
    );
    // Each intent's creation context is the enqueue span, its tracestate with it.
    let from_the_producer = |span: &otlp::Span, links: usize| {
        assert_eq!(span.links.len(), links, "links of {}", span.name);
        for link in &span.links {
            assert_eq!(hex(&link.trace_id), producer_trace);
            assert_eq!(link.span_id, enqueue.span_id);
        }
    };

    let claim = collector.span("claim email.send", &worker_trace).await;
    assert_eq!(
        hex(&claim.parent_span_id),
        claim_call,
        "the worker's call is the parent"
    );
    assert_eq!(
        claim.kind,
        SpanKindProto::Client as i32,
        "a pull-based receive"
    );
    assert_eq!(claim.trace_state, "vendor=worker");
    from_the_producer(&claim, 2);
    for link in &claim.links {
        assert_eq!(link.trace_state, "vendor=producer");
    }
    assert_attributes(
        &claim,
        &[
            ("messaging.system", "outboxd"),
            ("messaging.operation.name", "claim"),
            ("messaging.operation.type", "receive"),
            ("messaging.destination.name", "email.send"),
            ("messaging.batch.message_count", "int:2"),
            ("messaging.client.id", "w1"),
            ("server.address", "127.0.0.1"),
        ],
    );

    for (name, call, lease) in [
        ("ack", ack_call, &leases[0]),
        ("fail", fail_call, &leases[1]),
    ] {
        let settle = collector.span(name, &worker_trace).await;
        assert_eq!(
            hex(&settle.parent_span_id),
            call,
            "the worker's call is the parent"
        );
        assert_eq!(settle.kind, SpanKindProto::Client as i32);
        from_the_producer(&settle, 1);
        assert_attributes(
            &settle,
            &[
                ("messaging.system", "outboxd"),
                ("messaging.operation.name", name),
                ("messaging.operation.type", "settle"),
                ("messaging.batch.message_count", "int:1"),
                ("messaging.message.id", &intent_id(lease)),
            ],
        );
    }
    pool.close().await;
}

/// With a log filter of its own (`info,outboxd=debug`, as operating.md suggests), every
/// call's span is still exported, and each intent carries its Enqueue span's context.
#[tokio::test]
async fn a_debug_log_filter_drops_no_span() {
    let collector = Collector::default();
    let endpoint = collector.start().await;
    let url = fresh_database().await;
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let key = create_key(&pool, "both", &[TENANT], &["produce", "operate"], &[]).await;
    let (_process, mut client) = serve_logging(&url, &endpoint, &key, "info,outboxd=debug").await;
    let caller_span = "00f067aa0ba902b7";
    for _ in 0..10 {
        let trace = new_trace_id();
        let id = client
            .enqueue(traced(
                v1::EnqueueRequest {
                    intents: vec![intent("email.send", "{}")],
                    txn_token: String::new(),
                },
                &format!("00-{trace}-{caller_span}-01"),
                "vendor=producer",
            ))
            .await
            .unwrap()
            .into_inner()
            .results[0]
            .id
            .clone();
        let enqueue = collector.span("enqueue email.send", &trace).await;
        let stored = client
            .get_intent(v1::GetIntentRequest { id })
            .await
            .unwrap()
            .into_inner()
            .intent
            .unwrap()
            .headers["traceparent"]
            .clone();
        assert_eq!(
            stored,
            format!("00-{trace}-{}-01", hex(&enqueue.span_id)),
            "the intent's context is its Enqueue span's"
        );
    }
}
