"""Calls to outboxd: channels to every endpoint, credentials, and retries of transient
failures with jittered backoff, moving to the next endpoint each time.

A retry sends the *same* request: the same idempotency keys, Claim `request_id` or lease,
which is what the server's replay rules are for.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, TypeVar, Union

import grpc
import grpc.aio
from google.protobuf.message import Message

from . import _otel
from ._errors import OutboxError, describe
from ._proto.outbox.v1 import outbox_pb2 as pb

log = logging.getLogger("outboxd")

SERVICE = "/outbox.v1.OutboxService/"
Resp = TypeVar("Resp", bound=Message)

RESPONSES: dict[str, type[Message]] = {
    "Enqueue": pb.EnqueueResponse,
    "Claim": pb.ClaimResponse,
    "ExtendLease": pb.ExtendLeaseResponse,
    "MarkSubmitted": pb.MarkSubmittedResponse,
    "Ack": pb.AckResponse,
    "Fail": pb.FailResponse,
    "Reconcile": pb.ReconcileResponse,
    "GetIntent": pb.GetIntentResponse,
    "ListIntents": pb.ListIntentsResponse,
    "GetQueueStats": pb.GetQueueStatsResponse,
}


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def transient(code: grpc.StatusCode, reason: str) -> bool:
    """Failures that a retry of the same request may cure."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    return code == grpc.StatusCode.ABORTED and reason == "CONFLICT"


# What gRPC's own client says when no connection could be made (refused, unresolvable):
# the call failed before its request left the process.
_CONNECT_FAILURES = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed")


def never_sent(code: grpc.StatusCode, reason: str, message: str) -> bool:
    """True when the request never reached a server, so that sending it again cannot act
    twice, whatever it asks (an Enqueue without idempotency keys too)."""
    return code == grpc.StatusCode.UNAVAILABLE and not reason and message.startswith(_CONNECT_FAILURES)


def _try_timeout(timeout: float, deadline: float, whole: bool) -> float:
    """A retry's deadline, ended with the call's budget unless `whole`."""
    if whole:
        return timeout
    return max(0.001, min(timeout, deadline - time.monotonic()))


@dataclass
class Backoff:
    """Jittered exponential backoff: uniform(c / 4, c), c = min(cap, base * 2^n)."""

    base: float = 0.05
    cap: float = 2.0
    tries: int = 0

    def next(self) -> float:
        ceiling = min(self.cap, self.base * (2**self.tries))
        self.tries += 1
        return random.uniform(ceiling / 4, ceiling)


def _target(endpoint: str) -> str:
    for prefix in ("http://", "https://", "grpc://"):
        if endpoint.startswith(prefix):
            return endpoint[len(prefix) :].rstrip("/")
    return endpoint


def _credentials(endpoint: str, given: Optional[grpc.ChannelCredentials]) -> Optional[grpc.ChannelCredentials]:
    """TLS when `given`, or when the endpoint says `https://` (then with the system's roots):
    an API key is never sent in the clear to an endpoint written as TLS."""
    if given is None and endpoint.startswith("https://"):
        return grpc.ssl_channel_credentials()
    return given


@dataclass
class Config:
    """What every client shares: endpoints, credentials and channel options."""

    endpoints: Sequence[str]
    api_key: str
    tenant: Optional[str] = None
    credentials: Optional[grpc.ChannelCredentials] = None
    options: Sequence[tuple[str, Any]] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            self.endpoints = [self.endpoints]
        if not self.endpoints:
            raise ValueError("outboxd: at least one endpoint is needed")
        if not self.api_key:
            raise ValueError("outboxd: an API key is needed (outboxd keys create ...)")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {self.api_key}"),)
        if self.tenant:
            md += (("x-outbox-tenant", self.tenant),)
        return md

    def channel_options(self) -> list[tuple[str, Any]]:
        # Reconnect quickly after a replica comes back; the retry loop rotates meanwhile.
        # Replies of any size: the server bounds them (OUTBOX_LIMITS__MAX_REPLY_BYTES), and
        # grpc's 4 MiB default would refuse a Claim of an intent the server accepted.
        return [
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.max_receive_message_length", -1),
            *self.options,
        ]


Endpoint = Union[str, Sequence[str]]


