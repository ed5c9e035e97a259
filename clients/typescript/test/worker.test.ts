// The worker against two real outboxd replicas on one PostgreSQL.
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { after, afterEach, before, describe, test } from "node:test";
import { ConnectError, type Interceptor } from "@connectrpc/connect";
import { context, trace } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { Code, LeaseLostError, Outbox, OutboxError, Permanent, Retry, ShutdownError, Worker, type WorkerEvent, type WorkerOptions } from "../src/index.js";
import { create, toBinary } from "@bufbuild/protobuf";
import { FailRequestSchema, FailureSchema } from "../src/gen/outbox/v1/outbox_pb.js";
import { batches, failText } from "../src/worker.js";
import { Fixture, freePort, waitFor } from "./harness.js";
import { LossyProxy } from "./proxy.js";
import pg from "pg";

let fx: Fixture;
let outbox: Outbox;
before(async () => {
  fx = await Fixture.start(2);
  outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
});
after(async () => {
  outbox?.close();
  await fx?.stop();
});

const started: Worker[] = [];
afterEach(async () => {
  // A failed test must not leave its workers claiming.
  await Promise.all(started.splice(0).map((w) => w.stop()));
});

function worker(options: Partial<WorkerOptions> = {}): Worker {
  return track(new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 2_000, ...options }));
}

function track(w: Worker): Worker {
  started.push(w);
  return w;
}

async function enqueue(kind: string, count: number): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < count; i += 500) {
    const batch = Array.from({ length: Math.min(500, count - i) }, (_, j) => ({ kind, json: { n: i + j } }));
    ids.push(...(await outbox.enqueueDirect(batch)).map((r) => r.id));
  }
  return ids;
}

