// Worker processes stopped by SIGTERM (drain) and killed by SIGKILL (redelivery, reconcile).
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, test } from "node:test";
import { Outbox, Worker } from "../src/index.js";
import { Fixture, waitFor } from "./harness.js";

const SCRIPT = join(dirname(fileURLToPath(import.meta.url)), "fixtures", "worker-process.js");

let fx: Fixture;
let outbox: Outbox;
const children: ChildProcess[] = [];
before(async () => {
  fx = await Fixture.start(1);
  outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
});
after(async () => {
  for (const child of children) if (child.exitCode === null) child.kill("SIGKILL");
  outbox?.close();
  await fx?.stop();
});

interface Child {
  process: ChildProcess;
  events: { event: string; id?: string; stats?: { acked: number; claimed: number } }[];
  exited: Promise<number | null>;
}

function startWorker(env: Record<string, string>): Child {
  const child = spawn(process.execPath, [SCRIPT], {
    env: { ...process.env, OUTBOX_ENDPOINTS: fx.endpoints.join(","), OUTBOX_API_KEY: fx.apiKey, ...env },
    stdio: ["ignore", "pipe", "inherit"],
  });
  children.push(child);
  const events: Child["events"] = [];
  let buffer = "";
  child.stdout?.on("data", (chunk: Buffer) => {
    buffer += chunk.toString();
    const lines = buffer.split("\n");
    buffer = lines.pop() ?? "";
    for (const line of lines) if (line) events.push(JSON.parse(line) as Child["events"][number]);
  });
  const exited = new Promise<number | null>((r) => child.once("exit", (code) => r(code)));
  return { process: child, events, exited };
}

const ids = (child: Child, event: string): string[] => child.events.filter((e) => e.event === event).map((e) => e.id ?? "");

test("SIGTERM: no new claims, running handlers finish, their Acks are flushed, the process exits within the grace", async () => {
  const enqueued = (await outbox.enqueueDirect(Array.from({ length: 12 }, () => ({ kind: "sigterm.drain" })))).map((r) => r.id);
  const child = startWorker({ KIND: "sigterm.drain", MODE: "sleep", SLEEP_MS: "1500", CONCURRENCY: "4", GRACE_MS: "10000" });
  await waitFor("4 handlers running", () => ids(child, "started").length === 4);
  const signalled = Date.now();
  child.process.kill("SIGTERM");
  const code = await child.exited;
  const took = Date.now() - signalled;
  assert.equal(code, 0);
  assert.ok(took < 10_000, `exit took ${took} ms`);
  const started = ids(child, "started");
  assert.equal(started.length, 4, "claimed more than its 4 slots, or after SIGTERM");
  assert.deepEqual(ids(child, "finished").sort(), [...started].sort());
  assert.equal(child.events.at(-1)?.stats?.acked, 4);
  for (const id of enqueued) {
    const intent = await fx.intent(id);
    if (started.includes(id)) assert.equal(intent.state, "DELIVERED");
    else assert.deepEqual([intent.state, intent.attempts], ["PENDING", 0]);
  }
});

test("SIGTERM after the app's own stop(): the grace holds, only a second signal would end it", async () => {
  await outbox.enqueueDirect(Array.from({ length: 2 }, () => ({ kind: "sigterm.own-stop" })));
  const child = startWorker({ KIND: "sigterm.own-stop", MODE: "sleep", SLEEP_MS: "4000", CONCURRENCY: "2", GRACE_MS: "20000", STOP_ON_SIGTERM: "1" });
  await waitFor("2 handlers running", () => ids(child, "started").length === 2);
  child.process.kill("SIGTERM");
  assert.equal(await child.exited, 0);
  assert.equal(ids(child, "finished").length, 2);
  assert.equal(child.events.at(-1)?.stats?.acked, 2, "the grace was cut short");
});

test("SIGKILL: the dead worker's intents are delivered again after their leases expire", async () => {
  const enqueued = (await outbox.enqueueDirect(Array.from({ length: 3 }, () => ({ kind: "sigkill.redeliver" })))).map((r) => r.id);
  const child = startWorker({ KIND: "sigkill.redeliver", MODE: "hang", LEASE_MS: "1000", CONCURRENCY: "3" });
  await waitFor("3 handlers running", () => ids(child, "started").length === 3);
  child.process.kill("SIGKILL");
  await child.exited;
  const delivered: string[] = [];
  const w = new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 1_000 });
  w.handle("sigkill.redeliver", (intent) => {
    delivered.push(intent.id);
  });
  const run = w.run();
  try {
    await waitFor("3 redeliveries", () => w.stats().acked === 3, 20_000);
  } finally {
    await w.stop();
    await run;
  }
  assert.deepEqual(delivered.sort(), [...enqueued].sort());
  for (const id of enqueued) assert.deepEqual(await fx.intent(id).then((i) => [i.state, i.attempts]), ["DELIVERED", 2]);
});

test("submitting() then a crash: the intent goes to NEEDS_RECONCILE and is never delivered again", async () => {
  const [result] = await outbox.enqueueDirect({ kind: "payment.crash", json: { cents: 1999 } });
  const id = result?.id ?? "";
  const child = startWorker({ KIND: "payment.crash", MODE: "submit-hang", LEASE_MS: "1000", CONCURRENCY: "1" });
  await waitFor("the external call under way", () => ids(child, "submitted").includes(id));
  child.process.kill("SIGKILL");
  await child.exited;
  await waitFor("NEEDS_RECONCILE", async () => (await fx.intent(id)).state === "NEEDS_RECONCILE");
  // Another worker of the kind gets nothing.
  const reply = await fx.ops.call(
    (c, o) => c.claim({ workerId: "after-crash", kinds: ["payment.crash"], maxIntents: 10 }, o),
    { budgetMs: 5_000, tryTimeoutMs: 5_000 },
  );
  assert.equal(reply.leases.length, 0);
  assert.deepEqual(await fx.intent(id).then((i) => [i.state, i.attempts]), ["NEEDS_RECONCILE", 1]);
});