class AsyncClient:
    """grpc.aio channels to every endpoint; `call` retries transient failures."""

    def __init__(self, config: Config) -> None:
        self.config = config
        opts = config.channel_options()
        self._channels = [
            grpc.aio.secure_channel(_target(e), tls, options=opts)
            if (tls := _credentials(e, config.credentials)) is not None
            else grpc.aio.insecure_channel(_target(e), options=opts)
            for e in config.endpoints
        ]
        self._methods: list[dict[str, Any]] = [{} for _ in self._channels]
        self.index = random.randrange(len(self._channels))

    def _method(self, index: int, name: str) -> Any:
        cached = self._methods[index].get(name)
        if cached is None:
            cached = self._channels[index].unary_unary(
                SERVICE + name,
                request_serializer=_serialize,
                response_deserializer=RESPONSES[name].FromString,
            )
            self._methods[index][name] = cached
        return cached

    async def call(
        self,
        name: str,
        request: Message,
        response: type[Resp],
        *,
        timeout: float,
        budget: float,
        retry: Callable[[grpc.StatusCode, str], bool] = transient,
        on_retry: Optional[Callable[[str], None]] = None,
        bounded: bool = False,
    ) -> Resp:
        """Calls `name`, retrying what `retry` calls transient until `budget` (s) is spent;
        `bounded`: each retry's deadline ends with the budget too (not a long poll's)."""
        deadline = time.monotonic() + budget
        backoff = Backoff()
        first = True
        metadata = self.config.metadata + _otel.metadata()
        while True:
            index = self.index
            try_timeout = _try_timeout(timeout, deadline, first or not bounded)
            try:
                answer = await self._method(index, name)(request, timeout=try_timeout, metadata=metadata)
                assert isinstance(answer, response)
                return answer
            except grpc.RpcError as error:
                first = False
                code, reason, message = describe(error)
                if not (retry(code, reason) or never_sent(code, reason, message)):
                    if transient(code, reason):
                        # Not tried again (it may not be safe), but the next call goes to
                        # the next replica.
                        self.index = (index + 1) % len(self._channels)
                    raise OutboxError(code, reason, message) from None
                # Another replica may answer while this one recovers: the next try, or the
                # caller's next call once the budget is spent (a hung replica times out
                # every try, and must not keep every later call).
                self.index = (index + 1) % len(self._channels)
                pause = backoff.next()
                if time.monotonic() + pause >= deadline:
                    raise OutboxError(code, reason, f"no answer within {budget:.1f}s: {message}") from None
                if on_retry is not None:
                    on_retry(f"{name} via {self.config.endpoints[index]}: {code.name} {message}")
                log.debug("outboxd %s: %s %s, retrying in %.3fs", name, code.name, message, pause)
                await asyncio.sleep(pause)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close(None)


class SyncClient:
    """Blocking grpc channels to every endpoint; `call` retries transient failures."""

    def __init__(self, config: Config) -> None:
        self.config = config
        opts = config.channel_options()
        self._channels = [
            grpc.secure_channel(_target(e), tls, options=opts)
            if (tls := _credentials(e, config.credentials)) is not None
            else grpc.insecure_channel(_target(e), options=opts)
            for e in config.endpoints
        ]
        self._methods: list[dict[str, Any]] = [{} for _ in self._channels]
        self.index = random.randrange(len(self._channels))

    def _method(self, index: int, name: str) -> Any:
        cached = self._methods[index].get(name)
        if cached is None:
            cached = self._channels[index].unary_unary(
                SERVICE + name,
                request_serializer=_serialize,
                response_deserializer=RESPONSES[name].FromString,
            )
            self._methods[index][name] = cached
        return cached

    def call(
        self,
        name: str,
        request: Message,
        response: type[Resp],
        *,
        timeout: float,
        budget: float,
        retry: Callable[[grpc.StatusCode, str], bool] = transient,
        bounded: bool = False,
    ) -> Resp:
        """Calls `name`, retrying what `retry` calls transient until `budget` (s) is spent;
        `bounded`: each retry's deadline ends with the budget too (not a long poll's)."""
        deadline = time.monotonic() + budget
        backoff = Backoff()
        first = True
        metadata = self.config.metadata + _otel.metadata()
        while True:
            index = self.index
            try_timeout = _try_timeout(timeout, deadline, first or not bounded)
            try:
                answer = self._method(index, name)(request, timeout=try_timeout, metadata=metadata)
                assert isinstance(answer, response)
                return answer
            except grpc.RpcError as error:
                first = False
                code, reason, message = describe(error)
                if not (retry(code, reason) or never_sent(code, reason, message)):
                    if transient(code, reason):
                        # Not tried again (it may not be safe), but the next call goes to
                        # the next replica.
                        self.index = (index + 1) % len(self._channels)
                    raise OutboxError(code, reason, message) from None
                # The next try, or the caller's next call, goes to another replica.
                self.index = (index + 1) % len(self._channels)
                pause = backoff.next()
                if time.monotonic() + pause >= deadline:
                    raise OutboxError(code, reason, f"no answer within {budget:.1f}s: {message}") from None
                time.sleep(pause)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