describe("delivery", () => {
  test("two workers of concurrency 8 on two replicas drain 2,000 intents, each delivered exactly once", async () => {
    const ids = await enqueue("drain.exact", 2_000);
    const deliveries = new Map<string, number>();
    const tenants = new Set<string>();
    const workers = fx.endpoints.map((endpoint) => {
      const w = worker({ endpoints: [endpoint], concurrency: 8 });
      w.handle("drain.exact", async (intent) => {
        deliveries.set(intent.id, (deliveries.get(intent.id) ?? 0) + 1);
        tenants.add(intent.tenant);
        await new Promise((r) => setImmediate(r));
      });
      return w;
    });
    const runs = workers.map((w) => w.run());
    await waitFor("2,000 acks", () => workers.reduce((n, w) => n + w.stats().acked, 0) >= 2_000, 120_000);
    await Promise.all(workers.map((w) => w.stop()));
    await Promise.all(runs);
    assert.equal(deliveries.size, 2_000);
    assert.deepEqual([...deliveries.keys()].sort(), [...ids].sort());
    assert.ok([...deliveries.values()].every((n) => n === 1), "an intent was delivered twice");
    assert.deepEqual([...tenants], ["default"], "the key's tenant");
    for (const w of workers) {
      assert.ok(w.stats().acked > 0, `worker ${w.workerId} on its own replica acked nothing`);
      assert.equal(w.stats().leaseLost, 0);
    }
    const sample = await Promise.all(ids.slice(0, 20).map((id) => fx.intent(id)));
    assert.ok(sample.every((i) => i.state === "DELIVERED" && i.attempts === 1), JSON.stringify(sample));
    const counts = await fx.counts();
    assert.equal(counts["PENDING"] ?? 0, 0);
    assert.equal(counts["LEASED"] ?? 0, 0);
  });

  test("a 10 s handler under a 2 s lease is never re-delivered: heartbeats keep it", async () => {
    const invocations: string[] = [];
    let aborted = false;
    let claimSent = 0;
    const spy: Interceptor = (next) => (request) => {
      if (request.method.name === "Claim") claimSent ||= Date.now();
      return next(request);
    };
    const make = (): Worker => {
      const w = worker({ leaseMs: 2_000, heartbeatMs: 900, concurrency: 1, claimWaitMs: 5_000, claimers: 1, interceptors: [spy] });
      w.handle("slow.handler", async (_intent, { signal, workerId }) => {
        invocations.push(workerId);
        await new Promise((r) => setTimeout(r, 10_000));
        aborted = signal.aborted;
      });
      return w;
    };
    const [a, b] = [make(), make()];
    const runs = [a.run(), b.run()];
    // Handed to a long poll that has waited most of a lease: heartbeats count from then.
    await waitFor("a Claim long-polling for 1.9 s", () => claimSent > 0 && Date.now() - claimSent > 1_900);
    const [id] = await enqueue("slow.handler", 1);
    assert.ok(id);
    await waitFor("the Ack", () => a.stats().acked + b.stats().acked === 1, 30_000);
    await Promise.all([a.stop(), b.stop()]);
    await Promise.all(runs);
    assert.equal(invocations.length, 1, `invoked by ${invocations.join(", ")}`);
    assert.equal(aborted, false, "the handler's signal fired");
    const intent = await fx.intent(id);
    assert.equal(intent.state, "DELIVERED");
    assert.equal(intent.attempts, 1);
    assert.equal(a.stats().leaseLost + b.stats().leaseLost, 0);
  });

  test("a worker whose heartbeat is blocked loses the lease: its signal fires and its late Ack is not counted", async () => {
    const blockHeartbeats: Interceptor = (next) => async (request) => {
      if (request.method.name === "ExtendLease") {
        await new Promise((_, reject) =>
          request.signal.addEventListener("abort", () => reject(new ConnectError("blocked", Code.DeadlineExceeded))),
        );
      }
      return next(request);
    };
    let reason: unknown;
    let startedA!: () => void;
    const started = new Promise<void>((r) => (startedA = r));
    let deliveredByB!: () => void;
    const delivered = new Promise<void>((r) => (deliveredByB = r));
    const eventsA: string[] = [];
    const a = worker({
      leaseMs: 2_000,
      concurrency: 1, // busy with the lost lease: it cannot claim the intent again
      interceptors: [blockHeartbeats],
      endpoints: [fx.endpoints[0] ?? ""],
      onEvent: (e) => eventsA.push(JSON.stringify(e)),
    });
    a.handle("blocked.heartbeat", async (_intent, { signal }) => {
      startedA();
      await new Promise<void>((r) => signal.addEventListener("abort", () => r()));
      reason = signal.reason;
      await delivered; // the side effect "finishes" late, after another worker delivered it
    });
    const runA = a.run();
    const [id] = await enqueue("blocked.heartbeat", 1);
    assert.ok(id);
    await started;
    const b = worker({ endpoints: [fx.endpoints[1] ?? ""] });
    b.handle("blocked.heartbeat", () => {
      deliveredByB();
    });
    const runB = b.run();
    await waitFor("B's Ack", () => b.stats().acked === 1, 30_000);
    await waitFor("A's late Ack refused", () => a.stats().leaseLost === 1, 10_000).catch((e: unknown) => {
      throw new Error(`${String(e)}; A's events: ${eventsA.join("\n")}`);
    });
    await Promise.all([a.stop(), b.stop()]);
    await Promise.all([runA, runB]);
    assert.ok(reason instanceof LeaseLostError, `signal reason: ${String(reason)}`);
    assert.equal(a.stats().acked, 0);
    const intent = await fx.intent(id);
    assert.equal(intent.state, "DELIVERED");
    assert.equal(intent.attempts, 2);
    assert.equal(intent.workerId, b.workerId);
  });
});

