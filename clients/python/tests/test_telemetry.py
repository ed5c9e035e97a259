"""Trace context from the producer's span to the handler's, and the worker's counters."""

from __future__ import annotations

from typing import Callable

from conftest import Running
from harness import Stack, wait_for
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from outboxd import Intent, Outbox, Worker


def test_the_handler_span_continues_the_producers_trace_and_counters_reach_the_callback(
    stack: Stack, outbox: Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("traced")
    provider = TracerProvider()
    trace.set_tracer_provider(provider)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("place order") as producer_span:
        intent_id = outbox.enqueue_direct(k, b"{}").id
    seen: list[tuple[int, str]] = []
    counts: dict[str, int] = {}
    worker = Worker(
        stack.endpoints,
        stack.api_key,
        concurrency=1,
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
