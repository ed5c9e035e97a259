"""Worker processes stopped by SIGTERM (drain) and killed by SIGKILL (leases expire)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from conftest import Running, list_intents, wait_state
from harness import Stack, wait_for

import outboxd
from outboxd import Intent, NewIntent, Worker, pb

HERE = Path(__file__).resolve().parent


class Proc:
    def __init__(self, stack: Stack, tmp: Path, kind: str, **config: Any) -> None:
        self.events_path = tmp / f"events-{kind}.jsonl"
        cfg = {
            "endpoints": stack.endpoints,
            "api_key": stack.api_key,
            "kind": kind,
            "events": str(self.events_path),
            "concurrency": 4,
            "lease": 2.0,
            "grace": 10.0,
            "mode": "work",
            "work_seconds": 1.5,
            **config,
        }
        self.proc = subprocess.Popen([sys.executable, str(HERE / "worker_process.py"), json.dumps(cfg)])

    def events(self, name: str) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == name]


def test_sigterm_stops_claiming_lets_running_handlers_finish_and_flushes_their_settles(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], tmp_path: Path
) -> None:
    k = kind("term")
    ids = [r.id for r in outbox.enqueue_direct_many([NewIntent(kind=k, payload=b"{}") for _ in range(20)])]
    p = Proc(stack, tmp_path, k, concurrency=4, work_seconds=1.5, grace=10.0)
    wait_for("4 handlers running", lambda: len(p.events("started")) == 4, timeout=20)
    p.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    rc = p.proc.wait(timeout=15)
    exited_in = time.monotonic() - signalled
    assert rc == 0
    assert exited_in < 10.0, f"took {exited_in:.1f}s, grace is 10s"
    started = {e["id"] for e in p.events("started")}
    finished = {e["id"] for e in p.events("finished")}
    stop_at = p.events("stop")[0]["t"]
    assert len(started) == 4 and finished == started, "running handlers finish"
    assert all(e["t"] < stop_at for e in p.events("started")), "nothing new started after SIGTERM"
    stats = p.events("exit")[0]["stats"]
    assert stats["claimed"] == 4 and stats["acked"] == 4
    intents = list_intents(outbox, k)
    states = {i: intents[i].state for i in ids}
    assert all(states[i] == pb.INTENT_STATE_DELIVERED for i in started), "settles flushed before exit"
    assert all(states[i] == pb.INTENT_STATE_PENDING for i in set(ids) - started), "no lease left behind"


def test_sigterm_after_the_apps_own_stop_keeps_the_grace(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], tmp_path: Path
) -> None:
    k = kind("own-stop")
    outbox.enqueue_direct_many([NewIntent(kind=k, payload=b"{}") for _ in range(2)])
    p = Proc(stack, tmp_path, k, concurrency=2, work_seconds=4.0, grace=20.0, app_stops_when_started=2)
    wait_for("the app's stop", lambda: p.events("stop"), timeout=20)
    p.proc.send_signal(signal.SIGTERM)  # a first signal: not a second stop
    assert p.proc.wait(timeout=15) == 0
    assert len(p.events("finished")) == 2, "the grace was cut short"
    assert p.events("exit")[0]["stats"]["acked"] == 2


def test_a_handler_still_running_after_the_grace_is_failed_retry_and_the_process_exits(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], tmp_path: Path
) -> None:
    k = kind("grace")
    [intent_id] = [outbox.enqueue_direct(k, b"{}").id]
    p = Proc(stack, tmp_path, k, concurrency=1, work_seconds=60, grace=1.0, lease=30.0)
    wait_for("the handler running", lambda: p.events("started"), timeout=20)
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(timeout=10) == 0
    assert p.events("finished") == []
    # Given back at once (RETRY), not left to its 30 s lease.
    pending = wait_state(outbox, intent_id, "PENDING", timeout=5)
    assert "shut down" in pending.last_error


def test_ctrl_c_under_asyncio_run_drains_gives_back_running_intents_and_exits(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], tmp_path: Path
) -> None:
    k = kind("ctrl-c")
    [intent_id] = [outbox.enqueue_direct(k, b"{}").id]
    # asyncio.run cancels the main task on SIGINT: the worker drains as after a second stop.
    p = Proc(stack, tmp_path, k, concurrency=1, work_seconds=60, grace=30.0, lease=30.0, runner="asyncio.run")
    wait_for("the handler running", lambda: p.events("started"), timeout=20)
    p.proc.send_signal(signal.SIGINT)
    try:
        assert p.proc.wait(timeout=15) == 0
    except subprocess.TimeoutExpired:
        # Where it waits, for the failure's message.
        p.proc.send_signal(signal.SIGUSR1)
        wait_for("a dump of its tasks", lambda: p.events("tasks"), timeout=10)
        p.proc.kill()
        raise AssertionError(f"no exit after SIGINT; its tasks: {p.events('tasks')}") from None
    assert p.events("interrupted") and p.events("finished") == []
    assert p.events("exit")[0]["stats"]["failed"] == 1
    # Given back before the process ended, not left to its 30 s lease.
    pending = outbox.get_intent(intent_id).intent
    assert pending.state == pb.INTENT_STATE_PENDING and "shut down" in pending.last_error


def test_sigkill_of_a_worker_redelivers_its_intents_after_the_lease_expires(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], tmp_path: Path
) -> None:
    k = kind("kill")
    ids = [r.id for r in outbox.enqueue_direct_many([NewIntent(kind=k, payload=b"{}") for _ in range(3)])]
    p = Proc(stack, tmp_path, k, concurrency=3, work_seconds=60, lease=2.0)
    wait_for("3 handlers running", lambda: len(p.events("started")) == 3, timeout=20)
    p.proc.kill()
    p.proc.wait(timeout=10)
    attempts: dict[str, int] = {}
    heir = Worker(stack.endpoints, stack.api_key, concurrency=3, claim_wait=1)

    @heir.handler(k)
    def handle(intent: Intent) -> None:
        attempts[intent.id] = intent.attempt

    with Running(heir):
        wait_for("3 redeliveries", lambda: heir.stats.acked == 3, timeout=20)
    assert attempts == {i: 2 for i in ids}


def test_a_crash_inside_submitting_goes_to_needs_reconcile_and_is_never_redelivered(
    stack: Stack, outbox: outboxd.Outbox, kind: Callable[[str], str], tmp_path: Path
) -> None:
    k = kind("payment")
    intent_id = outbox.enqueue_direct(k, b'{"cents": 1999}').id
    p = Proc(stack, tmp_path, k, concurrency=1, mode="submit_and_hang", lease=2.0)
    wait_for("MarkSubmitted done", lambda: p.events("submitted"), timeout=20)
    assert wait_state(outbox, intent_id, "SUBMITTED", timeout=5)
    heir = Worker(stack.endpoints, stack.api_key, concurrency=1, claim_wait=1)
    redelivered: list[str] = []
    heir.add_handler(k, lambda intent: redelivered.append(intent.id))
    with Running(heir):
        p.proc.kill()
        p.proc.wait(timeout=10)
        reconcile = wait_state(outbox, intent_id, "NEEDS_RECONCILE", timeout=15)
        # A sentinel enqueued after it: once the heir has it, it has claimed past the parked one.
        sentinel = outbox.enqueue_direct(k, b"{}").id
        wait_for("the sentinel handled", lambda: sentinel in redelivered, timeout=10)
    assert redelivered == [sentinel]
    assert reconcile.attempts == 1
