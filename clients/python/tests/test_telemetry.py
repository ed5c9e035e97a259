"""Trace context from the producer's span to the handler's (named and attributed after
OpenTelemetry's messaging conventions), the calls' trace metadata, and the worker's counters."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
import pytest
from conftest import Running
from harness import Stack, wait_for
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState

from outboxd import AsyncOutbox, Intent, NewIntent, Outbox, Worker, pb

# One SDK provider for the process (the global one can be set once), its spans kept here.
_SPANS = InMemorySpanExporter()


@pytest.fixture
def spans() -> InMemorySpanExporter:
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_SPANS))
        trace.set_tracer_provider(provider)
    _SPANS.clear()
    return _SPANS


def handler_span(spans: InMemorySpanExporter) -> ReadableSpan:
    """The one CONSUMER span finished: a handler's."""
    (span,) = [s for s in spans.get_finished_spans() if s.kind == SpanKind.CONSUMER]
    return span


def test_the_handler_span_continues_the_producers_trace_and_counters_reach_the_callback(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], spans: InMemorySpanExporter
) -> None:
    k = kind("traced")
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("place order") as producer_span:
        intent_id = outbox.enqueue_direct(k, b"{}").id
    seen: list[tuple[int, str]] = []
    counts: dict[str, int] = {}
    worker = Worker(
        stack.endpoints,
        stack.api_key,
        concurrency=1,
        worker_id="traced-worker",
        on_count=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n),
    )

    @worker.handler(k)
    def handle(intent: Intent) -> None:
        span = trace.get_current_span()
        seen.append((span.get_span_context().trace_id, intent.headers["traceparent"]))

    with Running(worker):
        wait_for("the ack", lambda: worker.stats.acked == 1, timeout=15)
    trace_id = producer_span.get_span_context().trace_id
    assert seen == [(trace_id, seen[0][1])]
    assert f"{trace_id:032x}" in seen[0][1]
    assert counts == {"claimed": 1, "acked": 1}
    assert outbox.get_intent(intent_id).intent.state == 5  # DELIVERED
    # OpenTelemetry's messaging conventions, as the TypeScript and Rust SDKs' spans.
    span = handler_span(spans)
    assert span.name == f"process {k}"
    assert span.parent is not None and span.parent.span_id == producer_span.get_span_context().span_id
    assert span.context is not None and span.context.trace_id == trace_id
    assert dict(span.attributes or {}) == {
        "messaging.system": "outboxd",
        "messaging.operation.type": "process",
        "messaging.destination.name": k,
        "messaging.message.id": intent_id,
        "messaging.consumer.group.name": "traced-worker",
        "outboxd.attempt": 1,
    }
    assert span.status.status_code == StatusCode.UNSET
    assert not span.events


def test_a_handlers_exception_is_recorded_on_its_span_with_an_error_status(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str], spans: InMemorySpanExporter
) -> None:
    k = kind("failing")
    intent_id = outbox.enqueue_direct(k, b"{}", max_attempts=1).id
    worker = Worker(stack.endpoints, stack.api_key, concurrency=1, worker_id="failing-worker")

    @worker.handler(k)
    async def handle(intent: Intent) -> None:
        raise ValueError("the mail server said no")

    with Running(worker):
        wait_for("the failure", lambda: worker.stats.failed == 1, timeout=15)
    span = handler_span(spans)
    assert span.name == f"process {k}"
    assert span.parent is None  # no producer's span: a root
    assert span.attributes is not None
    assert span.attributes["messaging.message.id"] == intent_id
    assert span.attributes["messaging.consumer.group.name"] == "failing-worker"
    assert span.status.status_code == StatusCode.ERROR
    (event,) = span.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "ValueError"
    assert event.attributes["exception.message"] == "the mail server said no"


TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class FakeOutboxd:
    """A gRPC server that answers Enqueue with an empty response and records its metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, str], pb.EnqueueRequest]] = []

        def enqueue(request: pb.EnqueueRequest, context: grpc.ServicerContext) -> pb.EnqueueResponse:
            metadata = {key: value for key, value in context.invocation_metadata() if isinstance(value, str)}
            self.calls.append((metadata, request))
            return pb.EnqueueResponse()

        handler = grpc.unary_unary_rpc_method_handler(
            enqueue,
            request_deserializer=pb.EnqueueRequest.FromString,
            response_serializer=pb.EnqueueResponse.SerializeToString,
        )
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("outbox.v1.OutboxService", {"Enqueue": handler}),)
        )
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()


@pytest.fixture
def fake() -> Iterator[FakeOutboxd]:
    f = FakeOutboxd()
    yield f
    f.server.stop(None)


def a_span() -> NonRecordingSpan:
    return NonRecordingSpan(
        SpanContext(
            trace_id=TRACE_ID,
            span_id=SPAN_ID,
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=TraceState([("vendor", "opaque")]),
        )
    )


def test_calls_carry_the_active_span_as_trace_metadata_and_none_without_one(fake: FakeOutboxd) -> None:
    with Outbox(fake.endpoint, "obx_test") as outbox:
        with trace.use_span(a_span()):
            assert outbox.enqueue_direct_many([NewIntent("traced")]) == []
        assert outbox.enqueue_direct_many([NewIntent("untraced")]) == []
    (inside, request), (outside, _) = fake.calls
    assert inside["traceparent"] == TRACEPARENT
    assert inside["tracestate"] == "vendor=opaque"
    assert inside["authorization"] == "Bearer obx_test"
    # The intent's header carries the same context, for the worker's handler span.
    assert request.intents[0].headers["traceparent"] == TRACEPARENT
    assert "traceparent" not in outside and "tracestate" not in outside
    assert outside["authorization"] == "Bearer obx_test"


def test_async_calls_carry_the_active_span_as_trace_metadata_and_none_without_one(fake: FakeOutboxd) -> None:
    async def main() -> None:
        outbox = AsyncOutbox(fake.endpoint, "obx_test")
        try:
            with trace.use_span(a_span()):
                assert await outbox.enqueue_direct_many([NewIntent("traced")]) == []
            assert await outbox.enqueue_direct_many([NewIntent("untraced")]) == []
        finally:
            await outbox.close()

    asyncio.run(main())
    (inside, _), (outside, _) = fake.calls
    assert inside["traceparent"] == TRACEPARENT
    assert inside["tracestate"] == "vendor=opaque"
    assert "traceparent" not in outside and "tracestate" not in outside