describe("outcomes", () => {
  test("Retry, Permanent, a plain error, and errors around submitting() map to RETRY, PERMANENT and UNKNOWN", async () => {
    const w = worker({ concurrency: 8 });
    w.handle("outcome.retry", (intent) => {
      if (intent.attempt === 1) throw new Retry("not yet", 50);
    });
    w.handle("outcome.error", (intent) => {
      if (intent.attempt === 1) throw new Error("flaky target");
    });
    w.handle("outcome.permanent", () => {
      throw new Permanent("bad address");
    });
    w.handle("outcome.unknown", async (_intent, ctx) => {
      await ctx.submitting(async () => {
        throw new Error("PSP timed out");
      });
    });
    w.handle("outcome.refused", async (intent, ctx) => {
      if (intent.attempt === 1) {
        await ctx.submitting(async () => {
          throw new Retry("the PSP refused the call: nothing happened");
        });
      }
    });
    const run = w.run();
    const [retry] = await enqueue("outcome.retry", 1);
    const [error] = await enqueue("outcome.error", 1);
    const [permanent] = await enqueue("outcome.permanent", 1);
    const [unknown] = await enqueue("outcome.unknown", 1);
    const [refused] = await enqueue("outcome.refused", 1);
    const states = async (): Promise<string> =>
      (await Promise.all([retry, error, permanent, unknown, refused].map((id) => fx.intent(id ?? "")))).map((i) => `${i.state}/${i.attempts}`).join(" ");
    await waitFor(
      "every outcome applied",
      async () => (await states()) === "DELIVERED/2 DELIVERED/2 DEAD_LETTERED/1 NEEDS_RECONCILE/1 DELIVERED/2",
      20_000,
    );
    await w.stop();
    await run;
    assert.match((await fx.intent(permanent ?? "")).lastError, /bad address/);
    assert.match((await fx.intent(unknown ?? "")).lastError, /PSP timed out/);
  });

  test("a second submitting() whose MarkSubmitted fails is failed UNKNOWN: the first side effect has run", async () => {
    let marks = 0;
    const failSecond: Interceptor = (next) => async (request) => {
      if (request.method.name === "MarkSubmitted" && ++marks === 2) throw new ConnectError("injected", Code.PermissionDenied);
      return next(request);
    };
    const effects: string[] = [];
    const w = worker({ concurrency: 1, interceptors: [failSecond] });
    w.handle("submit.twice", async (_intent, ctx) => {
      await ctx.submitting(() => effects.push("charge"));
      await ctx.submitting(() => effects.push("receipt"));
    });
    const run = w.run();
    const [id] = await enqueue("submit.twice", 1);
    await waitFor("NEEDS_RECONCILE", async () => (await fx.intent(id ?? "")).state === "NEEDS_RECONCILE", 20_000);
    await w.stop();
    await run;
    assert.deepEqual(effects, ["charge"]);
    assert.match((await fx.intent(id ?? "")).lastError, /MarkSubmitted failed/);
  });

  test("lease times are kept on a monotonic clock: a wall clock stepped a minute ahead loses no lease", async () => {
    const wallClock = Date.now;
    const w = worker({ concurrency: 1, leaseMs: 3_000 });
    let aborted = false;
    w.handle("clock.step", async (_intent, { signal }) => {
      Date.now = () => wallClock() + 60_000;
      try {
        // Past a heartbeat's turn, on the stepped clock.
        await new Promise((r) => setTimeout(r, 1_500));
      } finally {
        Date.now = wallClock;
      }
      aborted = signal.aborted;
    });
    const run = w.run();
    const [id] = await enqueue("clock.step", 1);
    await waitFor("the Ack", () => w.stats().acked === 1, 20_000);
    await w.stop();
    await run;
    assert.equal(aborted, false);
    assert.equal(w.stats().leaseLost, 0);
    assert.deepEqual(await fx.intent(id ?? "").then((i) => [i.state, i.attempts]), ["DELIVERED", 1]);
  });

  test("a stop while the server answers nothing returns 5 s after the grace: the Ack given up", async () => {
    const proxy = await LossyProxy.start(fx.endpoints[0] ?? "");
    try {
      const events: { at: number; event: WorkerEvent }[] = [];
      const w = worker({
        endpoints: [proxy.endpoint],
        concurrency: 1,
        leaseMs: 3_000,
        shutdownGraceMs: 500,
        onEvent: (event) => events.push({ at: performance.now(), event }),
      });
      let release!: () => void;
      const held = new Promise<void>((r) => (release = r));
      w.handle("drain.frozen", () => held);
      const run = w.run();
      await enqueue("drain.frozen", 1);
      await waitFor("the handler running", () => w.stats().running === 1);
      proxy.frozen = true;
      const stopped = performance.now();
      const stopping = w.stop();
      release();
      await stopping;
      await run;
      const resolved = performance.now();
      assert.ok(resolved - stopped < 500 + 5_000 + 2_000, `run() resolved ${resolved - stopped} ms after the stop`);
      assert.ok(events.some(({ event }) => event.type === "settleFailed"), "the Ack was not given up");
    } finally {
      await proxy.stop();
    }
  });

  test("an error with a newline and a tab is failed at once, with spaces in their place", async () => {
    const events: WorkerEvent[] = [];
    // Leases far longer than the wait below: a refused Fail would leave the intents LEASED
    // until they expire, so reaching PENDING proves the Fail itself was accepted.
    const w = worker({ concurrency: 2, leaseMs: 120_000, onEvent: (e) => events.push(e) });
    w.handle("multiline.error", (intent) => {
      // Retried much later: the intents stay PENDING while the test looks.
      if (intent.json<{ n: number }>().n === 1) throw new Retry(`${"\u{1F600}".repeat(5_000)}\n`, 600_000); // over 4,096 code points
      throw new Retry("charge failed:\n\tcard declined\r\n", 600_000);
    });
    const run = w.run();
    const [short, long] = await enqueue("multiline.error", 2);
    const pending = async (id: string) => {
      const intent = await fx.intent(id);
      // PENDING before the claim too: the attempt tells the failed one apart.
      return intent.state === "PENDING" && intent.attempts === 1 ? intent : undefined;
    };
    const failed = await waitFor("the short error's Fail applied", () => pending(short ?? ""), 30_000);
    const failedLong = await waitFor("the long error's Fail applied", () => pending(long ?? ""), 30_000);
    await w.stop();
    await run;
    assert.equal(failed.attempts, 1);
    assert.equal(failed.lastError, "charge failed:  card declined  ");
    assert.equal(failedLong.lastError, "\u{1F600}".repeat(4_096));
    assert.equal(w.stats().failed, 2);
    assert.deepEqual(
      events.filter((e) => e.type === "settleFailed" || e.type === "settleRejected"),
      [],
    );
  });

  test("Retry with NaN, a negative or a huge afterMs, and a thrown Object.create(null), are failed RETRY; the process survives", async () => {
    const rejections: unknown[] = [];
    const onRejection = (reason: unknown): void => {
      rejections.push(reason);
    };
    process.on("unhandledRejection", onRejection);
    try {
      const events: WorkerEvent[] = [];
      // Leases far longer than the wait below: an intent whose Fail was never sent (or was
      // refused) would stay LEASED, so PENDING or a second attempt proves the Fail applied.
      const w = worker({ concurrency: 4, leaseMs: 120_000, onEvent: (e) => events.push(e) });
      w.handle("retry.odd", (intent) => {
        if (intent.attempt > 1) return;
        const n = intent.json<{ n: number }>().n;
        if (n === 0) throw new Retry("not a number", Number.NaN);
        if (n === 1) throw new Retry("negative", -5);
        // eslint-disable-next-line @typescript-eslint/only-throw-error -- a thrown value String() cannot convert
        if (n === 2) throw Object.create(null) as object;
        throw new Retry("a century", 100 * 365 * 86_400_000); // past the server's 366 days
      });
      const run = w.run();
      const ids = await enqueue("retry.odd", 4);
      const states = async (): Promise<string> =>
        (await Promise.all(ids.map((id) => fx.intent(id)))).map((i) => `${i.state}/${i.attempts}`).join(" ");
      await waitFor("every Fail applied", async () => (await states()) === "DELIVERED/2 DELIVERED/2 DELIVERED/2 PENDING/1", 30_000).catch(
        async (e: unknown) => {
          throw new Error(`${String(e)}; states ${await states()}; events ${JSON.stringify(events.map((x) => x.type))}`);
        },
      );
      await w.stop();
      await run;
      assert.equal((await fx.intent(ids[3] ?? "")).lastError, "a century");
      const failed = events.flatMap((e) => (e.type === "failed" ? [[e.outcome, e.error]] : []));
      assert.equal(failed.length, 4, JSON.stringify(failed));
      assert.ok(failed.every(([outcome]) => outcome === "retry"), JSON.stringify(failed));
      assert.deepEqual(
        events.filter((e) => e.type === "settleFailed" || e.type === "settleRejected"),
        [],
      );
    } finally {
      process.off("unhandledRejection", onRejection);
    }
    assert.deepEqual(rejections, []);
  });

  test("Retry ignores a negative or non-finite afterMs and cuts a longer one to 366 days", () => {
    assert.equal(new Retry("x", Number.NaN).afterMs, undefined);
    assert.equal(new Retry("x", Number.POSITIVE_INFINITY).afterMs, undefined);
    assert.equal(new Retry("x", Number.NEGATIVE_INFINITY).afterMs, undefined);
    assert.equal(new Retry("x", -1).afterMs, undefined);
    assert.equal(new Retry("x").afterMs, undefined);
    assert.equal(new Retry("x", 0).afterMs, 0);
    assert.equal(new Retry("x", 1_500).afterMs, 1_500);
    assert.equal(new Retry("x", 1e15).afterMs, 366 * 86_400_000);
  });

  test("failText turns control characters into spaces and cuts on code points", () => {
    assert.equal(failText("line one\nline\ttwo\r\n\x7f\x85end"), "line one line two    end");
    assert.equal(failText("déjà vu \u{1F600}"), "déjà vu \u{1F600}");
    assert.equal(failText("\u{1F600}".repeat(5_000)), "\u{1F600}".repeat(4_096));
    assert.equal(failText(`${"a".repeat(4_095)}\u{1F600}b`), `${"a".repeat(4_095)}\u{1F600}`);
  });

  test("fails with long texts are split into calls the server accepts", () => {
    const error = failText("\u{1F600}".repeat(5_000));
    const items = Array.from({ length: 1_000 }, (_, n) => {
      const id = `00000000-0000-4000-8000-${String(n).padStart(12, "0")}`;
      const failure = create(FailureSchema, { lease: { intentId: id, leaseId: id }, error });
      return { live: { intent: { id }, leaseId: id }, failure };
    }) as unknown as Parameters<typeof batches>[0];
    const calls = batches(items, 1_000);
    assert.ok(calls.length > 1);
    assert.equal(calls.reduce((n, call) => n + call.length, 0), 1_000);
    for (const call of calls) {
      const failures = call.map((item) => item.failure).filter((f) => f !== undefined);
      assert.ok(toBinary(FailRequestSchema, create(FailRequestSchema, { failures })).length <= 4 * 1024 * 1024);
    }
  });

  test("an intent of a kind the worker claims but has no handler for is dead-lettered with a clear error", async () => {
    const w = worker({ kinds: ["orphan.kind", "adopted.kind"] });
    w.handle("adopted.kind", () => {});
    const run = w.run();
    const [id] = await enqueue("orphan.kind", 1);
    await waitFor("dead letter", async () => (await fx.intent(id ?? "")).state === "DEAD_LETTERED");
    await w.stop();
    await run;
    assert.match((await fx.intent(id ?? "")).lastError, /no handler for kind "orphan.kind"/);
  });

  test("a handler still running when the shutdown grace ends sees its signal fire; its lease is given back", async () => {
    const reasons: unknown[] = [];
    const w = worker({ shutdownGraceMs: 300, concurrency: 2 });
    w.handle("grace.end", async (intent, { signal }) => {
      if (intent.json<{ n: number }>().n === 0) {
        await new Promise<void>((r) => signal.addEventListener("abort", () => r()));
        reasons.push(signal.reason);
        signal.throwIfAborted();
      }
      await new Promise(() => {}); // ignores the signal: run() must resolve anyway
    });
    const run = w.run();
    const ids = await enqueue("grace.end", 2);
    await waitFor("two handlers running", () => w.stats().running === 2);
    const stopped = Date.now();
    await w.stop();
    await run;
    assert.ok(Date.now() - stopped < 5_000);
    assert.equal(reasons.length, 1);
    assert.ok(reasons[0] instanceof ShutdownError);
    for (const id of ids) {
      const intent = await fx.intent(id);
      assert.equal(intent.state, "PENDING", JSON.stringify(intent));
      assert.match(intent.lastError, /shut down before the handler finished/);
    }
  });
});

