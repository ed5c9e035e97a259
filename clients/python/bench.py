"""Drain throughput of a no-op Python worker against a real outboxd (not a test: a figure).

    OUTBOXD_BIN=target/debug/outboxd python clients/python/bench.py [--intents 20000]
        [--concurrency 512] [--async] [--replicas 1]

Starts a throwaway PostgreSQL cluster and outboxd (tests/harness.py), enqueues the backlog
directly in batches of 1,000, then times one Worker (no-op handler) draining it, and reports
the CPU each party used meanwhile: the worker (this process), outboxd, PostgreSQL.
Use a release build for figures comparable with docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))

from harness import Stack, wait_for

import outboxd

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (and its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICK


def postgres_pids(stack: Stack) -> list[int]:
    postmaster = int((stack.cluster.data / "postmaster.pid").read_text().split()[0])
    pids = [postmaster]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if ppid == postmaster:
                pids.append(int(entry.name))
    return pids


def total(pids: list[int]) -> float:
    out = 0.0
    for pid in pids:
        try:
            out += cpu_seconds(pid)
        except OSError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intents", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--replicas", type=int, default=1, choices=(1, 2))
    parser.add_argument("--async", dest="use_async", action="store_true", help="an async def handler")
    args = parser.parse_args()
    stack = Stack().start()
    try:
        endpoints = stack.endpoints[: args.replicas]
        kind = "bench.noop"
        with outboxd.Outbox(endpoints, stack.api_key) as outbox:
            started = time.monotonic()
            for start in range(0, args.intents, 1000):
                n = min(1000, args.intents - start)
                outbox.enqueue_direct_many([outboxd.NewIntent(kind=kind, payload=b"{}") for _ in range(n)])
            enqueue_s = time.monotonic() - started
        worker = outboxd.Worker(endpoints, stack.api_key, concurrency=args.concurrency, claim_wait=1)
        if args.use_async:

            async def noop_async(intent: outboxd.Intent) -> None:
                return None

            worker.add_handler(kind, noop_async)
        else:
            worker.add_handler(kind, lambda intent: None)

        servers = [s.pid() for s in stack.servers[: args.replicas]]
        pg = postgres_pids(stack)
        cpu0 = (time.process_time(), total(servers), total(pg))

        async def drain() -> float:
            run = asyncio.create_task(worker.run_async())
            t0 = time.monotonic()
            while worker.stats.acked < args.intents:
                if run.done():
                    run.result()
                await asyncio.sleep(0.005)
            took = time.monotonic() - t0
            worker.stop()
            await run
            return took

        took = asyncio.run(drain())
        cpu1 = (time.process_time(), total(servers), total(pg + postgres_pids(stack)[len(pg) :]))
        used = [b - a for a, b in zip(cpu0, cpu1)]
        wait_for("stats", lambda: worker.stats.acked >= args.intents, timeout=5)
        rate = args.intents / took
        handler = "async" if args.use_async else "sync"
        print(f"enqueued {args.intents} in {enqueue_s:.2f}s ({args.intents / enqueue_s:,.0f}/s, batches of 1000)")
        print(
            f"drained {args.intents} intents with a no-op {handler} handler, concurrency {args.concurrency}, "
            f"{args.replicas} replica(s): {took:.2f}s = {rate:,.0f} intents/s"
        )
        print(
            f"CPU seconds during the drain: worker (Python) {used[0]:.2f}, outboxd {used[1]:.2f}, "
            f"PostgreSQL {used[2]:.2f}; server share (outboxd + PostgreSQL) "
            f"{(used[1] + used[2]) / max(sum(used), 1e-9):.0%} of {sum(used):.2f}s on {os.cpu_count()} cores"
        )
        print(f"worker stats: {worker.stats}")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
