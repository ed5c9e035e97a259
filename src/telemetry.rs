//! Logs and traces: a `tracing` subscriber writing text or JSON lines to stderr, filtered by
//! `OUTBOX_LOG__FILTER`, plus an OpenTelemetry layer exporting spans over OTLP when
//! `OUTBOX_OTEL__ENDPOINT` is set (nothing otherwise). Also the W3C trace-context helpers
//! that carry a producer's trace through an intent to the worker, and the names of the
//! OpenTelemetry messaging conventions the spans follow ([`messaging`]).

use std::collections::HashMap;
use std::io::IsTerminal;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Level;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

use crate::config::LogFormat;

/// The W3C header (and intent header) carrying a trace context.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header (and intent header) carrying vendor state along with [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

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
    let filter: Targets = filter
        .parse()
        .unwrap_or_else(|_| Targets::new().with_default(Level::INFO));
    // `off`: no log layer at all (a test exporting spans only).
    let silent = filter.iter().next().is_none()
        && filter
            .default_level()
            .is_none_or(|level| level == LevelFilter::OFF);
    let fmt = (!silent).then(|| {
        let fmt = tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr);
        match format {
            LogFormat::Text => fmt.boxed(),
            LogFormat::Json => fmt.json().flatten_event(true).boxed(),
        }
    });
    // One filter for both layers: the logs', opened to outboxd's spans at INFO when they
    // are exported. With a filter per layer (EnvFilter and Targets alike) that differed,
    // as with a log filter of `info,outboxd=debug`, the exporter got no span at all and
    // the log lost lines.
    let filter = match &provider {
        Some(_) => {
            let outboxd = filter
                .iter()
                .find(|(target, _)| *target == "outboxd")
                .map(|(_, level)| level)
                .or_else(|| filter.default_level())
                .unwrap_or(LevelFilter::OFF);
            filter.with_target("outboxd", outboxd.max(LevelFilter::INFO))
        }
        None => filter,
    };
    let otel = provider.map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("outboxd")));
    let _ = Registry::default()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init();
}

/// A W3C trace context as this server stores and forwards it: `traceparent` in canonical
/// form (version 00, 55 characters) and `tracestate`, if any, re-serialized and cut to
/// [`MAX_TRACESTATE_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// The `traceparent` value.
    pub traceparent: String,
    /// The `tracestate` value; `None` when empty or malformed.
    pub tracestate: Option<String>,
}

/// Most bytes of `tracestate` kept: the 512 W3C asks every platform to propagate. Whole
/// list-members are dropped from the end beyond it, as W3C allows; it is stored with every
/// intent, outside the limits the intents' own headers are held to.
pub const MAX_TRACESTATE_BYTES: usize = 512;

impl TraceContext {
    /// The context `traceparent` (and `tracestate`) name, if `traceparent` is valid; a
    /// later version's extra fields are dropped, and a malformed `tracestate` too.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        Self::of_context(&context_from(traceparent, tracestate))
    }

    /// The context `span` runs in, if it is recorded by OpenTelemetry.
    pub fn of(span: &Span) -> Option<Self> {
        Self::of_context(&span.context())
    }

    fn of_context(cx: &Context) -> Option<Self> {
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(cx, &mut carrier);
        let traceparent = carrier.remove(TRACEPARENT)?;
        let tracestate = carrier
            .remove(TRACESTATE)
            .map(|ts| cut_tracestate(&ts))
            .filter(|ts| !ts.is_empty());
        Some(Self {
            traceparent,
            tracestate,
        })
    }
}

/// `tracestate` without the list-members that would take it past [`MAX_TRACESTATE_BYTES`].
fn cut_tracestate(tracestate: &str) -> String {
    let mut out = String::new();
    for member in tracestate.split(',') {
        let extra = member.len() + usize::from(!out.is_empty());
        if out.len() + extra > MAX_TRACESTATE_BYTES {
            break;
        }
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(member);
    }
    out
}

/// The context `traceparent` and `tracestate` name (an empty context if malformed).
fn context_from(traceparent: &str, tracestate: Option<&str>) -> Context {
    let mut carrier = HashMap::from([(TRACEPARENT.to_owned(), traceparent.to_owned())]);
    if let Some(ts) = tracestate {
        carrier.insert(TRACESTATE.to_owned(), ts.to_owned());
    }
    TraceContextPropagator::new().extract(&carrier)
}

/// `traceparent` as this server writes it (version 00, 55 characters), if it names a
/// valid trace context; a later version's extra fields, or anything malformed, are dropped.
pub fn canonical_traceparent(traceparent: &str) -> Option<String> {
    TraceContext::parse(traceparent, None).map(|tc| tc.traceparent)
}

