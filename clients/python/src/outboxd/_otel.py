"""OpenTelemetry, when `opentelemetry-api` is installed: the intent's `traceparent` becomes
the parent of the handler's span, a producer's current context is carried in the headers,
every call carries the current context as gRPC metadata, and the worker's counters are
OpenTelemetry counters. Without it, all of this is a no-op."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, MutableMapping

try:  # pragma: no cover - exercised only where the extra is installed
    from opentelemetry import metrics as _metrics
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace

    AVAILABLE = True
except ImportError:  # pragma: no cover
    AVAILABLE = False


@contextlib.contextmanager
def handler_span(kind: str, intent_id: str, attempt: int, worker_id: str, headers: Mapping[str, str]) -> Iterator[None]:
    """A `process {kind}` CONSUMER span around one handler call, child of the producer's
    traceparent, named and attributed after OpenTelemetry's messaging conventions (as the
    TypeScript and Rust SDKs' spans). An exception of the handler's is recorded on the span
    and sets its status to ERROR."""
    if not AVAILABLE:
        yield
        return
    parent = _propagate.extract(dict(headers))
    tracer = _trace.get_tracer("outboxd")
    with tracer.start_as_current_span(
        f"process {kind}",
        context=parent,
        kind=_trace.SpanKind.CONSUMER,
        attributes={
            "messaging.system": "outboxd",
            "messaging.operation.type": "process",
            "messaging.destination.name": kind,
            "messaging.message.id": intent_id,
            "messaging.consumer.group.name": worker_id,
            "outboxd.attempt": attempt,
        },
        # Done below for whatever ends the call unfinished (as the worker fails an intent on
        # SystemExit or a cancellation too), where recent APIs record Exception's only.
        record_exception=False,
        set_status_on_exception=False,
    ) as span:
        try:
            yield
        except BaseException as error:
            span.record_exception(error)
            span.set_status(_trace.Status(_trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            raise


def inject(headers: MutableMapping[str, str]) -> None:
    """Adds the current trace context (`traceparent`, …) unless the caller set one."""
    if AVAILABLE and "traceparent" not in headers:
        _propagate.inject(headers)


def metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (`traceparent`, `tracestate`, …, from the
    global propagator), so that the server's span of the call is a child of it; empty
    without the API or an active valid span."""
    if not AVAILABLE:
        return ()
    carrier: dict[str, str] = {}
    _propagate.inject(carrier)
    return tuple((key.lower(), value) for key, value in carrier.items())


class Counters:
    """OpenTelemetry counters for the worker (no-op without an SDK's meter provider)."""

    def __init__(self) -> None:
        self._counters: dict[str, Any] = {}
        if AVAILABLE:
            self._meter: Any = _metrics.get_meter("outboxd")

    def add(self, name: str, n: int, attributes: Mapping[str, str]) -> None:
        if not AVAILABLE:
            return
        counter = self._counters.get(name)
        if counter is None:
            unit = "{pause}" if name == "claims_paused" else "{intent}"
            counter = self._meter.create_counter(f"outboxd.worker.{name}", unit=unit)
            self._counters[name] = counter
        counter.add(n, dict(attributes))
