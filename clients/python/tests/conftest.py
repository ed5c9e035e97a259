"""Session fixtures: one throwaway PostgreSQL cluster with two outboxd replicas on it.

Tests stay apart by kind: each test gets kinds of its own (`kind` fixture), and workers
claim only their handlers' kinds, so no test sees another's intents.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Stack, wait_for

import outboxd
from outboxd import pb


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    s = Stack().start()
    yield s
    s.stop(keep=bool(os.environ.get("KEEP_WORK")))


@pytest.fixture(scope="session")
def outbox(stack: Stack) -> Iterator[outboxd.Outbox]:
    with outboxd.Outbox(stack.endpoints, stack.api_key) as o:
        yield o


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """`kind("email")` → a kind unique to this test."""
    tag = uuid.uuid4().hex[:8]
    return lambda name: f"t{tag}.{request.node.name[:40]}.{name}"


def list_intents(outbox: outboxd.Outbox, kind: str) -> dict[str, pb.Intent]:
    """Every intent of `kind`, by id (the operator API, paged)."""
    out: dict[str, pb.Intent] = {}
    token = ""
    while True:
        page = outbox._client.call(
            "ListIntents",
            pb.ListIntentsRequest(kind=kind, page_size=1000, page_token=token),
            pb.ListIntentsResponse,
            timeout=10,
            budget=10,
        )
        out.update((i.id, i) for i in page.intents)
        token = page.next_page_token
        if not token:
            return out


def state(outbox: outboxd.Outbox, intent_id: str) -> str:
    return outboxd._intent.state_name(outbox.get_intent(intent_id).intent.state)


def wait_state(outbox: outboxd.Outbox, intent_id: str, want: str, timeout: float = 15) -> pb.Intent:
    def check() -> Optional[pb.Intent]:
        i = outbox.get_intent(intent_id).intent
        return i if outboxd._intent.state_name(i.state) == want else None

    return wait_for(f"{intent_id} {want}", check, timeout, interval=0.05)


class Running:
    """A Worker run on a thread (`run_async` on a loop of its own), stopped on exit."""

    def __init__(self, worker: outboxd.Worker) -> None:
        self.worker = worker
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import asyncio

        try:
            asyncio.run(self.worker.run_async())
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def __enter__(self) -> outboxd.Worker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60) -> None:
        self.worker.stop()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error is not None:
            raise self.error