/// Makes `span` a child of `remote` (the caller's trace context). Before `span` is first
/// entered: OpenTelemetry fixes a span's parent when it starts.
pub fn set_remote_parent(span: &Span, remote: &TraceContext) {
    let cx = context_from(&remote.traceparent, remote.tracestate.as_deref());
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Links `span` to each valid (`traceparent`, `tracestate`) among `contexts` (the creation
/// contexts of the messages it handles: the intents' producers).
pub fn link_to<'a>(span: &Span, contexts: impl Iterator<Item = (&'a str, Option<&'a str>)>) {
    for (traceparent, tracestate) in contexts {
        let cx = context_from(traceparent, tracestate);
        let span_context = cx.span().span_context().clone();
        if span_context.is_valid() {
            span.add_link(span_context);
        }
    }
}

/// The OpenTelemetry messaging semantic conventions (semconv 1.3x, messaging spans) as
/// outboxd applies them: one span per messaging RPC, named `{operation} {destination}`.
/// String constants rather than the `opentelemetry-semantic-conventions` crate: tracing's
/// macros need the attribute names as literal field names, and the crate has the messaging
/// names only behind its experimental feature.
pub mod messaging {
    use std::net::SocketAddr;

    use opentelemetry::trace::TraceContextExt;
    use tracing::Span;
    use tracing::field::Empty;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::{TraceContext, set_remote_parent};

    /// `messaging.system`: outboxd is the intermediary the messages go through.
    pub const SYSTEM: &str = "outboxd";

    /// A messaging operation: its `messaging.operation.name` (the system's own name, the
    /// RPC's), `messaging.operation.type` and span kind.
    #[derive(Debug, Clone, Copy)]
    pub struct Operation {
        /// `messaging.operation.name`, and the span name's first word.
        pub name: &'static str,
        /// `messaging.operation.type`.
        pub operation_type: &'static str,
        /// The span kind (`otel.kind`).
        pub span_kind: &'static str,
        /// `rpc.method`.
        pub rpc: &'static str,
    }

    /// Enqueue sends intents; its span is their creation context (unless an intent carries
    /// its own), hence PRODUCER.
    pub const ENQUEUE: Operation = Operation {
        name: "enqueue",
        operation_type: "send",
        span_kind: "producer",
        rpc: "Enqueue",
    };
    /// Claim is a pull-based receive: CLIENT.
    pub const CLAIM: Operation = Operation {
        name: "claim",
        operation_type: "receive",
        span_kind: "client",
        rpc: "Claim",
    };
    /// Ack settles: CLIENT.
    pub const ACK: Operation = Operation {
        name: "ack",
        operation_type: "settle",
        span_kind: "client",
        rpc: "Ack",
    };
    /// Fail settles: CLIENT.
    pub const FAIL: Operation = Operation {
        name: "fail",
        operation_type: "settle",
        span_kind: "client",
        rpc: "Fail",
    };

    impl Operation {
        /// The operation's span, a child of `caller` (the trace context of the call) if
        /// given, on the connection's local address `server` (the conventions'
        /// `server.address` and `server.port`). The fields left empty are recorded once known.
        pub fn span(self, caller: Option<&TraceContext>, server: Option<SocketAddr>) -> Span {
            let span = tracing::info_span!(
                "messaging",
                otel.name = self.name,
                otel.kind = self.span_kind,
                messaging.system = SYSTEM,
                messaging.operation.name = self.name,
                messaging.operation.type = self.operation_type,
                messaging.destination.name = Empty,
                messaging.batch.message_count = Empty,
                messaging.message.id = Empty,
                messaging.client.id = Empty,
                error.type = Empty,
                rpc.system = "grpc",
                rpc.service = "outbox.v1.OutboxService",
                rpc.method = self.rpc,
                auth.key = Empty,
                claim.worker = Empty,
                server.address = Empty,
                server.port = Empty,
            );
            if let Some(server) = server {
                span.record("server.address", server.ip().to_string());
                span.record("server.port", i64::from(server.port()));
            }
            if let Some(caller) = caller {
                set_remote_parent(&span, caller);
            }
            span
        }

        /// Records the destination (the one intent kind the call concerns) and names the
        /// span after it, as the conventions' `{operation} {destination}`.
        pub fn record_destination(self, span: &Span, kind: &str) {
            span.record("messaging.destination.name", kind);
            // Not by recording `otel.name`: tracing-opentelemetry ignores a new name once
            // the span has started, and the kind is known only after validation.
            span.context()
                .span()
                .update_name(format!("{} {kind}", self.name));
        }
    }

    /// The one value `kinds` all have, if they have one (the call's destination).
    pub fn single<'a>(mut kinds: impl Iterator<Item = &'a str>) -> Option<&'a str> {
        let first = kinds.next()?;
        kinds.all(|k| k == first).then_some(first)
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

    #[test]
    fn a_tracestate_travels_with_its_traceparent_cut_to_whole_members_within_512_bytes() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let kept = TraceContext::parse(tp, Some("vendor=abc,other=x")).unwrap();
        assert_eq!(kept.tracestate.as_deref(), Some("vendor=abc,other=x"));
        assert_eq!(
            TraceContext::parse(tp, Some("not a tracestate"))
                .unwrap()
                .tracestate,
            None
        );
        assert_eq!(TraceContext::parse(tp, None).unwrap().tracestate, None);
        let long: Vec<String> = (0..32)
            .map(|i| format!("k{i:02}={}", "v".repeat(60)))
            .collect();
        let cut = TraceContext::parse(tp, Some(&long.join(",")))
            .unwrap()
            .tracestate
            .unwrap();
        assert!(cut.len() <= MAX_TRACESTATE_BYTES, "{}", cut.len());
        assert_eq!(cut, long[..cut.split(',').count()].join(","));
        assert!(cut.split(',').count() >= 7);
    }
}
