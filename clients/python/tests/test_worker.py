"""The worker against two real outboxd replicas: delivery, heartbeats, outcomes, replays."""

from __future__ import annotations

import asyncio
import collections
import socket
import threading
import time
from typing import Callable, Optional, Sequence

import pytest
from conftest import Running, list_intents, state, wait_state
from harness import Stack, free_port, wait_for
from proxy import Cuts, FaultProxy

import outboxd
from outboxd import Intent, NewIntent, Permanent, Retry, Worker, pb
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
    lock = threading.Lock()
    workers = [Worker([a, b], stack.api_key, concurrency=8), Worker([b, a], stack.api_key, concurrency=8)]

    def handle(intent: Intent) -> None:
        with lock:
            seen[intent.id] += 1

    async def handle_async(intent: Intent) -> None:
        seen[intent.id] += 1  # the loop thread: no lock needed against itself

    workers[0].add_handler(k, handle)
    workers[1].add_handler(k, handle_async)
    with Running(workers[0]), Running(workers[1]):
        wait_for("2000 acks", lambda: sum(w.stats.acked for w in workers) >= 2000, timeout=90)
    assert set(seen) == set(ids)
    assert max(seen.values()) == 1, "an intent was handled twice"
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
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str]
) -> None:
    k = kind("refused")
    bad = outbox.enqueue_direct(k, b"bad").id
    good = outbox.enqueue_direct(k, b"good").id
    # Both handlers run at once (threads) and fail together; their Fails wait for company
    # (settle_delay) and go out in one call. Leases far longer than the wait, so only the
    # Fail itself can finish the good one in time.
    worker = Worker(stack.endpoints, stack.api_key, concurrency=2, lease=120, settle_delay=0.5)
    together = threading.Barrier(2, timeout=10)

    @worker.handler(k)
    def fail(intent: Intent) -> None:
        together.wait()
        if intent.payload == b"bad":
            raise Retry("later", after=400 * 24 * 3600)  # past the server's 366 days: refused
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

        async def recorded(n: int) -> tuple[Sequence[pb.Lease], float]:
            self.sent.append(n)
            leases, sent = await claim(n)
            self.answered.append((n, len(leases)))
            return leases, sent

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
