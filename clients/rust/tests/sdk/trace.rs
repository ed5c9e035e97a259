//! With the `otel` feature: a handler's span joins its producer's trace, and calls carry
//! the caller's trace context to outboxd.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{SpanContext, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use outboxd_client::{CallOptions, Failure, IntentState, Job, NewIntent, Outbox, Worker, proto};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

use crate::Running;
use crate::harness::{connection, intent, kind, wait_state};

fn traceparent(cx: &SpanContext) -> String {
    format!("00-{}-{}-01", cx.trace_id(), cx.span_id())
}

// One thread: the subscriber set here is that thread's, and the worker's tasks run on it.
#[tokio::test(flavor = "current_thread")]
async fn a_handlers_span_is_a_child_of_its_producers_and_calls_carry_the_callers_context() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
    let _default = tracing::subscriber::set_default(subscriber);

    let connection = connection();
    let k = kind("traced");
    let outbox = Outbox::new(connection.clone());
    let produce = tracing::info_span!("produce");
    let producer = produce.context().span().span_context().clone();
    assert!(producer.is_valid());
    let enqueued = outbox
        .enqueue_direct(NewIntent::new(&k, b"x".to_vec()))
        .instrument(produce.clone())
        .await
        .unwrap();
    // The producer's span is the intent's creation context.
    let stored = intent(&connection, &enqueued.id).await;
    assert_eq!(
        stored.headers.get("traceparent"),
        Some(&traceparent(&producer))
    );

    // Without headers of its own, an intent keeps the context of the call's metadata (the
    // test servers export no spans: they store the caller's context).
    let call = tracing::info_span!("raw call");
    let caller = call.context().span().span_context().clone();
    let request = proto::EnqueueRequest {
        intents: vec![proto::NewIntent {
            kind: k.clone(),
            payload: b"y".to_vec(),
            ..Default::default()
        }],
        txn_token: String::new(),
    };
    let answer = connection
        .call(CallOptions::new(Duration::from_secs(10)), |mut client| {
            let request = request.clone();
            async move { client.enqueue(request).await }
        })
        .instrument(call)
        .await
        .unwrap();
    let raw = intent(&connection, &answer.results[0].id).await;
    assert_eq!(raw.headers.get("traceparent"), Some(&traceparent(&caller)));

    let seen = Arc::new(Mutex::new(Vec::new()));
    let worker = Worker::builder(connection.clone())
        .handler(&k, {
            let seen = seen.clone();
            move |job: Job| {
                let cx = tracing::Span::current().context();
                let current = cx.span().span_context().trace_id();
                seen.lock().unwrap().push((job.id().to_owned(), current));
                async { Ok::<_, Failure>(()) }
            }
        })
        .build()
        .unwrap();
    let running = Running::start(worker);
    wait_state(&connection, &enqueued.id, IntentState::Delivered).await;
    wait_state(&connection, &raw.id, IntentState::Delivered).await;
    running.stop().await.unwrap();

    let seen = seen.lock().unwrap().clone();
    let trace_of = |id: &str| seen.iter().find(|(i, _)| i == id).map(|(_, t)| *t);
    assert_eq!(trace_of(&enqueued.id), Some(producer.trace_id()));
    assert_eq!(trace_of(&raw.id), Some(caller.trace_id()));
    let spans = exporter.get_finished_spans().unwrap();
    let process = spans
        .iter()
        .find(|s| {
            s.name == format!("process {k}") && s.span_context.trace_id() == producer.trace_id()
        })
        .expect("the handler's span, in the producer's trace");
    assert_eq!(process.parent_span_id, producer.span_id());
    assert_eq!(process.span_kind, opentelemetry::trace::SpanKind::Consumer);
}
