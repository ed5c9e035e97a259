// OpenTelemetry, when the application has @opentelemetry/api: each handler runs in a
// consumer span whose parent is the intent's `traceparent`, and every call carries the
// active span as `traceparent` (and `tracestate`) gRPC metadata.
import type * as otel from "@opentelemetry/api";

type Api = typeof otel;
let api: Promise<Api | undefined> | undefined;

/** Loads @opentelemetry/api once; undefined when it is not installed. */
export function loadTracing(): Promise<Api | undefined> {
  api ??= import("@opentelemetry/api").then(
    (module) => module,
    () => undefined,
  );
  return api;
}

/**
 * The active span's W3C `traceparent` and `tracestate` (formatted here, so no propagator
 * needs to be registered); empty without the API or a valid active span.
 */
export function activeTraceContext(tracing: Api | undefined): { traceparent?: string; tracestate?: string } {
  const span = tracing?.trace.getActiveSpan()?.spanContext();
  if (span === undefined || tracing?.isSpanContextValid(span) !== true) return {};
  const traceparent = `00-${span.traceId}-${span.spanId}-0${(span.traceFlags & 1).toString(16)}`;
  const tracestate = span.traceState?.serialize();
  return tracestate ? { traceparent, tracestate } : { traceparent };
}

const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

/**
 * Runs `work` inside a `process <kind>` span, child of the W3C `traceparent` (parsed here,
 * so no propagator needs to be registered); without the API, just runs it.
 */
export function traced<T>(
  tracing: Api | undefined,
  headers: Readonly<Record<string, string>>,
  attributes: { id: string; kind: string; attempt: number; workerId: string },
  work: () => Promise<T>,
): Promise<T> {
  if (tracing === undefined) return work();
  let parent = tracing.ROOT_CONTEXT;
  const match = TRACEPARENT.exec(headers["traceparent"] ?? "");
  if (match && match[1] !== "ff" && !/^0+$/.test(match[2] ?? "") && !/^0+$/.test(match[3] ?? "")) {
    parent = tracing.trace.setSpanContext(parent, {
      traceId: match[2] ?? "",
      spanId: match[3] ?? "",
      traceFlags: Number.parseInt(match[4] ?? "0", 16) & 1,
      isRemote: true,
      ...(headers["tracestate"] ? { traceState: tracing.createTraceState(headers["tracestate"]) } : {}),
    });
  }
  const tracer = tracing.trace.getTracer("@outboxd/client");
  return tracer.startActiveSpan(
    `process ${attributes.kind}`,
    {
      kind: tracing.SpanKind.CONSUMER,
      attributes: {
        "messaging.system": "outboxd",
        "messaging.operation.type": "process",
        "messaging.destination.name": attributes.kind,
        "messaging.message.id": attributes.id,
        "messaging.consumer.group.name": attributes.workerId,
        "outboxd.attempt": attributes.attempt,
      },
    },
    parent,
    async (span) => {
      try {
        return await work();
      } catch (error) {
        span.recordException(error instanceof Error ? error : String(error));
        span.setStatus({ code: tracing.SpanStatusCode.ERROR });
        throw error;
      } finally {
        span.end();
      }
    },
  );
}
