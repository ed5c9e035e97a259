//! Traces: spans follow the messaging conventions (send at Enqueue, receive at Claim,
//! settle at Ack/Fail), and the producer's W3C trace context travels with the intent so
//! the worker's spans link back to it. Spans go to an in-memory exporter.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use opentelemetry::trace::SpanKind;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SpanData};
use outboxd::config::LogFormat;
use outboxd::proto::v1::{self, FailOutcome};

use crate::helpers::{TestApp, intent};

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
    let mut request = tonic::Request::new(v1::EnqueueRequest {
        intents: vec![intent("email.send", "{}"), intent("email.send", "{}")],
        txn_token: String::new(),
    });
    let traceparent = format!("00-{trace_id}-{producer_span}-01");
    request
        .metadata_mut()
        .insert("traceparent", traceparent.parse().unwrap());
    app.client().enqueue(request).await.unwrap();

    let leases = app.claim_n("w", 2).await;
    for lease in &leases {
        let carried = &lease.intent.as_ref().unwrap().headers["traceparent"];
        assert!(carried.contains(&trace_id), "{carried}");
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
