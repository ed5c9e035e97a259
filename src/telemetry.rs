//! Logs and traces: a `tracing` subscriber writing text or JSON lines to stderr, filtered by
//! `OUTBOX_LOG__FILTER`, plus an OpenTelemetry layer exporting spans over OTLP when
//! `OUTBOX_OTEL__ENDPOINT` is set (nothing otherwise). Also the W3C trace-context helpers
//! that carry a producer's trace through an intent to the worker.

use std::collections::HashMap;
use std::io::IsTerminal;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::config::LogFormat;

/// The W3C header (and intent header) carrying a trace context.
pub const TRACEPARENT: &str = "traceparent";

/// Flushes and shuts down span export when dropped (end of `main`).
#[derive(Debug, Default)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("error: flushing spans failed: {e}");
        }
    }
}

/// Installs the global subscriber: logs, and spans exported to `otlp_endpoint` if given.
///
/// # Errors
/// The OTLP exporter cannot be built (e.g. a malformed endpoint).
pub fn init(
    format: LogFormat,
    filter: &str,
    otlp_endpoint: Option<&str>,
) -> anyhow::Result<TelemetryGuard> {
    let provider = match otlp_endpoint {
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()?;
            Some(tracer_provider(|b| b.with_batch_exporter(exporter)))
        }
        None => None,
    };
    install(format, filter, provider.clone());
    Ok(TelemetryGuard { provider })
}

/// A tracer provider for outboxd's resource; `exporter` adds the export pipeline.
pub fn tracer_provider(
    exporter: impl FnOnce(
        opentelemetry_sdk::trace::TracerProviderBuilder,
    ) -> opentelemetry_sdk::trace::TracerProviderBuilder,
) -> SdkTracerProvider {
    let resource = Resource::builder()
        .with_service_name("outboxd")
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .with_attribute(KeyValue::new(
            "service.instance.id",
            uuid::Uuid::new_v4().to_string(),
        ))
        .build();
    exporter(SdkTracerProvider::builder().with_resource(resource)).build()
}

/// Installs the global subscriber with an optional tracer provider (tests pass one with an
/// in-memory exporter). A second call is a no-op.
pub fn install(format: LogFormat, filter: &str, provider: Option<SdkTracerProvider>) {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().flatten_event(true).boxed(),
    };
    let otel = provider.map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("outboxd"))
            .with_filter(EnvFilter::new("outboxd=info"))
    });
    let _ = Registry::default()
        .with(fmt.with_filter(filter))
        .with(otel)
        .try_init();
}

/// The context a W3C `traceparent` value names (an empty context if it is malformed).
pub fn context_from(traceparent: &str) -> Context {
    let carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    TraceContextPropagator::new().extract(&carrier)
}

/// `traceparent` as this server writes it (version 00, 55 characters), if it names a
/// valid trace context; a later version's extra fields, or anything malformed, are dropped.
pub fn canonical_traceparent(traceparent: &str) -> Option<String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&context_from(traceparent), &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// The `traceparent` of `span`, if it is recorded by OpenTelemetry.
pub fn traceparent_of(span: &Span) -> Option<String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// Makes `span` a child of the remote context in `traceparent` (the producer's call).
pub fn set_remote_parent(span: &Span, traceparent: &str) {
    let cx = context_from(traceparent);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Links `span` to each valid trace context among `traceparents` (the intents' producers).
pub fn link_to<'a>(span: &Span, traceparents: impl Iterator<Item = &'a str>) {
    for tp in traceparents {
        let cx = context_from(tp);
        let span_context = cx.span().span_context().clone();
        if span_context.is_valid() {
            span.add_link(span_context);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_kept_only_when_valid_and_then_in_canonical_form() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(canonical_traceparent(tp).as_deref(), Some(tp));
        let later_version = format!(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-{}",
            "x".repeat(10_000)
        );
        assert_eq!(canonical_traceparent(&later_version).as_deref(), Some(tp));
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(canonical_traceparent(bad), None, "{bad}");
        }
    }
}