describe("lease loss", () => {
  test("MarkSubmitted refused LEASE_LOST fires the signal with a LeaseLostError; the external call does not run", async () => {
    // MarkSubmitted sent with a lease id the server never issued: refused LEASE_LOST.
    const forge: Interceptor = (next) => (request) => {
      if (request.method.name === "MarkSubmitted") {
        for (const lease of (request.message as unknown as { leases: { leaseId: string }[] }).leases) lease.leaseId = randomUUID();
      }
      return next(request);
    };
    let seen: { thrown: unknown; aborted: boolean; reason: unknown } | undefined;
    let called = false;
    const w = worker({ concurrency: 1, interceptors: [forge] });
    w.handle("submit.lost", async (_intent, ctx) => {
      try {
        await ctx.submitting(() => {
          called = true;
        });
      } catch (thrown) {
        seen ??= { thrown, aborted: ctx.signal.aborted, reason: ctx.signal.reason };
        throw thrown;
      }
    });
    const run = w.run();
    await enqueue("submit.lost", 1);
    const result = await waitFor("MarkSubmitted refused", () => seen);
    await w.stop();
    await run;
    assert.equal(called, false);
    assert.ok(result.thrown instanceof LeaseLostError, String(result.thrown));
    assert.equal(result.aborted, true, "the signal did not fire");
    assert.ok(result.reason instanceof LeaseLostError, String(result.reason));
    assert.equal(w.stats().leaseLost, 1);
    assert.equal(w.stats().acked + w.stats().failed, 0);
  });

  test("when the grace ends, a lease already lost is not failed again; the others are given back", async () => {
    let target = "";
    const failedIds: string[] = [];
    const interceptor: Interceptor = (next) => (request) => {
      // The heartbeat of `target` names a lease the server never issued: refused.
      if (request.method.name === "ExtendLease") {
        for (const lease of (request.message as unknown as { leases: { intentId: string; leaseId: string }[] }).leases) {
          if (lease.intentId === target) lease.leaseId = randomUUID();
        }
      }
      if (request.method.name === "Fail") {
        for (const f of (request.message as unknown as { failures: { lease?: { intentId: string } }[] }).failures) {
          failedIds.push(f.lease?.intentId ?? "");
        }
      }
      return next(request);
    };
    const w = worker({ concurrency: 2, leaseMs: 2_000, shutdownGraceMs: 200, interceptors: [interceptor] });
    w.handle("grace.lost", () => new Promise(() => {})); // ignores its signal
    const run = w.run();
    const [lost, kept] = await enqueue("grace.lost", 2);
    assert.ok(lost && kept);
    target = lost;
    await waitFor("two handlers running", () => w.stats().running === 2);
    await waitFor("one lease lost to a refused heartbeat", () => w.stats().leaseLost === 1, 10_000);
    await w.stop();
    await run;
    assert.deepEqual(failedIds, [kept], "a Fail named the lost lease");
    assert.equal(w.stats().failed, 1);
    const intent = await fx.intent(kept);
    assert.equal(intent.state, "PENDING", JSON.stringify(intent));
    assert.match(intent.lastError, /shut down before the handler finished/);
  });
});

