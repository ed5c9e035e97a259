"""A worker process for the shutdown and crash tests: `python worker_process.py CONFIG_JSON`.

Writes one JSON line per event to the config's `events` file (flushed at once, so a test
can read them while the process runs, or after SIGKILL): started, finished, submitted,
stop (the signal arrived), interrupted (KeyboardInterrupt out of asyncio.run), exit (with
the counters).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import time
from typing import Any

import outboxd


def main() -> None:
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

    @worker.handler(config["kind"])
    def handle(intent: outboxd.Intent) -> None:
        emit("started", id=intent.id, attempt=intent.attempt)
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
    if config.get("runner") == "asyncio.run":
        # No signal handling of the worker's: Ctrl-C cancels the main task (asyncio.run).
        try:
            asyncio.run(worker.run_async())
        except KeyboardInterrupt:
            emit("interrupted")
    else:
        worker.run()
    emit("exit", stats=dataclasses.asdict(worker.stats))


if __name__ == "__main__":
    main()
