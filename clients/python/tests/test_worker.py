"""The worker against two real outboxd replicas: delivery, heartbeats, outcomes, replays."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import os
import socket
import threading
import time
import uuid
from typing import Any, Awaitable, Callable, Optional, Sequence

import pytest
from conftest import Running, list_intents, state, wait_state
from harness import Stack, free_port, wait_for
from proxy import Cuts, FaultProxy

import outboxd
from outboxd import Intent, LeaseLost, NewIntent, Permanent, Retry, Worker, pb
from outboxd._rpc import AsyncClient
from outboxd.worker import _MAX_CALL_BYTES
from outboxd.worker import _fail_text as fail_text
from outboxd.worker import _split_by_size as split_by_size


def enqueue(outbox: outboxd.Outbox, kind: str, n: int, size: int = 0) -> list[str]:
    ids: list[str] = []
    for start in range(0, n, 1000):
        batch = [
            NewIntent(kind=kind, payload=b"x" * size or f"{i}".encode()) for i in range(start, min(n, start + 1000))
        ]
        ids += [r.id for r in outbox.enqueue_direct_many(batch)]
    return ids


def test_two_workers_of_concurrency_8_drain_2000_intents_across_two_replicas_exactly_once(
    stack: Stack, kind: Callable[[str], str]
) -> None:
    k = kind("drain")
    a, b = stack.endpoints
    # Half enqueued through each replica; each worker prefers a different one.
    with outboxd.Outbox([a], stack.api_key) as via_a, outboxd.Outbox([b], stack.api_key) as via_b:
        ids = enqueue(via_a, k, 1000) + enqueue(via_b, k, 1000)
    seen: collections.Counter[str] = collections.Counter()
    tenants: set[str] = set()
    lock = threading.Lock()
    workers = [Worker([a, b], stack.api_key, concurrency=8), Worker([b, a], stack.api_key, concurrency=8)]

    def handle(intent: Intent) -> None:
        with lock:
            seen[intent.id] += 1
            tenants.add(intent.tenant)

    async def handle_async(intent: Intent) -> None:
        seen[intent.id] += 1  # the loop thread: no lock needed against itself
        tenants.add(intent.tenant)

    workers[0].add_handler(k, handle)
    workers[1].add_handler(k, handle_async)
    with Running(workers[0]), Running(workers[1]):
        wait_for("2000 acks", lambda: sum(w.stats.acked for w in workers) >= 2000, timeout=90)
    assert set(seen) == set(ids)
    assert max(seen.values()) == 1, "an intent was handled twice"
    assert tenants == {"default"}, "the key's tenant"
    assert sum(w.stats.claimed for w in workers) == 2000
    assert all(w.stats.claimed > 0 for w in workers), [w.stats for w in workers]
    states = collections.Counter(i.state for i in list_intents(stack_outbox(stack), k).values())
    assert states == {pb.INTENT_STATE_DELIVERED: 2000}


def stack_outbox(stack: Stack) -> outboxd.Outbox:
    return outboxd.Outbox(stack.endpoints, stack.api_key)


def test_a_handler_running_10s_under_a_2s_lease_is_never_redelivered(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("slow")
    [intent_id] = enqueue(outbox, k, 1)
    calls: list[int] = []
    # A rival worker on the other replica would get the intent if its lease ever expired.
    rival_calls: list[int] = []
    slow = Worker(stack.endpoints[:1], stack.api_key, lease=2, concurrency=1)
    rival = Worker(stack.endpoints[1:], stack.api_key, lease=2, concurrency=1, claim_wait=1)

    @slow.handler(k)
    def work(intent: Intent) -> None:
        calls.append(intent.attempt)
        assert not intent.wait_lease_lost(10.0), "lease lost while heartbeating"

    @rival.handler(k)
    def steal(intent: Intent) -> None:
        rival_calls.append(intent.attempt)

    with Running(slow):
        wait_for("the slow handler started", lambda: calls, timeout=15)
        with Running(rival):
            wait_for("the slow handler acked", lambda: slow.stats.acked == 1, timeout=30)
    assert calls == [1]
    assert rival_calls == []
    assert slow.stats.heartbeat_failures == 0
    assert slow.stats.lease_lost == 0
    delivered = wait_state(outbox, intent_id, "DELIVERED")
    assert delivered.attempts == 1


def test_an_intent_enqueued_late_in_a_long_poll_longer_than_the_lease_is_handled(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("late")
    handled: list[str] = []
    w = Worker(stack.endpoints[:1], stack.api_key, lease=2, claim_wait=8, concurrency=1)
    w.add_handler(k, lambda intent: handled.append(intent.id))
    with Running(w):
        began = time.monotonic()
        # The scenario is time itself: the poll has waited longer than a lease lasts.
        wait_for("3 s into the long poll", lambda: time.monotonic() - began > 3, timeout=10)
        [intent_id] = enqueue(outbox, k, 1)
        wait_for("the intent acked", lambda: w.stats.acked == 1, timeout=15)
    assert handled == [intent_id]
    assert w.stats.lease_lost == 0


def test_a_lease_whose_heartbeats_are_blocked_is_lost_and_its_late_ack_is_not_counted(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("blocked")
    [intent_id] = enqueue(outbox, k, 1)
    blocked = Worker(stack.endpoints[:1], stack.api_key, lease=2, concurrency=1)
    held: list[Intent] = []
    release = threading.Event()

    async def no_heartbeat() -> None:
        blocked._count("heartbeat_failures")  # as if every ExtendLease were lost

    blocked._extend_all = no_heartbeat  # type: ignore[method-assign]

    @blocked.handler(k)
    def hang(intent: Intent) -> None:
        held.append(intent)
        # Still working when the lease is lost; finishes "successfully" only once the
        # intent was delivered by another worker (holding its only slot until then).
        assert intent.wait_lease_lost(20.0)
        assert release.wait(30.0)

    with Running(blocked):
        wait_for("the handler started", lambda: held, timeout=15)
        wait_for("the lease lost", lambda: blocked.stats.lease_lost == 1, timeout=10)
        # The server rescues the expired lease; another worker gets the intent.
        rival = Worker(stack.endpoints[1:], stack.api_key, concurrency=1)
        attempts: list[int] = []
        rival.add_handler(k, lambda intent: attempts.append(intent.attempt))
        with Running(rival):
            wait_for("the rival acked", lambda: rival.stats.acked == 1, timeout=20)
        release.set()
        wait_for("the late handler returned", lambda: blocked._running == 0, timeout=10)
    assert attempts == [2]
    assert blocked.stats.acked == 0 and blocked.stats.failed == 0
    assert blocked.stats.heartbeat_failures >= 1
    # The fencing token of the lost lease is refused by the server too.
    late = outbox._client.call(
        "Ack",
        pb.AckRequest(leases=[pb.LeaseRef(intent_id=intent_id, lease_id=held[0].lease_id)]),
        pb.AckResponse,
        timeout=5,
        budget=5,
    )
    assert late.results[0].error.reason == "LEASE_LOST"
    assert wait_state(outbox, intent_id, "DELIVERED").worker_id == rival.worker_id


def test_handler_outcomes_map_to_ack_retry_dead_letter_and_reconcile(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    kinds = {name: kind(name) for name in ("ok", "retry", "boom", "permanent", "submit_boom", "async", "orphan")}
    ids = {name: outbox.enqueue_direct(k, b"{}").id for name, k in kinds.items()}
    # The orphan kind is claimed (kinds= lists it) but has no handler.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=4, kinds=sorted(kinds.values()))
    attempts: collections.Counter[str] = collections.Counter()

    @worker.handler(kinds["ok"])
    def ok(intent: Intent) -> None:
        attempts["ok"] += 1

    @worker.handler(kinds["retry"])
    def retry(intent: Intent) -> None:
        attempts["retry"] += 1
        if intent.attempt == 1:
            raise Retry("not yet", after=0.2)

    @worker.handler(kinds["boom"])
    def boom(intent: Intent) -> None:
        attempts["boom"] += 1
        if intent.attempt == 1:
            raise ValueError("flaky")  # RETRY with the server's backoff (1 s)

    @worker.handler(kinds["permanent"])
    def permanent(intent: Intent) -> None:
        raise Permanent("bad address")

    @worker.handler(kinds["submit_boom"])
    def submit_boom(intent: Intent) -> None:
        with intent.submitting():
            raise TimeoutError("PSP timed out")

    @worker.handler(kinds["async"])
    async def is_async(intent: Intent) -> None:
        async with intent.submitting():
            await asyncio.sleep(0)
        attempts["async"] += 1

    with Running(worker):
        wait_state(outbox, ids["ok"], "DELIVERED")
        wait_state(outbox, ids["retry"], "DELIVERED")
        wait_state(outbox, ids["boom"], "DELIVERED")
        assert wait_state(outbox, ids["permanent"], "DEAD_LETTERED").last_error == "bad address"
        assert "PSP timed out" in wait_state(outbox, ids["submit_boom"], "NEEDS_RECONCILE").last_error
        wait_state(outbox, ids["async"], "DELIVERED")
        orphan = wait_state(outbox, ids["orphan"], "DEAD_LETTERED")
        assert "no handler for kind" in orphan.last_error
    assert attempts == {"ok": 1, "retry": 2, "boom": 2, "async": 1}
    assert worker.stats.acked == 4 and worker.stats.failed == 5


def test_an_error_with_a_newline_and_a_tab_is_failed_at_once_with_spaces_in_their_place(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("multiline")
    short = outbox.enqueue_direct(k, b"short").id
    long = outbox.enqueue_direct(k, b"long").id
    # Leases far longer than the wait below: a refused Fail would leave the intents LEASED
    # until they expire, so reaching PENDING proves the Fail itself was accepted.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, lease=120)

    @worker.handler(k)
    def fail(intent: Intent) -> None:
        # Retried much later: the intents stay PENDING while the test looks.
        if intent.payload == b"long":
            raise Retry("\u00e9" * 5000 + "\n", after=600)  # over the server's 4096 characters
        raise Retry("charge failed:\n\tcard declined\r\n", after=600)

    def failed(intent_id: str) -> Callable[[], Optional[pb.Intent]]:
        def check() -> Optional[pb.Intent]:
            i = outbox.get_intent(intent_id).intent
            # PENDING before the claim too: the attempt tells the failed one apart.
            return i if i.state == pb.INTENT_STATE_PENDING and i.attempts == 1 else None

        return check

    with Running(worker):
        short_failed = wait_for("the short error's Fail applied", failed(short), timeout=30, interval=0.05)
        long_failed = wait_for("the long error's Fail applied", failed(long), timeout=30, interval=0.05)
    assert short_failed.last_error == "charge failed:  card declined  "
    assert long_failed.last_error == "\u00e9" * 4096
    assert worker.stats.failed == 2 and worker.stats.settle_errors == 0, worker.stats


def test_a_fail_the_server_refuses_does_not_hold_back_the_others_of_its_call(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = kind("refused")
    bad = outbox.enqueue_direct(k, b"bad").id
    good = outbox.enqueue_direct(k, b"good").id
    # Both handlers run at once (threads) and fail together; their Fails wait for company
    # (settle_delay) and go out in one call. Leases far longer than the wait, so only the
    # Fail itself can finish the good one in time.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, lease=120, settle_delay=0.5)
    together = threading.Barrier(2, timeout=10)
    # The worker never sends text the server refuses; without its cleaning, a newline does.
    monkeypatch.setattr("outboxd.worker._fail_text", lambda text: text)

    @worker.handler(k)
    def fail(intent: Intent) -> None:
        together.wait()
        if intent.payload == b"bad":
            raise Retry("later\nagain", after=600)  # a control character: refused
        raise Permanent("bad address")

    with Running(worker):
        assert wait_state(outbox, good, "DEAD_LETTERED").last_error == "bad address"
    assert outbox.get_intent(bad).intent.state == pb.INTENT_STATE_LEASED
    assert worker.stats.failed == 1 and worker.stats.settle_errors == 1, worker.stats


def test_fail_text_turns_control_characters_into_spaces_and_cuts_on_characters() -> None:
    assert fail_text("line one\nline\ttwo\r\n\x7f\x85end") == "line one line two    end"
    assert fail_text("d\u00e9j\u00e0 vu \U0001f600") == "d\u00e9j\u00e0 vu \U0001f600"
    assert fail_text("\U0001f600" * 5000) == "\U0001f600" * 4096


def test_fails_with_long_texts_are_split_into_calls_the_server_accepts() -> None:
    failure = pb.Failure(
        lease=pb.LeaseRef(intent_id="0" * 36, lease_id="1" * 36),
        error=fail_text("\U0001f600" * 5000),
        outcome=pb.FAIL_OUTCOME_RETRY,
    )
    sizes = [failure.ByteSize()] * 1000
    parts = split_by_size(sizes, _MAX_CALL_BYTES)
    assert len(parts) > 1
    assert [i for part in parts for i in part] == list(range(1000))
    for part in parts:
        request = pb.FailRequest(failures=[failure] * len(part))
        assert request.ByteSize() <= _MAX_CALL_BYTES
    assert split_by_size([_MAX_CALL_BYTES * 2, 1], _MAX_CALL_BYTES) == [range(0, 1), range(1, 2)]


def test_lost_claim_answers_are_replayed_and_strand_no_lease(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("lost")
    # Claim answers of 5 KiB payloads are the only large server→client chunks: the proxies
    # drop the first one and reset the connection, after the server committed its leases.
    ids = enqueue(outbox, k, 5, size=5000)
    cuts = Cuts(1, threshold=4000)
    with FaultProxy(stack.endpoints[0], cuts) as pa, FaultProxy(stack.endpoints[1], cuts) as pb_:
        worker = Worker([pa.addr, pb_.addr], stack.api_key, concurrency=8, lease=30)
        handled: collections.Counter[str] = collections.Counter()
        worker.add_handler(k, lambda intent: handled.update([intent.id]))
        started = time.monotonic()
        with Running(worker):
            wait_for("5 acks", lambda: worker.stats.acked == 5, timeout=20)
        took = time.monotonic() - started
    assert cuts.done == 1
    assert worker.stats.claim_retries >= 1
    assert handled == {i: 1 for i in ids}
    # Not rescued after 30 s of lease (that would be attempt 2): the replay returned them.
    assert took < 20
    assert all(i.attempts == 1 for i in list_intents(outbox, k).values())
    assert all(state(outbox, i) == "DELIVERED" for i in ids)


def test_an_ack_to_a_replica_that_froze_goes_to_the_next_within_a_short_lease(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("ackfrozen")
    [intent_id] = enqueue(outbox, k, 1)
    with FaultProxy(stack.endpoints[0], Cuts(0, threshold=1)) as proxy:
        worker = Worker([proxy.addr, stack.endpoints[1]], stack.api_key, concurrency=1, lease=3, claim_wait=1)
        attempts: list[int] = []

        def handle(intent: Intent) -> None:
            attempts.append(intent.attempt)
            proxy.frozen = True  # the replica holding the lease stops answering

        worker.add_handler(k, handle)
        with Running(worker):
            wait_for("the intent acked", lambda: worker.stats.acked == 1, timeout=20)
    assert attempts == [1], "run twice: the Ack reached no replica within the lease"
    assert worker.stats.settle_errors == 0
    assert wait_state(outbox, intent_id, "DELIVERED").attempts == 1


def test_a_sync_handler_raising_system_exit_is_failed_retry_and_the_worker_goes_on(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("exit")
    ids = enqueue(outbox, k, 3)
    worker = Worker(stack.endpoints, stack.api_key, concurrency=3)
    exited: list[str] = []

    def handle(intent: Intent) -> None:
        if not exited:
            exited.append(intent.id)
            raise SystemExit(3)

    worker.add_handler(k, handle)
    with Running(worker):
        wait_for("3 acks", lambda: worker.stats.acked == 3, timeout=20)
    assert worker.stats.failed == 1
    assert all(state(outbox, i) == "DELIVERED" for i in ids)
    assert list_intents(outbox, k)[exited[0]].attempts == 2


def test_a_claim_answer_held_past_its_lease_is_not_run_beside_a_rescue(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("held")
    runs: list[str] = []
    with FaultProxy(stack.endpoints[0], Cuts(0, threshold=1)) as slow:
        late = Worker([slow.addr], stack.api_key, concurrency=1, lease=2, claim_wait=5)
        other = Worker([stack.endpoints[1]], stack.api_key, concurrency=1, lease=2, claim_wait=1)
        for worker in (late, other):
            worker.add_handler(k, lambda intent: runs.append(intent.id))
        claims = Claims(late)
        with Running(late):
            wait_for("a long poll", lambda: claims.sent, timeout=10)
            # Its answer arrives after its 2 s lease, rescued and delivered meanwhile.
            slow.delay = 4.0
            [intent_id] = enqueue(outbox, k, 1)
            wait_state(outbox, intent_id, "LEASED")
            with Running(other):
                wait_state(outbox, intent_id, "DELIVERED")
                # Its lease dropped as lost, or (wrongly) run and settled.
                settled = lambda: late.stats.lease_lost + late.stats.acked + late.stats.settle_errors  # noqa: E731
                wait_for("the late answer handled", settled, timeout=30)
    assert runs == [intent_id], "a late answer's expired lease ran beside the rescue"
    assert late.stats.acked == 0


def test_a_refused_api_key_stops_the_worker_loudly(stack: Stack, kind: Callable[[str], str]) -> None:
    worker = Worker(stack.endpoints, "obx_not-a-key", concurrency=1)
    worker.add_handler(kind("x"), lambda intent: None)
    with pytest.raises(outboxd.OutboxError) as refused:
        asyncio.run(worker.run_async())
    assert refused.value.code.name == "UNAUTHENTICATED"


def test_an_unreachable_endpoint_is_skipped_for_the_next_one(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = kind("failover")
    ids = enqueue(outbox, k, 10)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    # Start on the first endpoint (normally a random one).
    monkeypatch.setattr("outboxd._rpc.random.randrange", lambda n: 0)
    worker = Worker([dead, dead, stack.endpoints[1]], stack.api_key, concurrency=4)
    handled: list[str] = []
    worker.add_handler(k, lambda intent: handled.append(intent.id))
    with Running(worker):
        wait_for("10 acks", lambda: worker.stats.acked == 10, timeout=20)
    assert sorted(handled) == sorted(ids)


def test_an_endpoint_that_never_answers_is_left_for_the_next_one(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = kind("hung")
    ids = enqueue(outbox, k, 10)
    # Accepts connections (the kernel's backlog) and never answers: a frozen replica.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        monkeypatch.setattr("outboxd._rpc.random.randrange", lambda n: 0)
        endpoint = f"127.0.0.1:{hung.getsockname()[1]}"
        worker = Worker([endpoint, stack.endpoints[1]], stack.api_key, concurrency=4, claim_wait=0.5, call_timeout=1.0)
        handled: list[str] = []
        worker.add_handler(k, lambda intent: handled.append(intent.id))
        with Running(worker):
            # Each Claim's tries time out on it until its budget is spent; the next goes on.
            wait_for("10 acks", lambda: worker.stats.acked == 10, timeout=20)
    assert sorted(handled) == sorted(ids)


class Claims:
    """Wraps a worker's `_claim`: each answered Claim as (max_intents asked, leases got)."""

    def __init__(self, worker: Worker) -> None:
        self.answered: list[tuple[int, int]] = []
        self.sent: list[int] = []
        claim = worker._claim

        async def recorded(n: int) -> tuple[Sequence[pb.Lease], float, bool]:
            self.sent.append(n)
            leases, sent, late = await claim(n)
            self.answered.append((n, len(leases)))
            return leases, sent, late

        worker._claim = recorded  # type: ignore[method-assign]