describe("options", () => {
  const make = (options: Partial<WorkerOptions>): Worker => new Worker({ endpoints: ["127.0.0.1:1"], apiKey: "obx_x", handleSignals: false, ...options });

  test("an empty kinds list is refused: the server would read it as every kind", () => {
    assert.throws(() => make({ kinds: [] }), RangeError);
    assert.doesNotThrow(() => make({ kinds: "all" }));
    assert.doesNotThrow(() => make({ kinds: ["a.kind"] }));
  });

  test("counts must be whole numbers, durations are whole milliseconds, settleDelayMs and shutdownGraceMs not negative", () => {
    const bad: Partial<WorkerOptions>[] = [
      { concurrency: 1.5 },
      { concurrency: 0 },
      { claimBatch: 2.5 },
      { claimers: Number.NaN },
      { settleBatch: 0.5 },
      { settleBatch: 0 },
      { leaseMs: Number.POSITIVE_INFINITY },
      { claimWaitMs: 0.2 },
      { claimWaitMs: 99 }, // an idle worker would claim in a loop
      { claimLingerMs: -1 },
      { settleDelayMs: -1 },
      { settleDelayMs: Number.NaN },
      { shutdownGraceMs: -1 },
      { shutdownGraceMs: Number.POSITIVE_INFINITY },
    ];
    for (const options of bad) assert.throws(() => make(options), RangeError, JSON.stringify(options));
    assert.doesNotThrow(() =>
      make({ leaseMs: 1_500.4, heartbeatMs: 500.5, claimWaitMs: 999.9, settleBatch: 5_000, settleDelayMs: 0, shutdownGraceMs: 0, claimLingerMs: 0 }),
    );
  });

  test("a request this side cannot encode fails at once: it is not retried as transient", async () => {
    let tries = 0;
    await assert.rejects(
      fx.ops.call(
        (client, options) => {
          tries++;
          return client.claim({ workerId: "unencodable", kinds: ["never.enqueued"], maxIntents: 1.5 }, options);
        },
        { budgetMs: 5_000, tryTimeoutMs: 1_000 },
      ),
      (error: unknown) => error instanceof OutboxError && error.code === Code.Internal,
    );
    assert.equal(tries, 1);
  });

  test("a handler may return what ctx.submitting() returns (the value is ignored)", async () => {
    const w = worker();
    // Compiles only if a handler may return a Promise of something other than void.
    w.handle("returns.value", (intent, ctx) => ctx.submitting(() => Promise.resolve({ charged: intent.id })));
    const run = w.run();
    const [id] = await enqueue("returns.value", 1);
    await waitFor("the Ack", () => w.stats().acked === 1);
    await w.stop();
    await run;
    assert.equal((await fx.intent(id ?? "")).state, "DELIVERED");
  });
});

