// An outboxd producer in Node with @outboxd/client: a business row and its outbox intent,
// in one transaction, from ANOTHER database of the outbox's PostgreSQL cluster (`shop`).
//
// The token names the producer's transaction with plain SQL that works from any database
// of the cluster (`token: "plain"`): no outboxd function is needed in `shop`. outboxd's
// promotion sweep (every 100 ms by default) then sees the commit; in the outbox's own
// database the SDK's default takes outbox.txn_token() instead, promoted at once.
//
// Setup and run, from the repository root, with outboxd serving on its embedded cluster at
// a known port (`OUTBOX_EMBEDDED__PORT=5433 cargo run`; a key from `cargo run -q -- keys
// create --name examples --tenant default --scope produce --scope consume`):
//
//   npm ci --prefix clients/typescript && npm run build --prefix clients/typescript
//   npm ci --prefix examples/node
//   OUTBOX_PRODUCER_DATABASE_URL=postgres://postgres@127.0.0.1:5433/shop \
//   OUTBOX_SERVER=127.0.0.1:50051 OUTBOX_API_KEY=obx_… node examples/node/producer.js
//
// It places one order that commits and one that rolls back, prints what happened, and ends
// with one JSON line: {"committed": [...], "rolled_back": [...]}.
import pg from "pg";
import { Outbox } from "@outboxd/client";

// Inserts an order and enqueues its "order.created" intent, atomically: either both exist
// (COMMIT) or neither does (ROLLBACK).
async function placeOrder(db, outbox, customer, totalCents, { commit = true } = {}) {
  await db.query("BEGIN");
  try {
    const { rows: [order] } = await db.query(
      "INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id",
      [customer, totalCents],
    );
    const orderId = Number(order.id);
    // Takes the token in this open transaction (it refuses outside one) and enqueues with
    // it: the intent is STAGED, invisible to workers until COMMIT.
    const [intent] = await outbox.enqueue(db, {
      kind: "order.created",
      json: { order_id: orderId, customer, total_cents: totalCents },
      // Derived from the business fact: a retried Enqueue returns the same intent.
      idempotencyKey: `shop/orders/${orderId}/created`,
    });
    // Phase 2 is our own COMMIT or ROLLBACK; outboxd learns the outcome from PostgreSQL.
    await db.query(commit ? "COMMIT" : "ROLLBACK");
    // The state as the proto spells it, like the Python producer prints it.
    return { order_id: orderId, intent_id: intent.id, state: `INTENT_STATE_${intent.state}` };
  } catch (err) {
    await db.query("ROLLBACK"); // the staged intent, if any, is discarded with it
    throw err;
  }
}

// Connects to the producer's database, creating it first if needed (a demo convenience).
async function connect(url) {
  const db = new pg.Client({ connectionString: url });
  try {
    await db.connect();
    return db;
  } catch (err) {
    if (err.code !== "3D000") throw err; // 3D000: the database does not exist
  }
  const adminUrl = new URL(url);
  const name = decodeURIComponent(adminUrl.pathname.slice(1));
  adminUrl.pathname = "/postgres";
  const admin = new pg.Client({ connectionString: adminUrl.href });
  await admin.connect();
  try {
    await admin.query(`CREATE DATABASE ${admin.escapeIdentifier(name)}`);
  } catch (err) {
    if (err.code !== "42P04") throw err; // 42P04: someone else just created it
  } finally {
    await admin.end();
  }
  return connect(url);
}

const url = process.env.OUTBOX_PRODUCER_DATABASE_URL;
if (!url) throw new Error("set OUTBOX_PRODUCER_DATABASE_URL (e.g. postgres://…/shop)");
const apiKey = process.env.OUTBOX_API_KEY;
if (!apiKey) throw new Error("set OUTBOX_API_KEY (create one with `outboxd keys create`)");
// Same variable as the outboxd CLI, which takes a URL: accept both forms.
const server = (process.env.OUTBOX_SERVER || "127.0.0.1:50051").replace(/^http:\/\//, "");

const outbox = new Outbox({ endpoints: [server], apiKey, token: "plain" });
const db = await connect(url);
try {
  await db.query(`CREATE TABLE IF NOT EXISTS orders
                  (id bigserial PRIMARY KEY, customer text NOT NULL, total_cents int NOT NULL)`);
  const committed = await placeOrder(db, outbox, "grace", 9900);
  console.log(`committed:   order ${committed.order_id}, intent ${committed.intent_id} (${committed.state} at enqueue)`);
  const rolledBack = await placeOrder(db, outbox, "linus", 250, { commit: false });
  console.log(`rolled back: order ${rolledBack.order_id}, intent ${rolledBack.intent_id} (${rolledBack.state} at enqueue)`);
  console.log(JSON.stringify({ committed: [committed], rolled_back: [rolledBack] }));
} finally {
  await db.end();
  outbox.close();
}
