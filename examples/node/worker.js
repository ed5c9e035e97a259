// An outboxd worker in Node with @outboxd/client: handles the "order.created" intents the
// producer enqueues. The SDK claims only for free slots, long-polls, extends leases while
// handlers run, batches Acks and Fails, and drains on SIGTERM/SIGINT.
//
// Setup as for producer.js (the SDK built, `npm ci --prefix examples/node`), then:
//
//   OUTBOX_SERVER=127.0.0.1:50051 OUTBOX_API_KEY=obx_… node examples/node/worker.js
//
// OUTBOX_WORKER_STOP_AFTER=N stops it (with a drain) after N intents, as CI runs it.
import { Permanent, Worker } from "@outboxd/client";

const apiKey = process.env.OUTBOX_API_KEY;
if (!apiKey) throw new Error("set OUTBOX_API_KEY (create one with `outboxd keys create`)");
const server = (process.env.OUTBOX_SERVER || "127.0.0.1:50051").replace(/^http:\/\//, "");
const stopAfter = Number(process.env.OUTBOX_WORKER_STOP_AFTER || 0);

const worker = new Worker({ endpoints: [server], apiKey, concurrency: 8, workerId: "examples-node-worker" });
let handled = 0;
worker.handle("order.created", async (intent, { signal }) => {
  const event = intent.json();
  // A payload that can never be handled is dead-lettered, not retried for ever.
  if (!Number.isInteger(event.order_id)) throw new Permanent(`no order_id in ${intent.payload}`);
  // The side effect goes here, cancelled if the lease is lost, e.g.:
  //   await fetch(webhookUrl, { method: "POST", body: intent.payload, signal });
  // Returning acknowledges the intent; throwing fails it (RETRY with backoff).
  signal.throwIfAborted();
  console.log(`order ${event.order_id} handled (intent ${intent.id}, attempt ${intent.attempt})`);
  if (stopAfter > 0 && ++handled >= stopAfter) void worker.stop();
});
await worker.run(); // until SIGTERM/SIGINT (or OUTBOX_WORKER_STOP_AFTER), then drains
const stats = worker.stats();
console.log(JSON.stringify({ acked: stats.acked, failed: stats.failed, lease_lost: stats.leaseLost }));