describe("transport", () => {
  test("an unreachable endpoint is skipped: calls move to the next one", async () => {
    const dead = `127.0.0.1:${await freePort()}`;
    const w = worker({ endpoints: [dead, fx.endpoints[0] ?? ""] });
    w.handle("rotate.endpoint", () => {});
    const run = w.run();
    await enqueue("rotate.endpoint", 20);
    await waitFor("20 acks", () => w.stats().acked === 20);
    await w.stop();
    await run;
  });

  test("a Claim refused for good (an unknown API key) stops the worker: run() rejects with it", async () => {
    const events: WorkerEvent[] = [];
    const w = worker({ apiKey: "obx_not_a_key", onEvent: (event) => events.push(event) });
    w.handle("refused.key", () => {});
    await assert.rejects(w.run(), (error: unknown) => error instanceof OutboxError && error.code === Code.Unauthenticated);
    assert.equal(events.filter((e) => e.type === "claimFailed").length, 1, "one Claim, not retried");
  });

  test("the handler runs in a span whose parent is the producer's trace context", async () => {
    const manager = new AsyncLocalStorageContextManager().enable();
    context.setGlobalContextManager(manager);
    try {
      const traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
      const producerSpan = trace.wrapSpanContext({ traceId, spanId: "00f067aa0ba902b7", traceFlags: 1 });
      // Enqueued inside the producer's span: the SDK adds its traceparent to the headers.
      const [result] = await context.with(trace.setSpan(context.active(), producerSpan), () =>
        outbox.enqueueDirect({ kind: "traced.kind", payload: "{}" }),
      );
      let seen: string | undefined;
      let header: string | undefined;
      const w = worker();
      w.handle("traced.kind", (intent) => {
        header = intent.headers["traceparent"];
        seen = trace.getActiveSpan()?.spanContext().traceId;
      });
      const run = w.run();
      await waitFor("the Ack", () => w.stats().acked === 1);
      await w.stop();
      await run;
      assert.ok(result);
      assert.equal(header, `00-${traceId}-00f067aa0ba902b7-01`);
      assert.equal(seen, traceId);
    } finally {
      context.disable();
    }
  });
});

/** Records each Claim's `max_intents` as sent, and (asked, leases got) once answered. */
function claimSpy(): { sent: number[]; answered: [number, number][]; interceptor: Interceptor } {
  const sent: number[] = [];
  const answered: [number, number][] = [];
  const interceptor: Interceptor = (next) => async (request) => {
    if (request.method.name !== "Claim") return next(request);
    const asked = (request.message as unknown as { maxIntents: number }).maxIntents;
    sent.push(asked);
    const response = await next(request);
    if (!response.stream) answered.push([asked, (response.message as unknown as { leases: unknown[] }).leases.length]);
    return response;
  };
  return { sent, answered, interceptor };
}

describe("claim batching", () => {
  test("while 4 × settleBatch results await their Ack the worker claims nothing more", async () => {
    const settleBatch = 50;
    const concurrency = 20;
    const bound = 4 * settleBatch;
    const kind = `backlog.${randomUUID().slice(0, 8)}`;
    const total = bound + 3 * concurrency + 100;
    await enqueue(kind, total);
    // Every Ack of this kind waits in PostgreSQL for an advisory lock the test holds.
    const hold = `hold_acks_${randomUUID().replaceAll("-", "").slice(0, 12)}`;
    const lockKey = Math.floor(Math.random() * 2 ** 40);
    await fx.postgres.sql(
      "outbox",
      `CREATE FUNCTION public.${hold}() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
           PERFORM pg_advisory_xact_lock_shared(${lockKey});
           RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
       END $$`,
    );
    await fx.postgres.sql(
      "outbox",
      `CREATE TRIGGER ${hold} BEFORE UPDATE OR DELETE ON outbox.intent FOR EACH ROW
       WHEN (OLD.kind = '${kind}' AND OLD.state IN ('leased', 'submitted'))
       EXECUTE FUNCTION public.${hold}()`,
    );
    const holder = new pg.Client({ connectionString: fx.postgres.url("outbox") });
    await holder.connect();
    try {
      await holder.query("SELECT pg_advisory_lock($1)", [lockKey]);
      let claimed = 0;
      let acked = 0;
      let mostUnackedAtAClaim = 0;
      const w = worker({
        concurrency,
        settleBatch,
        // Heartbeats wait for the lock too: no lease may need one meanwhile.
        leaseMs: 300_000,
        onEvent: (event) => {
          // As the Claim's answer arrives, before its leases: what the worker held when it
          // sent the Claim, less what was answered since.
          if (event.type === "claimed") {
            mostUnackedAtAClaim = Math.max(mostUnackedAtAClaim, claimed - acked);
            claimed += event.count;
          }
          if (event.type === "acked") acked++;
        },
      });
      w.handle(kind, async () => {});
      const run = w.run();
      // Until the worker says it paused, or until a Claim went out past the bound.
      await waitFor("claims paused", () => w.stats().claimsPaused > 0 || mostUnackedAtAClaim > bound + 2 * concurrency, 60_000);
      await holder.query("SELECT pg_advisory_unlock($1)", [lockKey]);
      await waitFor(`${total} acks`, () => w.stats().acked >= total, 60_000);
      await w.stop();
      await run;
      // Claims in flight when the bound was reached (two claimers) may add their leases.
      assert.ok(mostUnackedAtAClaim <= bound + 2 * concurrency, `a Claim went out while ${mostUnackedAtAClaim} leases awaited their Ack or handler`);
    } finally {
      await holder.end();
      await fx.postgres.sql("outbox", `DROP TRIGGER IF EXISTS ${hold} ON outbox.intent`);
      await fx.postgres.sql("outbox", `DROP FUNCTION IF EXISTS public.${hold}()`);
    }
  });


  test("with a backlog and quick handlers every Claim asks for the whole batch", async () => {
    await enqueue("batch.backlog", 48);
    const spy = claimSpy();
    // A linger far past the test's deadlines: any Claim sent for fewer than the whole batch
    // was sent without waiting for it. Two claimers (the default) must not split the batch.
    const w = worker({ concurrency: 8, claimLingerMs: 60_000, claimWaitMs: 1_000, interceptors: [spy.interceptor] });
    w.handle("batch.backlog", async (intent) => {
      // 0 to 7 ms: the slots of one batch free one by one.
      await new Promise((r) => setTimeout(r, intent.json<{ n: number }>().n % 8));
    });
    const run = w.run();
    await waitFor("48 acks", () => w.stats().acked === 48, 30_000);
    // After the last full Claim the next waits for the whole batch too (then finds none).
    await waitFor("a Claim after the backlog", () => spy.answered.length > 6, 30_000);
    await w.stop();
    await run;
    assert.deepEqual(spy.answered.slice(0, 6), Array.from({ length: 6 }, () => [8, 8]), JSON.stringify(spy.answered));
    assert.deepEqual([...new Set(spy.sent)], [8], JSON.stringify(spy.sent));
  });

  test("an idle worker claims a single intent at once, and after the short answer claims again at once", async () => {
    const spy = claimSpy();
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    let started = false;
    // The linger would hold a Claim far past every deadline here: none is applied.
    const w = worker({ concurrency: 4, claimLingerMs: 60_000, claimWaitMs: 30_000, interceptors: [spy.interceptor] });
    w.handle("batch.idle", async () => {
      started = true;
      await released;
    });
    const run = w.run();
    try {
      await waitFor("the idle long poll", () => spy.sent.length === 1);
      const [id] = await enqueue("batch.idle", 1);
      await waitFor("the single intent claimed", () => started, 15_000);
      // The answer was short: the next Claim goes out at once, for the 3 slots still free.
      await waitFor("the next Claim", () => spy.sent.length === 2, 15_000);
      assert.deepEqual(spy.sent, [4, 3]);
      assert.deepEqual(spy.answered, [[4, 1]]);
      release();
      await waitFor("the Ack", () => w.stats().acked === 1);
      assert.equal((await fx.intent(id ?? "")).state, "DELIVERED");
    } finally {
      release();
      await w.stop();
      await run;
    }
  });
});
