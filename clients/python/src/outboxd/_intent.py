"""The values that cross the SDK's edge: intents as handlers see them, intents as producers
submit them, and what an enqueue answers. Wire types stay inside."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from ._proto.outbox.v1 import outbox_pb2 as pb

Payload = Union[bytes, str, Any]


def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def timestamp(at: dt.datetime) -> Timestamp:
    t = Timestamp()
    t.FromDatetime(at.astimezone(dt.timezone.utc) if at.tzinfo else at)
    return t


def state_name(state: int) -> str:
    """`INTENT_STATE_PENDING` → `PENDING`."""
    return pb.IntentState.Name(state).removeprefix("INTENT_STATE_")


@dataclass(frozen=True)
class NewIntent:
    """One intent to enqueue (the batch form of `Outbox.enqueue`).

    `payload`: bytes are sent as they are; a str is UTF-8 encoded; anything else is JSON
    encoded and `content_type` defaults to `application/json`. `ordering_key`: intents of
    one key are delivered one at a time, in commit order (within one call, list order);
    None or empty: unordered. `priority`: from -10 to 10 (default 0); among the claimable
    intents of its tenant and kind, higher priorities are claimed first.
    """

    kind: str
    payload: Payload = b""
    idempotency_key: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = ""
    region: str = ""
    max_attempts: int = 0
    delay: Optional[float] = None
    available_at: Optional[dt.datetime] = None
    ordering_key: Optional[str] = None
    priority: int = 0

    def to_pb(self) -> pb.NewIntent:
        from . import _otel

        content_type = self.content_type
        if isinstance(self.payload, bytes):
            body = self.payload
        elif isinstance(self.payload, str):
            body = self.payload.encode()
        else:
            body = json.dumps(self.payload, separators=(",", ":")).encode()
            content_type = content_type or "application/json"
        headers = dict(self.headers)
        _otel.inject(headers)
        message = pb.NewIntent(
            kind=self.kind,
            payload=body,
            content_type=content_type,
            region=self.region,
            idempotency_key=self.idempotency_key,
            headers=headers,
            max_attempts=self.max_attempts,
            ordering_key=self.ordering_key or "",
            priority=self.priority,
        )
        if self.delay is not None and self.available_at is not None:
            raise ValueError("give delay or available_at, not both")
        if self.delay is not None:
            message.delay.CopyFrom(duration(self.delay))
        if self.available_at is not None:
            message.available_at.CopyFrom(timestamp(self.available_at))
        return message


@dataclass(frozen=True)
class EnqueueResult:
    """One enqueued intent: its id, its state (`STAGED`, `PENDING`, `WAITING` behind an
    earlier intent of its ordering key, … without the `INTENT_STATE_` prefix) and whether
    its idempotency key matched an existing one."""

    id: str
    state: str
    deduplicated: bool

    @classmethod
    def from_pb(cls, r: pb.EnqueueResult) -> EnqueueResult:
        return cls(id=r.id, state=state_name(r.state), deduplicated=r.deduplicated)
