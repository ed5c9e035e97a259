//! Trace context across the wire. Each handler runs in a `process {kind}` consumer span;
//! with the `otel` feature (and a `tracing-opentelemetry` layer in the application) that
//! span's parent is the intent's W3C `traceparent`, a producer's intents carry the
//! current span's context as headers, and every call carries it as gRPC metadata, so that
//! outboxd's span of the call is its child.

use std::collections::HashMap;

use tracing::Span;

/// The span a handler of `kind` runs in for `intent_id`, child of the producer's context
/// in `headers` (with the `otel` feature).
pub(crate) fn handler_span(
    kind: &str,
    intent_id: &str,
    attempt: u32,
    worker_id: &str,
    headers: &HashMap<String, String>,
) -> Span {
    let span = tracing::info_span!(
        "process",
        otel.name = %format!("process {kind}"),
        otel.kind = "consumer",
        messaging.system = "outboxd",
        messaging.operation.type = "process",
        messaging.destination.name = %kind,
        messaging.message.id = %intent_id,
        messaging.consumer.group.name = %worker_id,
        outboxd.attempt = attempt,
    );
    #[cfg(feature = "otel")]
    otel::set_parent(&span, headers);
    #[cfg(not(feature = "otel"))]
    let _ = headers;
    span
}

/// The current span's W3C context (`traceparent`, and `tracestate` when it has one); empty
/// without the `otel` feature or outside a span OpenTelemetry records.
pub(crate) fn current_context() -> HashMap<String, String> {
    #[cfg(feature = "otel")]
    return otel::current_context();
    #[cfg(not(feature = "otel"))]
    HashMap::new()
}

#[cfg(feature = "otel")]
mod otel {
    use std::collections::HashMap;

    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry::trace::TraceContextExt;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing::Span;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    // W3C's format, not the global propagator: an application that registered none (the
    // default is a no-op) still gets its traces joined.
    pub(super) fn set_parent(span: &Span, headers: &HashMap<String, String>) {
        let cx = TraceContextPropagator::new().extract(headers);
        if cx.span().span_context().is_valid() {
            // Fails only without an OpenTelemetry layer: nothing to join then.
            let _ = span.set_parent(cx);
        }
    }

    pub(super) fn current_context() -> HashMap<String, String> {
        let cx = Span::current().context();
        let mut carrier = HashMap::new();
        if cx.span().span_context().is_valid() {
            TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        }
        carrier
    }
}
