import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import { Outbox, Worker } from "../src/index.js";
import { Fixture, waitFor } from "./harness.js";

let fx: Fixture;
before(async () => {
  fx = await Fixture.start(1);
});
after(async () => {
  await fx?.stop();
});

test("smoke: a worker drains direct intents", async () => {
  const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
  const ids = (await outbox.enqueueDirect(Array.from({ length: 10 }, (_, i) => ({ kind: "smoke", json: { i } })))).map((r) => r.id);
  const seen: string[] = [];
  const worker = new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 1000 });
  worker.handle("smoke", (intent) => {
    seen.push(intent.id);
  });
  const t0 = Date.now();
  const running = worker.run();
  await waitFor("10 acks", () => worker.stats().acked === 10);
  const t1 = Date.now();
  await worker.stop();
  await running;
  console.log("drain", t1 - t0, "stop", Date.now() - t1);
  assert.deepEqual([...seen].sort(), [...ids].sort());
  outbox.close();
});