def test_with_a_backlog_and_quick_handlers_every_claim_asks_for_the_whole_batch(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("backlog")
    ids = enqueue(outbox, k, 48)
    # A linger far past the test's deadlines: any Claim sent for fewer than the whole batch
    # was sent without waiting for it.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=8, claim_linger=60, claim_wait=1)
    assert worker.claim_batch == 8
    claims = Claims(worker)
    handled: list[str] = []

    @worker.handler(k)
    def quick(intent: Intent) -> None:
        # 0 to 7 ms: the slots of one batch free one by one (instant handlers on threads
        # often free them all in one loop turn, which would hide a Claim made too early).
        time.sleep(int(intent.payload) % 8 / 1000)
        handled.append(intent.id)

    with Running(worker):
        wait_for("48 acks", lambda: worker.stats.acked == 48, timeout=30)
        # After the last full Claim the next waits for the whole batch too (then finds none).
        wait_for("a Claim after the backlog", lambda: len(claims.answered) > 6, timeout=30)
    assert sorted(handled) == sorted(ids)
    assert claims.answered[:6] == [(8, 8)] * 6, claims.answered
    assert set(claims.sent) == {8}, claims.sent


def test_an_idle_worker_claims_a_single_intent_at_once_and_claims_again_after_a_short_answer(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("idle")
    # The linger would hold a Claim far past every deadline here: none is applied.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=4, claim_linger=60, claim_wait=30)
    claims = Claims(worker)
    started = threading.Event()
    release = threading.Event()

    @worker.handler(k)
    def hold(intent: Intent) -> None:
        started.set()
        assert release.wait(30)

    with Running(worker):
        wait_for("the idle long poll", lambda: claims.sent == [4], timeout=15)
        [intent_id] = enqueue(outbox, k, 1)
        assert started.wait(15), "the single intent was not claimed at once"
        # The answer was short: the next Claim goes out at once, for the 3 slots still free.
        wait_for("the next Claim", lambda: claims.sent == [4, 3], timeout=15)
        assert claims.answered == [(4, 1)]
        release.set()
        wait_for("the Ack", lambda: worker.stats.acked == 1, timeout=15)
    wait_state(outbox, intent_id, "DELIVERED")


async def until(what: str, check: Callable[[], object], timeout: float) -> None:
    """`wait_for` for a test's own event loop: polls without blocking it."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_submitting_block_whose_mark_submitted_answers_after_the_grace_is_never_entered(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    k = kind("late-mark")
    intent_id = outbox.enqueue_direct(k, b"{}").id
    answered = threading.Event()
    held: list[Intent] = []
    outcome: list[str] = []
    real_call = AsyncClient.call

    async def late_mark(self: AsyncClient, name: str, request: Any, response: Any, **kw: Any) -> Any:
        answer = await real_call(self, name, request, response, **kw)
        if name == "MarkSubmitted":
            # The server marked it SUBMITTED; the answer arrives only once the shutdown's
            # grace is over and the drain gave the lease back (RETRY: nothing started).
            answered.set()
            gone = await asyncio.get_running_loop().run_in_executor(None, held[0].wait_lease_lost, 30.0)
            assert gone
        return answer

    monkeypatch.setattr(AsyncClient, "call", late_mark)
    worker = Worker(stack.endpoints, stack.api_key, concurrency=1, lease=120, grace=0.2)

    @worker.handler(k)
    def charge(intent: Intent) -> None:
        held.append(intent)
        try:
            with intent.submitting():
                outcome.append("charged")
        except outboxd.LeaseLost:
            outcome.append("lease lost")

    with Running(worker):
        assert answered.wait(15), "MarkSubmitted was not called"
    wait_for("the handler's end", lambda: outcome, timeout=10)
    assert outcome == ["lease lost"], "the side effect began on an intent given back for a retry"
    assert not held[0].submitted
    assert "shut down" in wait_state(outbox, intent_id, "PENDING", timeout=5).last_error


def cancel_a_worker_mid_run(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], every_task: bool
) -> tuple[str, str, Worker, float, list[asyncio.Task[Any]]]:
    """Runs a worker until one handler hangs and another's Ack is queued, then cancels its
    task (or, with `every_task`, every task of the loop, as asyncio.run did on Ctrl-C before
    Python 3.11: the worker's settle loop and heartbeats too). The two intents' ids, the
    worker, how long it took and the tasks left on the loop after the worker's."""
    quick_kind, stuck_kind = kind("quick"), kind("stuck")
    quick = outbox.enqueue_direct(quick_kind, b"{}").id
    stuck = outbox.enqueue_direct(stuck_kind, b"{}").id
    # The quick one's Ack waits a minute for company, the leases last two: only the drain's
    # calls can settle either before the cancelled task ends.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, lease=120, grace=60, settle_delay=60)
    started = threading.Event()
    worker.add_handler(quick_kind, lambda intent: None)

    @worker.handler(stuck_kind)
    async def hang(intent: Intent) -> None:
        started.set()
        await asyncio.Event().wait()

    async def main() -> list[asyncio.Task[Any]]:
        task = asyncio.create_task(worker.run_async())
        await until("the stuck handler and the quick Ack", lambda: started.is_set() and worker._unsettled == 1, 15)
        for other in asyncio.all_tasks() if every_task else [task]:
            if other is not asyncio.current_task():
                other.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    began = time.monotonic()
    left = asyncio.run(main())
    return quick, stuck, worker, time.monotonic() - began, left


def test_cancelling_run_async_flushes_queued_settles_and_gives_back_running_intents(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    quick, stuck, worker, took, left = cancel_a_worker_mid_run(stack, outbox, kind, every_task=False)
    assert took < 30, "the grace was waited for"
    assert left == [], "tasks left running after the cancelled worker"
    assert state(outbox, quick) == "DELIVERED"
    given_back = outbox.get_intent(stuck).intent
    assert given_back.state == pb.INTENT_STATE_PENDING and "shut down" in given_back.last_error
    assert worker.stats.acked == 1 and worker.stats.failed == 1


def test_cancelling_every_task_of_the_loop_as_asyncio_run_did_before_3_11_still_flushes_and_gives_back(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    quick, stuck, worker, took, _ = cancel_a_worker_mid_run(stack, outbox, kind, every_task=True)
    assert took < 30, "the drain waited out its budget: the settles were lost"
    assert state(outbox, quick) == "DELIVERED"
    assert state(outbox, stuck) == "PENDING"
    assert worker.stats.acked == 1 and worker.stats.failed == 1


def test_a_handler_raising_a_base_exception_of_its_own_is_failed_retry_at_once(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    class Halt(BaseException):
        """As gevent's Timeout or GreenletExit: not an Exception."""

    k = kind("halt")
    ids = enqueue(outbox, k, 2)
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, lease=60)
    raised: list[str] = []

    @worker.handler(k)
    async def handle(intent: Intent) -> None:
        if not raised:
            raised.append(intent.id)
            raise Halt()

    with Running(worker):
        # Before its 60 s lease: given back by a Fail, not by the expiry.
        wait_for("2 acks", lambda: worker.stats.acked == 2, timeout=20)
    assert worker.stats.failed == 1
    assert all(state(outbox, i) == "DELIVERED" for i in ids)
    assert list_intents(outbox, k)[raised[0]].attempts == 2


def test_submitting_again_after_the_lease_was_lost_raises_lease_lost_and_never_starts_the_call(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("resubmit")
    [intent_id] = enqueue(outbox, k, 1)
    worker = Worker(stack.endpoints[:1], stack.api_key, lease=2, concurrency=1)

    async def no_heartbeat() -> None:
        worker._count("heartbeat_failures")  # as if every ExtendLease were lost

    worker._extend_all = no_heartbeat  # type: ignore[method-assign]
    calls: list[str] = []
    refused: list[BaseException] = []

    @worker.handler(k)
    def charge(intent: Intent) -> None:
        with intent.submitting():
            calls.append("charge")
        assert intent.wait_lease_lost(20.0)
        try:
            with intent.submitting():
                calls.append("charge again")
        except LeaseLost as e:
            refused.append(e)
            raise

    with Running(worker):
        wait_for("the second submitting() refused", lambda: refused, timeout=20)
    assert calls == ["charge"]
    wait_state(outbox, intent_id, "NEEDS_RECONCILE")


def test_a_sync_handler_added_while_the_worker_runs_is_run(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    first, later = kind("first"), kind("later")
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2)

    @worker.handler(first)
    async def handle_first(intent: Intent) -> None:
        pass

    with Running(worker):
        worker.add_handler(later, lambda intent: None)
        [intent_id] = enqueue(outbox, later, 1)
        wait_state(outbox, intent_id, "DELIVERED")
    assert worker.stats.failed == 0


def test_a_claim_wait_under_a_tenth_of_a_second_is_refused_not_a_claim_loop() -> None:
    for wait in (0, 0.05, -1, float("nan")):
        with pytest.raises(ValueError, match="claim_wait"):
            Worker("127.0.0.1:1", "key", claim_wait=wait)


def test_an_on_count_callback_that_raises_does_not_stop_the_worker(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("counted")
    enqueue(outbox, k, 3)
    calls: list[str] = []

    def on_count(name: str, n: int) -> None:
        calls.append(name)
        raise RuntimeError("metrics backend down")

    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, on_count=on_count)
    worker.add_handler(k, lambda intent: None)
    with Running(worker):
        wait_for("3 acks", lambda: worker.stats.acked == 3, timeout=15)
    assert worker.stats.claimed == 3
    assert "claimed" in calls and "acked" in calls


class AsyncMailer:
    """A handler object whose `__call__` is `async def`."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def __call__(self, intent: Intent) -> None:
        await asyncio.sleep(0)
        self.sent.append(intent.id)


def test_async_handlers_that_do_not_look_async_are_awaited_before_the_ack(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    by_object, by_decorator = kind("object"), kind("decorated")
    object_id = outbox.enqueue_direct(by_object, b"{}").id
    decorated_id = outbox.enqueue_direct(by_decorator, b"{}").id
    mailer = AsyncMailer()
    decorated: list[str] = []

    def logged(fn: Callable[[Intent], Awaitable[None]]) -> Callable[[Intent], Awaitable[None]]:
        # A plain (sync) decorator around an async def: it returns the coroutine.
        def wrapper(intent: Intent) -> Awaitable[None]:
            return fn(intent)

        return wrapper

    worker = Worker(stack.endpoints, stack.api_key, concurrency=2)
    worker.add_handler(by_object, mailer)

    @worker.handler(by_decorator)
    @logged
    async def send(intent: Intent) -> None:
        await asyncio.sleep(0)
        decorated.append(intent.id)

    with Running(worker):
        wait_for("2 acks", lambda: worker.stats.acked == 2, timeout=15)
    assert mailer.sent == [object_id]
    assert decorated == [decorated_id]


def test_retry_after_takes_seconds_or_a_timedelta_and_is_clamped_to_366_days() -> None:
    assert Retry().after is None
    assert Retry(after=2).after == 2.0
    assert Retry(after=dt.timedelta(minutes=10)).after == 600.0
    assert Retry(after=10**12).after == Retry(after=10**400).after == 366 * 86400.0
    for bad in (float("nan"), float("inf"), -1, dt.timedelta(seconds=-1)):
        with pytest.raises(ValueError):
            Retry(after=bad)
    with pytest.raises(TypeError):
        Retry(after="10")  # type: ignore[arg-type]


def test_failures_that_cannot_be_sent_as_given_do_not_hold_back_their_batch(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    k, own_cancel = kind("awkward"), kind("own-cancel")
    ids = {name: outbox.enqueue_direct(k, name.encode()).id for name in ("mutated", "surrogate", "cancelled", "plain")}
    cancelled_async = outbox.enqueue_direct(own_cancel, b"{}").id
    # The four fail together, their Fails in one call; leases far longer than the test, so
    # only an accepted Fail moves an intent on.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=5, lease=120, settle_delay=0.5)
    together = threading.Barrier(4, timeout=10)

    @worker.handler(k)
    def fail(intent: Intent) -> None:
        together.wait()
        name = intent.payload.decode()
        if name == "mutated":
            retry = Retry("later")
            retry.after = float("inf")  # past Retry's checks: sent without retry_after
            raise retry
        if name == "surrogate":
            raise Permanent("bad \ud800 byte")  # a lone surrogate: not UTF-8
        if name == "cancelled":
            raise asyncio.CancelledError()  # the handler's own, not the worker's
        raise Permanent("bad address")

    @worker.handler(own_cancel)
    async def cancel_itself(intent: Intent) -> None:
        raise asyncio.CancelledError()

    def retried(intent_id: str) -> Callable[[], Optional[pb.Intent]]:
        def check() -> Optional[pb.Intent]:
            i = outbox.get_intent(intent_id).intent
            return i if i.state == pb.INTENT_STATE_PENDING and i.attempts == 1 else None

        return check

    with Running(worker):
        mutated = wait_for("the mutated Retry applied", retried(ids["mutated"]), timeout=15, interval=0.05)
        cancelled = wait_for("the sync CancelledError retried", retried(ids["cancelled"]), timeout=15)
        cancelled_itself = wait_for("the async CancelledError retried", retried(cancelled_async), timeout=15)
        surrogate = wait_state(outbox, ids["surrogate"], "DEAD_LETTERED")
        plain = wait_state(outbox, ids["plain"], "DEAD_LETTERED")
        wait_for("every lease forgotten", lambda: not worker._active, timeout=10)
    assert mutated.last_error == "later"
    assert surrogate.last_error == "bad ? byte"
    assert plain.last_error == "bad address"
    assert cancelled.last_error == cancelled_itself.last_error == "CancelledError"
    assert worker.stats.failed == 5 and worker.stats.settle_errors == 0, worker.stats


def test_a_retry_after_of_a_timedelta_or_past_366_days_is_applied(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("later")
    soon = outbox.enqueue_direct(k, b"soon").id
    far = outbox.enqueue_direct(k, b"far").id
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, lease=120)

    @worker.handler(k)
    def later(intent: Intent) -> None:
        if intent.payload == b"soon":
            raise Retry("in ten minutes", after=dt.timedelta(minutes=10))
        raise Retry("next year", after=10 * 366 * 86400)  # the server takes at most 366 days

    def pending(intent_id: str) -> Callable[[], Optional[pb.Intent]]:
        def check() -> Optional[pb.Intent]:
            i = outbox.get_intent(intent_id).intent
            return i if i.state == pb.INTENT_STATE_PENDING and i.attempts == 1 else None

        return check

    with Running(worker):
        soon_intent = wait_for("the timedelta Retry applied", pending(soon), timeout=15, interval=0.05)
        far_intent = wait_for("the long Retry applied", pending(far), timeout=15, interval=0.05)
    now = time.time()
    assert 500 < soon_intent.available_at.seconds - now <= 600
    assert 365 * 86400 < far_intent.available_at.seconds - now <= 366 * 86400
    assert worker.stats.failed == 2 and worker.stats.settle_errors == 0, worker.stats


def test_a_claim_answered_after_an_outage_longer_than_the_lease_runs_its_fresh_leases(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("outage")
    [intent_id] = enqueue(outbox, k, 1)
    port = free_port()  # nothing listens there until the outage ends
    worker = Worker([f"127.0.0.1:{port}"], stack.api_key, concurrency=1, lease=2, claim_wait=1)
    attempts: list[int] = []
    worker.add_handler(k, lambda intent: attempts.append(intent.attempt))
    with Running(worker):
        began = time.monotonic()
        # The scenario is time itself: the Claim has been retried for longer than a lease.
        wait_for(
            "an outage longer than the lease",
            lambda: time.monotonic() - began > 3 and worker.stats.claim_retries > 0,
            timeout=15,
        )
        with FaultProxy(stack.endpoints[0], Cuts(0, threshold=1), port=port):
            wait_for("the intent acked", lambda: worker.stats.acked == 1, timeout=20)
    assert attempts == [1], "the replay's fresh lease was dropped (attempt burned)"
    assert worker.stats.lease_lost == 0
    assert wait_state(outbox, intent_id, "DELIVERED").attempts == 1


def test_kinds_given_as_one_string_is_refused() -> None:
    with pytest.raises(TypeError, match="not a str"):
        Worker("127.0.0.1:1", "key", kinds="email.send")


def test_an_empty_list_of_kinds_is_refused_not_read_as_every_kind() -> None:
    with pytest.raises(ValueError, match="empty list"):
        Worker("127.0.0.1:1", "key", kinds=[])


def test_an_https_endpoint_is_spoken_to_in_tls_never_in_the_clear() -> None:
    received: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def first_bytes() -> None:
            conn, _ = server.accept()
            with conn:
                received.append(conn.recv(4096))

        listener = threading.Thread(target=first_bytes, daemon=True)
        listener.start()
        with outboxd.Outbox([f"https://127.0.0.1:{port}"], "obx_secret", timeout=2) as outbox:
            with pytest.raises(outboxd.OutboxError):
                outbox.enqueue_direct("k", b"x")
        listener.join(10)
    assert received and received[0][:1] == b"\x16", f"not a TLS handshake: {received!r}"
    assert b"obx_secret" not in received[0]


def _typing_only(worker: Worker) -> None:
    """Never run: mypy --strict checks it (an unneeded `type: ignore` is an error there)."""

    @worker.handler("k")  # type: ignore[type-var]
    def no_intent() -> None: ...


def test_while_4000_acks_are_unanswered_the_worker_claims_nothing_more(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    """Acks slower than the handlers: the worker stops claiming once 4,000 results await
    their settle, instead of piling up leases (each one heartbeated) without bound."""
    import psycopg

    unsettled_max, concurrency = 4000, 100
    k = kind("settle-backlog")
    total = unsettled_max + 3 * concurrency + 500
    enqueue(outbox, k, total)
    # Every Ack of this kind waits in PostgreSQL for an advisory lock the test holds.
    hold = f"hold_acks_{uuid.uuid4().hex[:12]}"
    lock_key = int.from_bytes(os.urandom(7), "big")
    owner = psycopg.connect(stack.cluster.url("app"), autocommit=True)
    holder = psycopg.connect(stack.cluster.url("app"), autocommit=True)
    owner.execute(
        f"""CREATE FUNCTION public.{hold}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM pg_advisory_xact_lock_shared({lock_key});
                RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
            END $$"""
    )
    owner.execute(
        f"""CREATE TRIGGER {hold} BEFORE UPDATE OR DELETE ON outbox.intent FOR EACH ROW
            WHEN (OLD.kind = '{k}' AND OLD.state IN ('leased', 'submitted'))
            EXECUTE FUNCTION public.{hold}()"""
    )
    holder.execute("SELECT pg_advisory_lock(%s)", (lock_key,))

    counts = {"claimed": 0, "acked": 0, "most_unacked_at_a_claim": 0}

    def on_count(name: str, n: int) -> None:
        # On the worker's loop, once per lease as a Claim's leases start: what the worker
        # held when it sent the Claim, less what was answered since, plus fewer than
        # `concurrency` leases of this Claim's.
        if name == "claimed":
            unacked = counts["claimed"] - counts["acked"]
            counts["most_unacked_at_a_claim"] = max(counts["most_unacked_at_a_claim"], unacked)
        if name in ("claimed", "acked"):
            counts[name] += n

    # Heartbeats wait for the lock too: no lease may need one meanwhile.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=concurrency, lease=300, on_count=on_count)
    worker.add_handler(k, lambda intent: None)
    try:
        with Running(worker):
            # Until the worker says it paused, or until a Claim went out past the bound.
            past = unsettled_max + 2 * concurrency
            wait_for(
                "claims paused",
                lambda: worker.stats.claims_paused > 0 or counts["most_unacked_at_a_claim"] >= past,
                timeout=120,
            )
            holder.execute("SELECT pg_advisory_unlock(%s)", (lock_key,))
            wait_for(f"{total} acks", lambda: worker.stats.acked >= total, timeout=120)
    finally:
        holder.close()
        owner.execute(f"DROP TRIGGER IF EXISTS {hold} ON outbox.intent")
        owner.execute(f"DROP FUNCTION IF EXISTS public.{hold}()")
        owner.close()
    assert counts["most_unacked_at_a_claim"] < past, counts
    states = collections.Counter(i.state for i in list_intents(outbox, k).values())
    assert states == {pb.INTENT_STATE_DELIVERED: total}
