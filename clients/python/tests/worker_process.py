"""A worker process for the shutdown and crash tests: `python worker_process.py CONFIG_JSON`.

Writes one JSON line per event to the config's `events` file (flushed at once, so a test
can read them while the process runs, or after SIGKILL): started, finished, submitted,
stop (a stop: the signal's, or with `app_stops_when_started` the app's own once that many
handlers started), interrupted (KeyboardInterrupt out of asyncio.run), exit (with
the counters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import signal
import sys
import threading
import time
from typing import Any

import outboxd


def main() -> None:
    # As a terminal's foreground program gets it: a shell starts background jobs with SIGINT
    # ignored, which the children inherit, and asyncio.run then leaves Ctrl-C alone.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = json.loads(sys.argv[1])
    events = open(config["events"], "a", buffering=1)
    lock = threading.Lock()

    def emit(event: str, **fields: Any) -> None:
        with lock:
            events.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
            events.flush()

    worker = outboxd.Worker(
        config["endpoints"],
        config["api_key"],
        concurrency=config["concurrency"],
        lease=config["lease"],
        grace=config["grace"],
    )

    started = 0

    @worker.handler(config["kind"])
    def handle(intent: outboxd.Intent) -> None:
        nonlocal started
        emit("started", id=intent.id, attempt=intent.attempt)
        with lock:
            started += 1
            app_stops = started == config.get("app_stops_when_started")
        if app_stops:
            worker.stop()  # the app's own stop(), before any signal
        if config["mode"] == "submit_and_hang":
            with intent.submitting():
                emit("submitted", id=intent.id)
                threading.Event().wait()  # the external call never returns: SIGKILL comes
        threading.Event().wait(config["work_seconds"])
        emit("finished", id=intent.id)

    stop = worker.stop

    def stop_and_note() -> None:
        emit("stop")
        stop()

    worker.stop = stop_and_note  # type: ignore[method-assign]
    emit("ready", worker_id=worker.worker_id)

    async def run_with_a_task_dump() -> None:
        # SIGUSR1 writes every task's stack to the events (a test that timed out asks).
        def dump() -> None:
            stacks = []
            for task in asyncio.all_tasks():
                out = io.StringIO()
                task.print_stack(file=out)
                stacks.append(out.getvalue())
            emit("tasks", stacks=stacks)

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
        await worker.run_async()

    if config.get("runner") == "asyncio.run":
        # No signal handling of the worker's: Ctrl-C cancels the main task (asyncio.run).
        try:
            asyncio.run(run_with_a_task_dump())
        except KeyboardInterrupt:
            emit("interrupted")
    else:
        worker.run()
    emit("exit", stats=dataclasses.asdict(worker.stats))


if __name__ == "__main__":
    main()
