// npm run bench: how fast a no-op handler drains a backlog through a real outboxd
// (started here, on its own PostgreSQL cluster). Prints intents/s; not a test.
//   BENCH_INTENTS (default 50000), BENCH_CONCURRENCY (256), BENCH_CLAIM_BATCH (256)
import { Outbox, Worker } from "../src/index.js";
import { Fixture, waitFor } from "../test/harness.js";

const total = Number(process.env["BENCH_INTENTS"] ?? 50_000);
const concurrency = Number(process.env["BENCH_CONCURRENCY"] ?? 256);
const claimBatch = Number(process.env["BENCH_CLAIM_BATCH"] ?? 256);

const fx = await Fixture.start(1);
try {
  const outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
  const batch = Array.from({ length: 1000 }, () => ({ kind: "bench.noop", payload: "{}" }));
  for (let done = 0; done < total; ) {
    const n = Math.min(4, Math.ceil((total - done) / 1000));
    await Promise.all(Array.from({ length: n }, (_, i) => outbox.enqueueDirect(batch.slice(0, Math.min(1000, total - done - i * 1000)))));
    done += Math.min(total - done, n * 1000);
  }
  outbox.close();
  const worker = new Worker({
    endpoints: fx.endpoints,
    apiKey: fx.apiKey,
    concurrency,
    claimBatch,
    handleSignals: false,
  });
  worker.handle("bench.noop", () => {});
  const cpu0 = process.cpuUsage();
  const started = performance.now();
  const running = worker.run();
  await waitFor(`${total} acks`, () => worker.stats().acked >= total, 600_000);
  const seconds = (performance.now() - started) / 1000;
  const cpu = process.cpuUsage(cpu0);
  await worker.stop();
  await running;
  const rate = Math.round(total / seconds);
  console.log(
    `bench: ${total} intents drained by a no-op handler in ${seconds.toFixed(2)} s: ${rate} intents/s ` +
      `(concurrency ${concurrency}, claim batch ${claimBatch}; worker CPU ${((cpu.user + cpu.system) / 1e6).toFixed(2)} s)`,
  );
} finally {
  await fx.stop();
}
