"""The worker: claims intents only for free handler slots, runs handlers (threads for plain
functions, tasks for `async def`), keeps every live lease extended, settles in batches and
drains on shutdown. One asyncio loop drives it; `Worker.run()` owns that loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime as dt
import inspect
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import unicodedata
import uuid
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence, TypeVar, Union

import grpc

from . import _otel
from ._errors import LeaseLost, OutboxError, Permanent, Retry, Unknown, retry_seconds
from ._intent import duration
from ._proto.outbox.v1 import outbox_pb2 as pb
from ._rpc import AsyncClient, Backoff, Config, transient

log = logging.getLogger("outboxd")

Handler = Callable[["Intent"], Union[Awaitable[None], None]]
H = TypeVar("H", bound=Handler)

# Most leases per Claim and items per settle or heartbeat call (the server's default limit).
_MAX_BATCH = 1000
# Results awaiting their Ack or Fail at which the worker stops claiming: against Acks slower
# than its handlers it would otherwise pile up leases (each heartbeated) without bound.
_UNSETTLED_MAX = 4 * _MAX_BATCH
# Most bytes of one Fail call: half the server's default request limit
# (OUTBOX_LIMITS__MAX_MESSAGE_BYTES, 8 MiB); a thousand long non-ASCII error texts pass it.
_MAX_CALL_BYTES = 4 * 1024 * 1024

# Longest `error` sent with a Fail, in characters: the server's default
# OUTBOX_LIMITS__MAX_TEXT_LENGTH (the Rust and TypeScript SDKs cut at the same).
_MAX_ERROR_CHARS = 4096

# Per-item reasons meaning "this lease is not ours any more".
_LOST_REASONS = frozenset({"LEASE_LOST", "NOT_FOUND", "INVALID_STATE"})


@dataclass
class WorkerStats:
    """Counters since the worker started (a snapshot: `worker.stats`)."""

    claimed: int = 0
    acked: int = 0
    failed: int = 0
    lease_lost: int = 0
    heartbeat_failures: int = 0
    claim_retries: int = 0
    settle_errors: int = 0
    # Times claiming paused because 4,000 results awaited their settle (slow Acks).
    claims_paused: int = 0


class _Lease:
    """What the worker knows about one lease it holds."""

    __slots__ = (
        "abandoned",
        "expires",
        "intent",
        "lease_id",
        "loop_future",
        "lost",
        "lost_event",
        "settling",
        "submitted",
        "task",
    )

    def __init__(self, intent: Intent, lease_id: str, expires: float) -> None:
        self.intent = intent
        self.lease_id = lease_id
        # Local monotonic expiry, counted from when the Claim/ExtendLease was sent: no clock skew.
        self.expires = expires
        self.submitted = False
        self.lost = False
        self.abandoned = False
        self.settling = False
        self.task: Optional[asyncio.Task[None]] = None
        # A coroutine a sync-looking handler returned, run on the loop for its thread:
        # cancelled with the lease like an async handler.
        self.loop_future: Optional[concurrent.futures.Future[Any]] = None
        self.lost_event = threading.Event()

    def ref(self) -> pb.LeaseRef:
        return pb.LeaseRef(intent_id=self.intent.id, lease_id=self.lease_id)


class Intent:
    """One leased intent, as a handler sees it.

    `payload` is the bytes the producer sent (`json()` decodes them), `attempt` counts from 1,
    `headers` carry the producer's metadata (and its W3C `traceparent`).
    """

    def __init__(self, worker: Worker, lease: pb.Lease) -> None:
        i = lease.intent
        self._worker = worker
        self.id: str = i.id
        self.kind: str = i.kind
        self.payload: bytes = i.payload
        self.content_type: str = i.content_type
        self.headers: Mapping[str, str] = dict(i.headers)
        self.tenant: str = i.tenant
        self.region: str = i.region
        self.idempotency_key: str = i.idempotency_key
        self.ordering_key: str = i.ordering_key
        self.priority: int = i.priority
        self.attempt: int = lease.attempt
        self.max_attempts: int = i.max_attempts
        self.created_at: dt.datetime = i.created_at.ToDatetime(dt.timezone.utc)
        self.lease_id: str = lease.lease_id
        self._state: Optional[_Lease] = None

    def __repr__(self) -> str:
        return f"Intent(id={self.id!r}, kind={self.kind!r}, attempt={self.attempt})"

    def json(self) -> Any:
        """The payload decoded as JSON."""
        return json.loads(self.payload)

    @property
    def lease_lost(self) -> bool:
        """True once the lease is gone: whatever the handler does now is not reported."""
        return self._st.lost or self._st.abandoned

    def wait_lease_lost(self, timeout: Optional[float] = None) -> bool:
        """Blocks (sync handlers) until the lease is lost or `timeout`; returns lease_lost."""
        return self._st.lost_event.wait(timeout)

    @property
    def submitted(self) -> bool:
        """True once MarkSubmitted succeeded for this lease."""
        return self._st.submitted

    def submitting(self) -> Submitting:
        """Marks the intent SUBMITTED before a non-idempotent external call.

        `with intent.submitting(): psp.charge(...)` (or `async with` in an async handler).
        On entry MarkSubmitted is called (raises `LeaseLost` if the lease is gone, or was
        lost or given back by the shutdown before the answer came, so the call is never
        started). Once it succeeded an exception, inside the block or after it, fails the
        intent UNKNOWN (NEEDS_RECONCILE, never re-delivered) unless the handler raises
        `Retry` or `Permanent` itself: it knows the call did not happen.
        """
        return Submitting(self)

    @property
    def _st(self) -> _Lease:
        assert self._state is not None
        return self._state


class Submitting:
    """The context manager `intent.submitting()` returns (sync and async)."""

    def __init__(self, intent: Intent) -> None:
        self._intent = intent

    def __enter__(self) -> Intent:
        worker = self._intent._worker
        loop = worker._loop
        if loop is None:
            raise RuntimeError("the worker is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("in an async handler use `async with intent.submitting()`")
        future = asyncio.run_coroutine_threadsafe(worker._mark_submitted(self._intent._st), loop)
        future.result()
        return self._intent

    def __exit__(
        self,
        et: Optional[type[BaseException]],
        ev: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        return None

    async def __aenter__(self) -> Intent:
        await self._intent._worker._mark_submitted(self._intent._st)
        return self._intent

    async def __aexit__(
        self,
        et: Optional[type[BaseException]],
        ev: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        return None


class _ThreadPool:
    """Daemon threads for sync handlers: a handler still running when the process exits
    after the shutdown grace must not hold the exit (ThreadPoolExecutor joins at exit)."""

    def __init__(self, size: int, name: str) -> None:
        self._queue: queue.SimpleQueue[Optional[tuple[Callable[[], None]]]] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            item[0]()

    def submit(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> asyncio.Future[None]:
        future: asyncio.Future[None] = loop.create_future()

        def settle_ok() -> None:
            if not future.done():
                future.set_result(None)

        def settle_error(error: BaseException) -> None:
            if not future.done():
                future.set_exception(error)

        def job() -> None:
            try:
                fn()
            except BaseException as error:  # noqa: BLE001 - handed to the loop as is
                loop.call_soon_threadsafe(settle_error, error)
            else:
                loop.call_soon_threadsafe(settle_ok)

        self._queue.put((job,))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


@dataclass
class _Settle:
    lease: _Lease
    outcome: int  # 0: Ack, else a pb.FailOutcome
    error: str = ""
    retry_after: Optional[float] = None
    answered: bool = False  # its call's answer (or failure) was applied


class Worker:
    """Leases intents from outboxd and runs the handler registered for their kind.

    ```python
    worker = Worker(endpoints=["outboxd-0:50051"], api_key=key, concurrency=16)

    @worker.handler("email.send")
    def send(intent): mailer.send(intent.json())

    worker.run()   # until SIGTERM/SIGINT, then drains
    ```

    A handler that returns normally is acked; `raise Retry(after=10)` retries, `raise
    Permanent(...)` dead-letters, any other exception retries with the server's backoff
    (UNKNOWN once MarkSubmitted succeeded: `intent.submitting()` was entered). Handlers may
    be `async def` (or any callable returning an awaitable: it is awaited before the Ack).

    Options: `region` (claim that region's intents and region-less ones), `concurrency`
    (handler slots: never more leases than free slots), `claim_batch` (free slots a Claim
    waits for after a full one, while there is a backlog; default all of `concurrency`),
    `claim_linger` (the longest, in seconds, a free slot waits for that company: 0.005),
    `lease` (seconds asked per lease;
    heartbeats extend it every `lease / 3`), `claim_wait` (long-poll), `grace` (seconds
    running handlers get after a stop), `kinds` (the claim filter, a list: replaces the
    handlers' kinds), `worker_id`, `tenant`, `credentials` (grpc.ChannelCredentials for TLS),
    `settle_delay` (how long an Ack/Fail waits to share a call), `on_count` (a callback
    `(counter, n)` for the counters in `WorkerStats`).
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        api_key: str,
        *,
        region: str = "",
        concurrency: int = 16,
        claim_batch: Optional[int] = None,
        claim_linger: float = 0.005,
        lease: float = 30.0,
        claim_wait: float = 5.0,
        grace: float = 30.0,
        kinds: Optional[Sequence[str]] = None,
        worker_id: Optional[str] = None,
        tenant: Optional[str] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        settle_delay: float = 0.002,
        call_timeout: float = 10.0,
        on_count: Optional[Callable[[str, int], None]] = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if claim_batch is not None and claim_batch < 1:
            raise ValueError("claim_batch must be at least 1")
        if claim_linger < 0:
            raise ValueError("claim_linger must not be negative")
        if lease < 1.0:
            raise ValueError("lease must be at least 1 second")
        if isinstance(kinds, str):
            # A str is a Sequence[str] too: it would claim one-letter kinds.
            raise TypeError(f"kinds takes a list of kinds, not a str: kinds=[{kinds!r}]")
        if not claim_wait >= 0.1:
            # Shorter, an idle worker would claim in a loop, a transaction each time.
            raise ValueError(f"claim_wait must be at least 0.1 s, not {claim_wait!r}")
        if kinds is not None and not kinds:
            # The server reads an empty filter as every kind: intents of kinds without a
            # handler would be dead-lettered.
            raise ValueError("kinds must not be an empty list (None claims the handlers' kinds)")
        self._config = Config(
            endpoints=[endpoints] if isinstance(endpoints, str) else list(endpoints),
            api_key=api_key,
            tenant=tenant,
            credentials=credentials,
        )
        self.region = region
        self.concurrency = concurrency
        # More could never be free at once (nor asked for in one Claim).
        self.claim_batch = min(claim_batch or concurrency, concurrency, _MAX_BATCH)
        self.claim_linger = claim_linger
        self.lease = lease
        self.claim_wait = claim_wait
        self.grace = grace
        self.kinds = list(kinds) if kinds is not None else None
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.settle_delay = settle_delay
        self.call_timeout = call_timeout
        self.heartbeat_interval = lease / 3
        self._on_count = on_count
        self._handlers: dict[str, Handler] = {}
        self._stats = WorkerStats()
        self._stats_lock = threading.Lock()
        self._otel = _otel.Counters()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._stop_requested = False
        self._signalled = False
        self._force = False

    # Registration -------------------------------------------------------------------

    def handler(self, kind: str) -> Callable[[H], H]:
        """Decorator: `@worker.handler("email.send")` registers a handler for a kind."""

        def register(fn: H) -> H:
            self.add_handler(kind, fn)
            return fn

        return register

    def add_handler(self, kind: str, fn: Handler) -> None:
        """Registers `fn` (a plain or `async def` function of one Intent) for `kind`."""
        if kind in self._handlers:
            raise ValueError(f"a handler for {kind!r} is already registered")
        self._handlers[kind] = fn

    @property
    def stats(self) -> WorkerStats:
        """A snapshot of the counters."""
        with self._stats_lock:
            return dataclasses.replace(self._stats)

    def _count(self, name: str, n: int = 1) -> None:
        if n == 0:
            return
        with self._stats_lock:
            setattr(self._stats, name, getattr(self._stats, name) + n)
        self._otel.add(name, n, {"worker.id": self.worker_id})
        if self._on_count is not None:
            # The user's callback: its failure must not end the claim or heartbeat loop.
            try:
                self._on_count(name, n)
            except Exception:
                log.exception("outboxd worker %s: on_count(%r, %d) raised", self.worker_id, name, n)

    # Running ------------------------------------------------------------------------

    def run(self) -> None:
        """Runs until SIGTERM or SIGINT (or `stop()`), then drains and returns."""
        asyncio.run(self.run_async(handle_signals=threading.current_thread() is threading.main_thread()))

    def stop(self) -> None:
        """Asks the worker to drain and stop; safe from any thread or a signal handler.
        A second call skips the rest of the grace."""
        self._request_stop(force=self._stop_requested)

    def _on_signal(self) -> None:
        # A second signal ends the grace; a stop() of the app's own before the first signal
        # does not count as one.
        first, self._signalled = not self._signalled, True
        if not first:
            self._request_stop(force=True)
        elif not self._stop_requested:
            self.stop()

    def _request_stop(self, *, force: bool) -> None:
        if force:
            self._force = True
        self._stop_requested = True
        loop = self._loop
        if loop is not None and self._stop is not None:
            loop.call_soon_threadsafe(self._stop.set)

    async def run_async(self, *, handle_signals: bool = False) -> None:
        """Runs on the current event loop until `stop()` (or a signal, with
        `handle_signals`), then drains: no new claims, running handlers get `grace`
        seconds, settles are flushed, unfinished handlers' intents are failed RETRY
        (UNKNOWN once submitted) and their late results discarded.

        Cancelling the task running it (as `asyncio.run` does on Ctrl-C) drains as a second
        `stop()` would: no grace, running handlers given back at once, every settle flushed;
        then the CancelledError is raised on."""
        if not self._handlers and not self.kinds:
            raise ValueError("no handlers registered")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stop = asyncio.Event()
        self._signalled = False
        if self._stop_requested:
            self._stop.set()
        self._client = AsyncClient(self._config)
        self._active: dict[str, _Lease] = {}
        self._running = 0
        self._slot_freed = asyncio.Event()
        self._settles: asyncio.Queue[_Settle] = asyncio.Queue()
        self._flushes: set[asyncio.Task[None]] = set()
        self._unsettled = 0
        self._all_settled = asyncio.Event()
        self._flush_now = asyncio.Event()
        self._fatal: Optional[BaseException] = None
        # Made by the first sync handler's run (_call).
        self._pool: Optional[_ThreadPool] = None
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal)
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        self._settler = asyncio.create_task(self._settle_loop())
        try:
            try:
                await self._claim_loop()
                await self._drain()
            except BaseException:
                # Cancelled (Ctrl-C under asyncio.run cancels the main task) or failed:
                # nothing is left behind, as after a second stop().
                await self._drain_at_once()
                raise
        finally:
            heartbeat.cancel()
            self._settler.cancel()
            await asyncio.gather(heartbeat, self._settler, return_exceptions=True)
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            if self._pool is not None:
                self._pool.shutdown()
            try:
                # The exit never waits long on the channels (their close cancels the calls
                # still in flight, in grpc's own code).
                await asyncio.wait_for(self._client.close(), timeout=5.0)
            except asyncio.TimeoutError:
                log.warning("outboxd worker %s: closing its channels took over 5 s; left", self.worker_id)
            self._loop = None
            self._stop_requested = self._force = False
        if self._fatal is not None:
            raise self._fatal

    # Claiming -----------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        assert self._stop is not None
        stop_wait = asyncio.create_task(self._stop.wait())
        # The last Claim got fewer leases than it asked for: the queue is short, so waiting
        # for company would only add latency.
        short = True
        paused = False
        claim: Optional[asyncio.Task[tuple[Sequence[pb.Lease], float, bool]]] = None
        try:
            while not self._stop.is_set():
                free = self.concurrency - self._running
                if len(self._active) >= self.concurrency + _UNSETTLED_MAX:
                    if not paused:
                        paused = True
                        self._count("claims_paused")
                    await self._slot_or_stop(stop_wait)
                    continue
                paused = False
                if free <= 0:
                    await self._slot_or_stop(stop_wait)
                    continue
                if not short and free < self.claim_batch:
                    # A backlog: quick handlers free their slots within moments of each
                    # other, and one Claim (then one Ack) for all of them costs PostgreSQL
                    # one commit instead of one each.
                    deadline = time.monotonic() + self.claim_linger
                    while self.concurrency - self._running < self.claim_batch and not self._stop.is_set():
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        await self._slot_or_stop(stop_wait, left)
                    if self._stop.is_set():
                        break
                    free = self.concurrency - self._running
                asked = min(free, _MAX_BATCH)
                claim = asyncio.create_task(self._claim(asked))
                await asyncio.wait({claim, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not claim.done():
                    # A long-poll may hold the shutdown. A cancelled Claim gives back
                    # whatever it leased (the server sees the caller gone).
                    claim.cancel()
                    await asyncio.gather(claim, return_exceptions=True)
                    break
                done, claim = claim, None
                try:
                    leases, sent, late = done.result()
                except OutboxError as error:
                    # Not transient (refused key, scope, bad request): stop loudly.
                    self._fatal = error
                    log.error("outboxd worker %s: Claim refused: %s", self.worker_id, error)
                    self._stop.set()
                    break
                short = len(leases) < asked
                if late:
                    # Not cut short by a stop: these leases are held, and are run or given
                    # back, never left to expire unseen.
                    try:
                        leases, sent = await self._renew_claimed(leases, sent)
                    except asyncio.CancelledError:
                        self._give_back(leases, sent)
                        raise
                # Leases already taken are run even if a stop came meanwhile: they were
                # claimed before it, and they get the grace like any other.
                for lease in leases:
                    self._start(lease, sent)
        finally:
            stop_wait.cancel()
            if claim is not None:
                # Left by a cancellation: a Claim in flight is cancelled (the server gives
                # back what it took); one answered meanwhile gives its leases back unstarted.
                claim.cancel()
                await asyncio.gather(claim, return_exceptions=True)
                if not claim.cancelled() and claim.exception() is None:
                    leases, sent, _ = claim.result()
                    self._give_back(leases, sent)

    async def _slot_or_stop(self, stop_wait: asyncio.Task[bool], timeout: Optional[float] = None) -> None:
        """Waits until a handler frees its slot, the worker stops, or `timeout` passes."""
        self._slot_freed.clear()
        slot = asyncio.create_task(self._slot_freed.wait())
        await asyncio.wait({slot, stop_wait}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        slot.cancel()

    async def _claim(self, n: int) -> tuple[Sequence[pb.Lease], float, bool]:
        """One logical Claim: retried with the same request_id until it is answered, so a
        lost answer's leases are returned by the replay instead of stranded. Returns its
        leases, its first send, and whether it was answered late (`_renew_claimed`)."""
        request = pb.ClaimRequest(
            worker_id=self.worker_id,
            region=self.region,
            kinds=self.kinds if self.kinds is not None else sorted(self._handlers),
            max_intents=n,
            lease_duration=duration(self.lease),
            wait=duration(self.claim_wait),
            request_id=str(uuid.uuid4()),
        )
        backoff = Backoff()
        sent = time.monotonic()

        def on_retry(_: object) -> None:
            self._count("claim_retries")

        while True:
            try:
                answer = await self._client.call(
                    "Claim",
                    request,
                    pb.ClaimResponse,
                    timeout=self.claim_wait + self.call_timeout,
                    budget=self.claim_wait + self.call_timeout,
                    on_retry=on_retry,
                )
                # Answered within the margin, its leases began after the send, and not long
                # before the answer. Later (a long poll's wait, a retry, or an answer held
                # on its way back), they may have begun long before it.
                margin = min(1.0, self.lease / 4)
                return answer.leases, sent, time.monotonic() - sent > margin
            except OutboxError as error:
                if not transient(error.code, error.reason):
                    raise
                # Budget spent: keep the request_id and keep trying, slower.
                log.warning("outboxd worker %s: Claim: %s", self.worker_id, error)
                on_retry(error)
                await asyncio.sleep(backoff.next())

    async def _renew_claimed(self, leases: Sequence[pb.Lease], sent: float) -> tuple[Sequence[pb.Lease], float]:
        """Leases of a Claim answered late, which may have begun at any time since its
        first send (a long poll's wait, fresh leases of a retry, an answer held on its way
        back): one ExtendLease gives every one a known expiry, counted from its send; those
        it reports lost are dropped unstarted. If it fails, or fails for one of them without
        losing it, they count from the Claim's first send (the earliest they can have
        begun)."""
        if not leases:
            return leases, sent
        renewed = time.monotonic()
        refs = [pb.LeaseRef(intent_id=x.intent.id, lease_id=x.lease_id) for x in leases]
        answer = await self._extend_leases(refs, "a late Claim's leases")
        if answer is None:
            return leases, sent
        kept = []
        unsure = False
        for i, lease in enumerate(leases):
            item = answer.results[i] if i < len(answer.results) else None
            if item is not None and not item.HasField("error"):
                kept.append(lease)
                continue
            if item is None or item.error.reason not in _LOST_REASONS:
                # Not renewed, but not lost either: it holds until its first expiry.
                self._count("heartbeat_failures")
                kept.append(lease)
                unsure = True
                continue
            self._count("claimed")
            self._count("lease_lost")
            log.warning(
                "outboxd worker %s: lease of %s from a late Claim not renewed: %s %s",
                self.worker_id,
                lease.intent.id,
                item.error.reason,
                item.error.message,
            )
        return kept, sent if unsure else renewed

    def _give_back(self, leases: Sequence[pb.Lease], sent: float) -> None:
        """Fails RETRY, unstarted, the leases of a Claim answered as the worker was
        cancelled (the drain flushes them): sooner back than at their expiry."""
        for lease in leases:
            self._count("claimed")
            intent = Intent(self, lease)
            state = _Lease(intent, lease.lease_id, sent + self.lease)
            intent._state = state
            self._active[intent.id] = state
            self._queue_settle(_Settle(state, pb.FAIL_OUTCOME_RETRY, "worker stopped before the handler started"))

    def _start(self, lease: pb.Lease, sent: float) -> None:
        self._count("claimed")
        if time.monotonic() >= sent + self.lease:
            # Past its local expiry before it started (a late answer whose renewal failed):
            # it may be leased again by now, so the side effect is not begun.
            self._count("lease_lost")
            log.warning(
                "outboxd worker %s: lease of %s expired before the Claim's answer arrived",
                self.worker_id,
                lease.intent.id,
            )
            return
        intent = Intent(self, lease)
        state = _Lease(intent, lease.lease_id, sent + self.lease)
        intent._state = state
        self._active[intent.id] = state
        self._running += 1
        state.task = asyncio.create_task(self._execute(state))

    # Handling -----------------------------------------------------------------------

    async def _execute(self, lease: _Lease) -> None:
        intent = lease.intent
        handler = self._handlers.get(intent.kind)
        settle: Optional[_Settle] = None
        try:
            if handler is None:
                known = ", ".join(sorted(self._handlers)) or "none"
                settle = _Settle(
                    lease,
                    pb.FAIL_OUTCOME_PERMANENT,
                    f"no handler for kind {intent.kind!r} in worker {self.worker_id} (handlers: {known})",
                )
                log.error("outboxd worker %s: %s", self.worker_id, settle.error)
            else:
                settle = await self._call(handler, lease)
        finally:
            self._running -= 1
            self._slot_freed.set()
            if settle is not None and not lease.lost and not lease.abandoned:
                self._queue_settle(settle)
            elif not lease.settling:
                # Nothing to report (lost, or the drain gave it back) or nothing could be
                # (an error of the worker's own): never heartbeated again.
                self._forget(lease)

    async def _call(self, handler: Handler, lease: _Lease) -> Optional[_Settle]:
        intent = lease.intent
        try:
            if _is_async(handler):
                with _otel.handler_span(intent.kind, intent.id, intent.attempt, self.worker_id, intent.headers):
                    result = handler(intent)
                    if result is not None:
                        await result
            else:
                assert self._loop is not None
                loop = self._loop
                if self._pool is None:
                    self._pool = _ThreadPool(self.concurrency, f"outboxd-{self.worker_id}")
                pool = self._pool

                def run() -> None:
                    with _otel.handler_span(intent.kind, intent.id, intent.attempt, self.worker_id, intent.headers):
                        result = handler(intent)
                        if inspect.isawaitable(result):
                            # An async handler that did not look like one (a sync decorator
                            # around an async def): awaited on the loop, never acked unrun.
                            future = asyncio.run_coroutine_threadsafe(_awaited(result), loop)
                            lease.loop_future = future
                            if lease.lost or lease.abandoned:
                                future.cancel()
                            future.result()

                await pool.submit(loop, run)
        except asyncio.CancelledError as e:
            if lease.lost or lease.abandoned:
                # The worker's: lease lost or shutdown past the grace, nothing to report.
                return None
            # The handler's own (a call of its own cancelled): it did not finish.
            return self._failed(lease, e)
        except LeaseLost:
            if not lease.abandoned:  # the drain reports an abandoned one itself
                self._mark_lost(lease)
            return None
        except Retry as e:
            return _Settle(lease, pb.FAIL_OUTCOME_RETRY, _text(e), e.after)
        except Permanent as e:
            return _Settle(lease, pb.FAIL_OUTCOME_PERMANENT, _text(e) or _describe(e))
        except Unknown as e:
            return _Settle(lease, pb.FAIL_OUTCOME_UNKNOWN, _text(e) or _describe(e))
        except (KeyboardInterrupt, SystemExit) as e:
            if _is_async(handler):
                raise  # on the loop's thread: Ctrl-C or the program's exit, not the handler's
            # Raised in the handler's thread, so the handler's own (Ctrl-C and the process's
            # exit come to the main thread): a failure like any other.
            return self._failed(lease, e)
        except BaseException as e:  # noqa: BLE001 - logged with its traceback by _failed
            # Any other, BaseExceptions too (a gevent Timeout, an exception group): the
            # handler's own, a failure like any other.
            return self._failed(lease, e)
        return _Settle(lease, 0)

    def _failed(self, lease: _Lease, e: BaseException) -> _Settle:
        """Any other exception: RETRY with the server's backoff, UNKNOWN once submitted."""
        intent = lease.intent
        outcome = pb.FAIL_OUTCOME_UNKNOWN if lease.submitted else pb.FAIL_OUTCOME_RETRY
        log.warning(
            "outboxd worker %s: handler for %s %s raised %s",
            self.worker_id,
            intent.kind,
            intent.id,
            _describe(e),
            exc_info=e,
        )
        return _Settle(lease, outcome, _describe(e))

    def _heartbeat_try_timeout(self) -> float:
        """One try of an ExtendLease: a third of the interval (at least 0.5 s), so that a
        replica that never answers (two in a row) leaves time for the next endpoint within
        the round."""
        return min(self.call_timeout, self.heartbeat_interval, max(self.heartbeat_interval / 3, 0.5))

    def _lease_call_timeout(self) -> float:
        """One try of a settle or MarkSubmitted: short enough that a replica that never
        answers leaves time within the lease for a retry on the next one."""
        return min(self.call_timeout, max(self.heartbeat_interval, 1.0))

    async def _mark_submitted(self, lease: _Lease) -> None:
        # Lost first: a second submitting() after the loss must not start its call either.
        if lease.lost or lease.abandoned:
            raise LeaseLost(f"lease on {lease.intent.id} lost before MarkSubmitted")
        if lease.submitted:
            return
        answer = await self._client.call(
            "MarkSubmitted",
            pb.MarkSubmittedRequest(leases=[lease.ref()]),
            pb.MarkSubmittedResponse,
            timeout=self._lease_call_timeout(),
            budget=max(0.5, lease.expires - time.monotonic()),
        )
        # Decided on the loop with no await before `submitted = True`, as the drain decides
        # its outcome: either the drain saw `submitted` (and fails the intent UNKNOWN), or it
        # gave the lease back (RETRY) before this answer came, and the call must not start.
        if lease.lost or lease.abandoned:
            raise LeaseLost(f"lease on {lease.intent.id} lost or given back while MarkSubmitted was in flight")
        item = answer.results[0]
        if item.HasField("error"):
            if item.error.reason in _LOST_REASONS:
                self._mark_lost(lease)
                raise LeaseLost(f"{item.error.reason}: {item.error.message}")
            raise OutboxError(grpc.StatusCode.FAILED_PRECONDITION, item.error.reason, item.error.message)
        lease.submitted = True

    def _mark_lost(self, lease: _Lease) -> None:
        if lease.lost:
            return
        lease.lost = True
        lease.lost_event.set()
        self._count("lease_lost")
        log.warning("outboxd worker %s: lease on %s lost", self.worker_id, lease.intent.id)
        task = lease.task
        if task is not None and not task.done() and not lease.settling:
            # Async handlers get a cancellation; sync ones see intent.lease_lost.
            if _is_async(self._handlers.get(lease.intent.kind)):
                task.cancel()
            if lease.loop_future is not None:
                lease.loop_future.cancel()
        if lease.task is None or lease.task.done() or lease.settling:
            self._forget(lease)

    def _forget(self, lease: _Lease) -> None:
        if self._active.get(lease.intent.id) is lease:
            del self._active[lease.intent.id]
            # A claim paused while settles lag waits for this.
            self._slot_freed.set()

    # Heartbeats ---------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        """Extends every live lease each `heartbeat_interval`; a lease whose local expiry
        passes without an extension is lost (it may be rescued and re-leased by now)."""
        last = time.monotonic()
        tick = min(self.heartbeat_interval, 0.25)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for lease in list(self._active.values()):
                # A lease whose settle is queued or in flight is left to that call's answer.
                if now >= lease.expires and not lease.lost and not lease.settling:
                    self._mark_lost(lease)
            if now - last >= self.heartbeat_interval:
                last = now
                await self._extend_all()

    async def _extend_leases(self, refs: Sequence[pb.LeaseRef], what: str) -> Optional[pb.ExtendLeaseResponse]:
        """One ExtendLease of `refs` by a lease's length, within a heartbeat interval; None
        if it failed (counted and logged, `what` naming the leases for the log)."""
        try:
            return await self._client.call(
                "ExtendLease",
                pb.ExtendLeaseRequest(leases=refs, lease_duration=duration(self.lease)),
                pb.ExtendLeaseResponse,
                timeout=self._heartbeat_try_timeout(),
                budget=self.heartbeat_interval,
            )
        except (OutboxError, grpc.RpcError) as error:
            self._count("heartbeat_failures")
            log.warning("outboxd worker %s: ExtendLease of %s: %s", self.worker_id, what, error)
            return None

    async def _extend_all(self) -> None:
        leases = [x for x in self._active.values() if not x.lost]
        for start in range(0, len(leases), 1000):
            chunk = leases[start : start + 1000]
            sent = time.monotonic()
            answer = await self._extend_leases([x.ref() for x in chunk], "live leases")
            if answer is None:
                continue
            for lease, item in zip(chunk, answer.results):
                if not item.HasField("error"):
                    lease.expires = sent + self.lease
                elif lease.settling:
                    pass  # settled meanwhile: the settle's answer counts, not this one
                elif item.error.reason in _LOST_REASONS:
                    self._mark_lost(lease)
                else:
                    self._count("heartbeat_failures")

    # Settling -----------------------------------------------------------------------

    async def _settle_loop(self) -> None:
        """Collects Acks and Fails for `settle_delay` and sends each kind as one call."""
        while True:
            first = await self._settles.get()
            if self.settle_delay > 0 and not self._flush_now.is_set():
                # The drain does not wait for company.
                try:
                    await asyncio.wait_for(self._flush_now.wait(), self.settle_delay)
                except asyncio.TimeoutError:
                    pass
                except asyncio.CancelledError:
                    self._settles.put_nowait(first)  # for the drain's settle loop
                    raise
            batch = [first]
            while len(batch) < 1000 and not self._settles.empty():
                batch.append(self._settles.get_nowait())
            task = asyncio.create_task(self._flush(batch))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
            if len(self._flushes) >= 4:
                await asyncio.wait(set(self._flushes), return_when=asyncio.FIRST_COMPLETED)

    def _queue_settle(self, settle: _Settle) -> None:
        settle.lease.settling = True
        self._unsettled += 1
        self._settles.put_nowait(settle)

    async def _flush(self, batch: list[_Settle]) -> None:
        ended = batch
        try:
            await self._flush_batch(batch)
        except asyncio.CancelledError:
            # Cancelled with every task of the loop (asyncio.run before Python 3.11, on
            # Ctrl-C): those whose call had not answered are queued again, for the drain's
            # settle loop (a call that applied meanwhile is answered as a replay).
            ended = [s for s in batch if s.answered]
            for s in batch:
                if not s.answered:
                    self._settles.put_nowait(s)
            raise
        except Exception as error:
            log.exception("outboxd worker %s: settle of %d intents failed: %s", self.worker_id, len(batch), error)
            self._count("settle_errors", len(batch))
        finally:
            # Settled, refused or failed: its lease is never heartbeated again.
            for s in ended:
                self._forget(s.lease)
            self._unsettled -= len(ended)
            if self._unsettled == 0:
                self._all_settled.set()

    async def _flush_batch(self, batch: list[_Settle]) -> None:
        batch = [s for s in batch if not s.lease.lost]
        acks = [s for s in batch if s.outcome == 0]
        fails = [s for s in batch if s.outcome != 0]
        calls = []
        if acks:
            calls.append(self._send_acks(acks))
        if fails:
            calls.append(self._send_fails(fails))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome

    async def _send_acks(self, acks: list[_Settle]) -> None:
        try:
            answer = await self._client.call(
                "Ack",
                pb.AckRequest(leases=[s.lease.ref() for s in acks]),
                pb.AckResponse,
                timeout=self._lease_call_timeout(),
                budget=max(self.lease, self.call_timeout),
            )
        except OutboxError as error:
            self._settle_failed(acks, error)
            return
        self._apply(acks, answer.results, "acked")

    async def _send_fails(self, all_fails: list[_Settle]) -> None:
        fails, failures = [], []
        for s in all_fails:
            try:
                failures.append(self._failure(s))
                fails.append(s)
            except Exception:
                # Never one bad item for the whole call: this one's lease expires instead.
                log.exception("outboxd worker %s: Fail of %s not sent", self.worker_id, s.lease.intent.id)
                self._count("settle_errors")
        calls = []
        for part in _split_by_size([f.ByteSize() for f in failures], _MAX_CALL_BYTES):
            calls.append(self._send_fail_call([fails[i] for i in part], [failures[i] for i in part]))
        await asyncio.gather(*calls)

    def _failure(self, s: _Settle) -> pb.Failure:
        """The Failure of one settle, as the server accepts it: text it cannot encode is
        replaced, a retry_after that cannot be sent is left out (the server's backoff)."""
        f = pb.Failure(lease=s.lease.ref(), error=_fail_text(s.error), outcome=s.outcome)  # type: ignore[arg-type]
        if s.outcome == pb.FAIL_OUTCOME_RETRY and s.retry_after is not None:
            try:
                f.retry_after.CopyFrom(duration(max(retry_seconds(s.retry_after), 0.001)))
            except (TypeError, ValueError, OverflowError) as error:
                f.ClearField("retry_after")
                log.warning(
                    "outboxd worker %s: retry_after of %s left out: %s", self.worker_id, s.lease.intent.id, error
                )
        return f

    async def _send_fail_call(self, fails: list[_Settle], failures: list[pb.Failure]) -> None:
        try:
            answer = await self._client.call(
                "Fail",
                pb.FailRequest(failures=failures),
                pb.FailResponse,
                timeout=self._lease_call_timeout(),
                budget=max(self.lease, self.call_timeout),
            )
        except OutboxError as error:
            if error.code == grpc.StatusCode.INVALID_ARGUMENT and len(fails) > 1:
                # One bad item refuses the whole call: each alone, so the others apply.
                for settle, failure in zip(fails, failures):
                    await self._send_fail_call([settle], [failure])
                return
            self._settle_failed(fails, error)
            return
        self._apply(fails, answer.results, "failed")

    def _apply(self, batch: list[_Settle], results: Sequence[pb.LeaseResult], counter: str) -> None:
        done = 0
        for settle in batch:
            settle.answered = True
        for settle, item in zip(batch, results):
            if not item.HasField("error"):
                done += 1
            elif item.error.reason in _LOST_REASONS:
                settle.lease.lost = True
                settle.lease.lost_event.set()
                self._count("lease_lost")
            else:
                self._count("settle_errors")
                log.error(
                    "outboxd worker %s: settle of %s refused: %s %s",
                    self.worker_id,
                    settle.lease.intent.id,
                    item.error.reason,
                    item.error.message,
                )
            self._forget(settle.lease)
        self._count(counter, done)

    def _settle_failed(self, batch: list[_Settle], error: OutboxError) -> None:
        # No answer within a lease's time: the leases expire and the intents come back.
        log.error("outboxd worker %s: settle of %d intents failed: %s", self.worker_id, len(batch), error)
        self._count("settle_errors", len(batch))
        for s in batch:
            s.answered = True
            self._forget(s.lease)

    # Shutdown -----------------------------------------------------------------------

    async def _drain(self) -> None:
        """After the claim loop stopped: the grace for running handlers, then settles."""
        running = [x.task for x in self._active.values() if x.task is not None and not x.task.done()]
        deadline = time.monotonic() + self.grace
        while running and not self._force and time.monotonic() < deadline:
            _, pending = await asyncio.wait(running, timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            running = list(pending)
        abandoned = []
        cancelled = []
        for lease in list(self._active.values()):
            if lease.task is not None and not lease.task.done() and not lease.abandoned:
                lease.abandoned = True
                lease.lost_event.set()
                lease.task.cancel()
                cancelled.append(lease.task)
                if lease.loop_future is not None:
                    lease.loop_future.cancel()
                if not lease.lost:
                    # It did not finish: give it back now instead of waiting for the lease
                    # to expire. Once submitted, nobody knows whether the call happened.
                    outcome = pb.FAIL_OUTCOME_UNKNOWN if lease.submitted else pb.FAIL_OUTCOME_RETRY
                    abandoned.append(_Settle(lease, outcome, "worker shut down before the handler finished"))
        if abandoned:
            log.warning(
                "outboxd worker %s: %d handlers did not finish within the grace", self.worker_id, len(abandoned)
            )
        for s in abandoned:
            self._queue_settle(s)
        # Every settle queued or in flight is answered (or runs out of its budget), at once.
        self._flush_now.set()
        self._all_settled.clear()
        if self._unsettled:
            await self._all_settled.wait()
        if cancelled:
            # Their tasks end at the cancellation (a sync handler's thread is left to
            # itself): none is left behind on the loop, unless a handler ignores it.
            await asyncio.wait(cancelled, timeout=1.0)

    async def _drain_at_once(self) -> None:
        """The drain after a cancellation: no grace (as a second stop()), and finished
        even if the cancellation is repeated (it is bounded by the settles' budgets)."""
        self._stop_requested = self._force = True
        if self._stop is not None:
            self._stop.set()
        # A settle loop of the drain's own: the cancellation may have reached every task of
        # the loop (asyncio.run before Python 3.11), the settle loop's and its calls' too,
        # which queue their settles again as they end, for this one to send.
        self._settler.cancel()
        self._settler = asyncio.create_task(self._settle_loop())
        drain = asyncio.ensure_future(self._drain())
        # Bounded whatever happens to its calls: a cancelled worker always ends.
        deadline = time.monotonic() + self.call_timeout + max(self.lease, self.call_timeout)
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(drain), max(0.0, deadline - time.monotonic()))
                return
            except asyncio.TimeoutError:
                log.error("outboxd worker %s: the drain after a cancellation did not end in time", self.worker_id)
                return
            except asyncio.CancelledError:
                if drain.done():
                    return
            except Exception as error:
                log.exception("outboxd worker %s: drain failed: %s", self.worker_id, error)
                return


def _split_by_size(sizes: list[int], limit: int) -> list[range]:
    """Consecutive parts of items of `sizes` whose sum (with a few bytes of framing each)
    stays within `limit`; an item larger than `limit` alone."""
    parts: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size + 8 > limit:
            parts.append(range(start, i))
            start, total = i, 0
        total += size + 8
    if start < len(sizes):
        parts.append(range(start, len(sizes)))
    return parts


def _fail_text(text: str) -> str:
    """The `error` of a Fail as the server accepts it: every control character (a traceback's
    newlines, tabs) becomes a space, what UTF-8 cannot encode (a lone surrogate) a `?`, and
    the text is cut to `_MAX_ERROR_CHARS` characters. Refused text would refuse the Fail, and
    the intent would wait out its lease."""
    text = text[:_MAX_ERROR_CHARS].encode("utf-8", "replace").decode("utf-8")
    return "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)


def _text(e: BaseException) -> str:
    """str(e), or empty if even that fails."""
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - a broken __str__ of the handler's exception
        return ""


def _describe(e: BaseException) -> str:
    text = _text(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _is_async(fn: object) -> bool:
    """An `async def` function, or a callable object whose `__call__` is one."""
    call = getattr(fn, "__call__", None)  # noqa: B004 - the method itself is what is asked about
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable
