// A Claim whose answer is lost is retried with the same request_id and gets the same leases.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import type { Interceptor } from "@connectrpc/connect";
import { Outbox, Worker, type WorkerEvent } from "../src/index.js";
import { Fixture, waitFor } from "./harness.js";
import { LossyProxy } from "./proxy.js";

let fx: Fixture;
let proxy: LossyProxy;
before(async () => {
  fx = await Fixture.start(1);
  proxy = await LossyProxy.start(fx.endpoints[0] ?? "");
});
after(async () => {
  await proxy?.stop();
  await fx?.stop();
});

test("a lost Claim answer is replayed with its request_id: the same leases, no lease stranded", async () => {
  const claimsSent: string[] = [];
  const spy: Interceptor = (next) => async (request) => {
    if (request.method.name === "Claim") claimsSent.push((request.message as unknown as { requestId: string }).requestId);
    return next(request);
  };
  const events: WorkerEvent[] = [];
  const delivered = new Map<string, number>();
  const w = new Worker({
    endpoints: [proxy.endpoint],
    apiKey: fx.apiKey,
    handleSignals: false,
    claimers: 1,
    concurrency: 50,
    claimWaitMs: 10_000,
    leaseMs: 30_000,
    interceptors: [spy],
    onEvent: (e) => events.push(e),
  });
  w.handle("replay.claim", (intent) => {
    delivered.set(intent.id, (delivered.get(intent.id) ?? 0) + 1);
  });
  const run = w.run();
  try {
    await waitFor("a Claim long-polling", () => claimsSent.length >= 1);
    // The 20 intents' leases travel back in one answer of a few kB: that one is lost.
    proxy.arm(1_000);
    const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
    const ids = (
      await outbox.enqueueDirect(Array.from({ length: 20 }, (_, i) => ({ kind: "replay.claim", json: { i, pad: "x".repeat(100) } })))
    ).map((r) => r.id);
    outbox.close();
    await waitFor("20 acks", () => w.stats().acked === 20, 20_000);
    assert.equal(proxy.dropped, 1, "no answer was lost");
    assert.ok(w.stats().claimRetries >= 1);
    const replayed = events.filter((e) => e.type === "claimed" && e.replayed);
    assert.ok(replayed.length >= 1, `no replayed claim among ${JSON.stringify(events.map((e) => e.type))}`);
    const retried = claimsSent.filter((id, i) => claimsSent.indexOf(id) !== i);
    assert.ok(retried.length >= 1, "no Claim was sent twice with one request_id");
    assert.deepEqual([...delivered.keys()].sort(), [...ids].sort());
    assert.ok([...delivered.values()].every((n) => n === 1));
    for (const id of ids) {
      // Attempt 1: the replay handed over the first claim's leases, none expired and came back.
      assert.deepEqual(await fx.intent(id).then((i) => [i.state, i.attempts]), ["DELIVERED", 1]);
    }
    assert.equal((await fx.counts())["LEASED"] ?? 0, 0);
  } finally {
    await w.stop();
    await run;
  }
});

test("a Claim retried after a frozen try runs the leases its retry took, renewed, not dropped", async () => {
  // The first try waits on a replica that answers nothing until its deadline, longer than
  // a lease; the retry goes to the next endpoint and leases at once, long after the first send.
  const frozen = await LossyProxy.start(fx.endpoints[0] ?? "");
  frozen.frozen = true;
  const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
  const [id] = (await outbox.enqueueDirect([{ kind: "replay.frozen", json: {} }])).map((r) => r.id);
  outbox.close();
  const events: WorkerEvent[] = [];
  const runs: string[] = [];
  const w = new Worker({
    endpoints: [frozen.endpoint, fx.endpoints[0] ?? ""],
    apiKey: fx.apiKey,
    handleSignals: false,
    claimers: 1,
    claimWaitMs: 500,
    leaseMs: 2_000,
    onEvent: (e) => events.push(e),
  });
  w.handle("replay.frozen", (intent) => {
    runs.push(intent.id);
  });
  const run = w.run();
  try {
    await waitFor("an ack", () => w.stats().acked === 1, 30_000);
    assert.ok(w.stats().claimRetries >= 1);
    assert.equal(w.stats().leaseLost, 0, JSON.stringify(events.filter((e) => e.type === "leaseLost")));
    assert.deepEqual(runs, [id]);
    // Attempt 1: the lease the retry took ran; none expired and came back.
    assert.deepEqual(await fx.intent(id ?? "").then((i) => [i.state, i.attempts]), ["DELIVERED", 1]);
  } finally {
    await w.stop();
    await run;
    await frozen.stop();
  }
});

test("an Ack to a replica that froze while the handler ran goes to the next endpoint within a short lease", async () => {
  const proxied = await LossyProxy.start(fx.endpoints[0] ?? "");
  const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
  const [id] = (await outbox.enqueueDirect([{ kind: "replay.ackfrozen", json: {} }])).map((r) => r.id);
  outbox.close();
  const runs: string[] = [];
  const w = new Worker({
    endpoints: [proxied.endpoint, fx.endpoints[0] ?? ""],
    apiKey: fx.apiKey,
    handleSignals: false,
    claimers: 1,
    claimWaitMs: 500,
    leaseMs: 3_000,
  });
  w.handle("replay.ackfrozen", (intent) => {
    runs.push(intent.id);
    proxied.frozen = true;
  });
  // Started once the first ran: it would take the intent again once its lease expired.
  const other = new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 500 });
  other.handle("replay.ackfrozen", (intent) => {
    runs.push(intent.id);
  });
  const run = w.run();
  await waitFor("the handler run", () => runs.length === 1);
  const otherRun = other.run();
  try {
    await waitFor("an ack", () => w.stats().acked + other.stats().acked >= 1, 30_000);
    await waitFor("delivered", async () => (await fx.intent(id ?? "")).state === "DELIVERED", 30_000);
    assert.equal(w.stats().leaseLost, 0);
    assert.deepEqual(runs, [id]);
    assert.deepEqual(await fx.intent(id ?? "").then((i) => [i.state, i.attempts]), ["DELIVERED", 1]);
  } finally {
    await Promise.all([w.stop(), other.stop()]);
    await Promise.all([run, otherRun]);
    await proxied.stop();
  }
});

test("an Ack whose connection is reset (ECONNRESET) is retried: the side effect runs once", async () => {
  const resetting = await LossyProxy.start(fx.endpoints[0] ?? "");
  resetting.reset = true;
  const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
  const [id] = (await outbox.enqueueDirect([{ kind: "replay.ackreset", json: {} }])).map((r) => r.id);
  outbox.close();
  const runs: string[] = [];
  const events: WorkerEvent[] = [];
  const w = new Worker({
    endpoints: [resetting.endpoint, fx.endpoints[0] ?? ""],
    apiKey: fx.apiKey,
    handleSignals: false,
    claimers: 1,
    claimWaitMs: 10_000,
    leaseMs: 30_000,
    onEvent: (e) => events.push(e),
  });
  w.handle("replay.ackreset", (intent) => {
    runs.push(intent.id);
    // The next answer on this connection (the Ack's) comes back as a reset.
    resetting.arm(1);
  });
  const run = w.run();
  try {
    await waitFor("an ack", () => w.stats().acked >= 1, 20_000);
    assert.equal(resetting.dropped, 1, "no connection was reset");
    assert.deepEqual(
      events.filter((e) => e.type === "settleFailed" || e.type === "claimFailed"),
      [],
    );
    assert.deepEqual(runs, [id]);
    assert.deepEqual(await fx.intent(id ?? "").then((i) => [i.state, i.attempts]), ["DELIVERED", 1]);
  } finally {
    await w.stop();
    await run;
    await resetting.stop();
  }
});

test("a Claim answer held past its lease is not run beside the rescue that took it again", async () => {
  const slow = await LossyProxy.start(fx.endpoints[0] ?? "");
  let claims = 0;
  const spy: Interceptor = (next) => async (request) => {
    if (request.method.name === "Claim") claims++;
    return next(request);
  };
  const runs: string[] = [];
  const options = { apiKey: fx.apiKey, handleSignals: false, claimers: 1, leaseMs: 2_000 };
  const late = new Worker({ ...options, endpoints: [slow.endpoint], claimWaitMs: 5_000, interceptors: [spy] });
  const other = new Worker({ ...options, endpoints: fx.endpoints, claimWaitMs: 500 });
  for (const w of [late, other]) {
    w.handle("replay.held", (intent) => {
      runs.push(intent.id);
    });
  }
  const lateRun = late.run();
  let otherRun: Promise<void> | undefined;
  try {
    await waitFor("a long poll", () => claims >= 1);
    // Its answer arrives after its 2 s lease, rescued and delivered meanwhile.
    slow.delayMs = 4_000;
    const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
    const [id] = (await outbox.enqueueDirect([{ kind: "replay.held", json: {} }])).map((r) => r.id);
    outbox.close();
    await waitFor("leased", async () => (await fx.intent(id ?? "")).state === "LEASED");
    otherRun = other.run();
    await waitFor("delivered", async () => (await fx.intent(id ?? "")).state === "DELIVERED", 30_000);
    // Its lease dropped as lost, or (wrongly) run and settled.
    await waitFor("the late answer handled", () => late.stats().leaseLost + late.stats().acked >= 1, 30_000);
    assert.deepEqual(runs, [id], "a late answer's expired lease ran beside the rescue");
  } finally {
    await Promise.all([late.stop(), other.stop()]);
    await Promise.all([lateRun, otherRun]);
    await slow.stop();
  }
});
