// An outboxd producer in Node: a business row and its outbox intent, in one transaction,
// from ANOTHER database of the outbox's PostgreSQL cluster (here `shop`).
//
// The token names the producer's transaction with plain SQL that works from any database
// of the cluster: no outboxd function is needed in `shop`. outboxd's promotion sweep (every
// 100 ms by default) then sees the commit; the outbox's own database can use
// outbox.txn_token() instead, which promotes at once (see ../python/producer.py).
//
// Setup and run, from the repository root, with outboxd serving:
//
//   npm install --prefix examples/node
//   OUTBOX_PRODUCER_DATABASE_URL=postgres://postgres@127.0.0.1:5432/shop \
//   OUTBOX_SERVER=127.0.0.1:50051 node examples/node/producer.js
//
// It places one order that commits and one that rolls back, prints what happened, and ends
// with one JSON line: {"committed": [...], "rolled_back": [...]}.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const pg = require('pg');

// The client is built from the project's proto when the program starts.
const definition = protoLoader.loadSync('outbox/v1/outbox.proto', {
  includeDirs: [path.resolve(__dirname, '../../proto')], // google/protobuf/* are bundled
  keepCase: true, // field names as in the proto: txn_token, idempotency_key
  longs: String,
  enums: String, // states read as 'INTENT_STATE_STAGED'
  defaults: true,
  oneofs: true,
});
const { OutboxService } = grpc.loadPackageDefinition(definition).outbox.v1;

// Names the current transaction (and assigns it an id):
// 'v2.<system id>.<server incarnation>.<xid>'; the incarnation changes when PostgreSQL
// recovers from a crash, which may hand the same xid to another transaction. The
// logical-decoding message makes the transaction write WAL, so its COMMIT is flushed (and
// replicated to a synchronous standby) even when it wrote nothing else.
const TOKEN_SQL = `SELECT 'v2.' || system_identifier || '.' ||
                          (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(),
                                                    (SELECT stats_reset FROM pg_stat_archiver)))
                           * 1000000)::bigint
                          || '.' || pg_current_xact_id() AS token
                   FROM pg_control_system(), pg_logical_emit_message(true, 'outboxd', '')`;

// The API key (scope `produce`, from `outboxd keys create`) goes with every call.
function credentials() {
  const apiKey = process.env.OUTBOX_API_KEY;
  if (!apiKey) throw new Error('set OUTBOX_API_KEY (create one with `outboxd keys create`)');
  const metadata = new grpc.Metadata();
  metadata.set('authorization', `Bearer ${apiKey}`);
  return metadata;
}

function enqueue(outbox, request) {
  return new Promise((resolve, reject) => {
    // A deadline, so a stuck call never holds the transaction open for long.
    const options = { deadline: Date.now() + 10_000 };
    outbox.Enqueue(request, credentials(), options, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

// Inserts an order and enqueues its "order.created" intent, atomically: either both exist
// (COMMIT) or neither does (ROLLBACK).
async function placeOrder(db, outbox, customer, totalCents, { commit = true } = {}) {
  await db.query('BEGIN');
  try {
    const { rows: [order] } = await db.query(
      'INSERT INTO orders (customer, total_cents) VALUES ($1, $2) RETURNING id',
      [customer, totalCents],
    );
    const orderId = Number(order.id);

    // Phase 1: a token naming this still-open transaction. Enqueue must come before
    // COMMIT; a token whose transaction already ended is refused.
    const { rows: [{ token }] } = await db.query(TOKEN_SQL);
    const event = { order_id: orderId, customer, total_cents: totalCents };
    const reply = await enqueue(outbox, {
      txn_token: token,
      intents: [{
        kind: 'order.created',
        payload: Buffer.from(JSON.stringify(event)),
        content_type: 'application/json',
        // Derived from the business fact: retrying this Enqueue (say, after a timeout)
        // returns the same intent instead of a second one.
        idempotency_key: `shop/orders/${orderId}/created`,
      }],
    });
    const intent = reply.results[0]; // STAGED: recorded, but invisible to workers for now

    // Phase 2 is our own COMMIT or ROLLBACK (e.g. a later step failed); outboxd learns the
    // outcome from PostgreSQL. Workers then get the intent at least once, so they must
    // tolerate a repeat.
    await db.query(commit ? 'COMMIT' : 'ROLLBACK');
    return { order_id: orderId, intent_id: intent.id, state: intent.state };
  } catch (err) {
    await db.query('ROLLBACK'); // the staged intent, if any, is discarded with it
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
    if (err.code !== '3D000') throw err; // 3D000: the database does not exist
  }
  const adminUrl = new URL(url);
  const name = decodeURIComponent(adminUrl.pathname.slice(1));
  adminUrl.pathname = '/postgres';
  const admin = new pg.Client({ connectionString: adminUrl.href });
  await admin.connect();
  try {
    await admin.query(`CREATE DATABASE ${admin.escapeIdentifier(name)}`);
  } catch (err) {
    if (err.code !== '42P04') throw err; // 42P04: someone else just created it
  } finally {
    await admin.end();
  }
  return connect(url);
}

async function main() {
  const url = process.env.OUTBOX_PRODUCER_DATABASE_URL;
  if (!url) throw new Error('set OUTBOX_PRODUCER_DATABASE_URL (e.g. postgres://…/shop)');
  // Same variable as the outboxd CLI, which takes a URL: accept both forms.
  const server = (process.env.OUTBOX_SERVER || '127.0.0.1:50051').replace(/^http:\/\//, '');

  const outbox = new OutboxService(server, grpc.credentials.createInsecure());
  const db = await connect(url);
  try {
    await db.query(`CREATE TABLE IF NOT EXISTS orders
                    (id bigserial PRIMARY KEY, customer text NOT NULL, total_cents int NOT NULL)`);

    const committed = await placeOrder(db, outbox, 'grace', 9900);
    console.log(`committed:   order ${committed.order_id}, intent ${committed.intent_id}`
      + ` (${committed.state} at enqueue)`);
    const rolledBack = await placeOrder(db, outbox, 'linus', 250, { commit: false });
    console.log(`rolled back: order ${rolledBack.order_id}, intent ${rolledBack.intent_id}`
      + ` (${rolledBack.state} at enqueue)`);

    console.log(JSON.stringify({ committed: [committed], rolled_back: [rolledBack] }));
  } finally {
    await db.end();
    outbox.close();
  }
}

main().catch((err) => {
  console.error(`producer failed: ${err.stack || err}`);
  process.exitCode = 1;
});
