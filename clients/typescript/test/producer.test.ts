// The producer: intents exist if and only if the caller's transaction commits.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import knexFactory from "knex";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import pg from "pg";
import { NotInTransactionError, Outbox, OutboxError, PLAIN_TOKEN_SQL, Worker, type PrismaTransactionLike } from "../src/index.js";
import { Fixture, waitFor } from "./harness.js";

let fx: Fixture;
let outbox: Outbox;
let pool: pg.Pool; // the outbox's own database: token from outbox.txn_token()
let shop: pg.Pool; // another database of the cluster: the plain-SQL token
before(async () => {
  fx = await Fixture.start(1);
  outbox = new Outbox({ endpoints: fx.endpoints, apiKey: fx.apiKey });
  await fx.postgres.sql("postgres", "CREATE DATABASE shop");
  pool = new pg.Pool({ connectionString: fx.postgres.url("outbox") });
  shop = new pg.Pool({ connectionString: fx.postgres.url("shop") });
  for (const p of [pool, shop]) {
    await p.query("CREATE TABLE orders (id bigserial PRIMARY KEY, customer text NOT NULL)");
  }
});
after(async () => {
  outbox?.close();
  await pool?.end();
  await shop?.end();
  await fx?.stop();
});

async function placeOrder(db: pg.Pool, customer: string, end: "COMMIT" | "ROLLBACK"): Promise<{ orderId: string; intentId: string; state: string }> {
  const client = await db.connect();
  try {
    await client.query("BEGIN");
    const { rows } = await client.query<{ id: string }>("INSERT INTO orders (customer) VALUES ($1) RETURNING id", [customer]);
    const orderId = rows[0]?.id ?? "";
    const [intent] = await outbox.enqueue(client, {
      kind: "order.created",
      json: { orderId, customer },
      idempotencyKey: `orders/${customer}/${orderId}/created`,
    });
    await client.query(end);
    return { orderId, intentId: intent?.id ?? "", state: intent?.state ?? "" };
  } finally {
    client.release();
  }
}

describe("node-postgres", () => {
  test("commit: the intent is STAGED at enqueue, then delivered to a worker", async () => {
    const seen: string[] = [];
    const w = new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 2_000 });
    w.handle("order.created", (intent) => {
      seen.push(intent.id);
    });
    const run = w.run();
    try {
      const order = await placeOrder(pool, "ada", "COMMIT");
      assert.equal(order.state, "STAGED");
      await waitFor("the handler called", () => seen.includes(order.intentId));
      // The Ack follows the handler's return by a settle batch.
      await waitFor("DELIVERED", async () => (await fx.intent(order.intentId)).state === "DELIVERED");
    } finally {
      await w.stop();
      await run;
    }
  });

  test("rollback: the intent ends DISCARDED and is never delivered", async () => {
    const seen: string[] = [];
    const w = new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 1_000 });
    w.handle("order.created", (intent) => {
      seen.push(intent.id);
    });
    const run = w.run();
    try {
      const order = await placeOrder(pool, "linus", "ROLLBACK");
      assert.equal(order.state, "STAGED");
      await waitFor("DISCARDED", async () => (await fx.intent(order.intentId)).state === "DISCARDED");
      // An intent committed after it is delivered: the worker was claiming all along.
      const later = await placeOrder(pool, "grace", "COMMIT");
      await waitFor("the later order delivered", () => seen.includes(later.intentId));
      assert.ok(!seen.includes(order.intentId));
      const { rows } = await pool.query<{ n: number }>("SELECT count(*)::int AS n FROM orders WHERE id = $1", [order.orderId]);
      assert.equal(rows[0]?.n, 0);
    } finally {
      await w.stop();
      await run;
    }
  });

  test("outside a transaction, or in a failed one, enqueue refuses and records nothing", async () => {
    const client = await pool.connect();
    try {
      await assert.rejects(outbox.enqueue(client, { kind: "never.recorded" }), NotInTransactionError);
      await client.query("BEGIN");
      await assert.rejects(client.query("SELECT 1/0"));
      await assert.rejects(outbox.enqueue(client, { kind: "never.recorded" }), NotInTransactionError);
      await client.query("ROLLBACK");
    } finally {
      client.release();
    }
    const reply = await fx.ops.call((c, o) => c.listIntents({ kind: "never.recorded" }, o), { budgetMs: 5_000, tryTimeoutMs: 5_000 });
    assert.equal(reply.intents.length, 0);
  });

  test("from another database of the cluster the plain-SQL token is used: commit → PENDING, rollback → DISCARDED", async () => {
    const committed = await placeOrder(shop, "barbara", "COMMIT");
    const rolledBack = await placeOrder(shop, "edsger", "ROLLBACK");
    await waitFor("both resolved", async () => {
      const [c, r] = await Promise.all([fx.intent(committed.intentId), fx.intent(rolledBack.intentId)]);
      return c.state !== "STAGED" && r.state === "DISCARDED";
    });
    assert.notEqual((await fx.intent(committed.intentId)).state, "DISCARDED");
  });

  // Without a WAL record of its own, a transaction that wrote nothing but its token commits
  // unflushed (and unreplicated): a crash or failover right after its COMMIT loses it.
  test("the plain-SQL token makes a transaction that writes nothing else write WAL", async () => {
    await fx.postgres.sql("shop", "CREATE EXTENSION IF NOT EXISTS pg_walinspect");
    const client = await shop.connect();
    let from = "";
    let xid = "";
    try {
      await client.query("BEGIN");
      from = (await client.query<{ lsn: string }>("SELECT pg_current_wal_insert_lsn()::text AS lsn")).rows[0]?.lsn ?? "";
      await client.query(PLAIN_TOKEN_SQL);
      xid = (await client.query<{ xid: string }>("SELECT (pg_current_xact_id()::text::bigint % 4294967296)::text AS xid")).rows[0]?.xid ?? "";
      await client.query("COMMIT");
    } finally {
      client.release();
    }
    const { rows } = await fx.postgres.sql(
      "shop",
      `SELECT count(*)::int AS n FROM pg_get_wal_records_info($1::pg_lsn, pg_current_wal_flush_lsn())
       WHERE resource_manager = 'LogicalMessage' AND xid::text = $2`,
      [from, xid],
    );
    assert.equal((rows[0] as { n: number }).n, 1, "the token's logical-decoding message, in its transaction");
  });

  test("a repeated idempotency key returns the intent already recorded", async () => {
    const [first] = await outbox.enqueueDirect({ kind: "dedup.kind", payload: "same", idempotencyKey: "dedup/1" });
    const [second] = await outbox.enqueueDirect({ kind: "dedup.kind", payload: "same", idempotencyKey: "dedup/1" });
    assert.equal(first?.state, "PENDING");
    assert.equal(second?.id, first?.id);
    assert.equal(second?.deduplicated, true);
  });

  test("an unkeyed enqueue whose connection was refused is sent to the next endpoint", async () => {
    // 127.0.0.1:1 refuses connections: the request never left, so even without an
    // idempotency key it is sent again, once, to the next endpoint.
    const kind = "failover.kind";
    const failover = new Outbox({ endpoints: ["127.0.0.1:1", ...fx.endpoints], apiKey: fx.apiKey });
    try {
      const [served] = await failover.enqueueDirect({ kind, payload: "x" });
      assert.equal(served?.state, "PENDING");
      const page = await fx.ops.call((c, o) => c.listIntents({ kind, pageSize: 10 }, o), { budgetMs: 10_000, tryTimeoutMs: 10_000 });
      assert.deepEqual(
        page.intents.map((i) => i.id),
        [served?.id],
      );
    } finally {
      failover.close();
    }
  });

  test("intents of one ordering key are claimable one at a time, in request order", async () => {
    const kind = "ordered.kind";
    const [first, second] = await outbox.enqueueDirect([
      { kind, payload: "1", orderingKey: "account/7" },
      { kind, payload: "2", orderingKey: "account/7" },
    ]);
    assert.ok(first && second);
    assert.deepEqual([first.state, second.state], ["PENDING", "WAITING"]);
    const policy = { budgetMs: 10_000, tryTimeoutMs: 10_000 };
    const claim = async (waitMs: number) => {
      const request = { workerId: "ordering-test", kinds: [kind], maxIntents: 10, ...(waitMs ? { wait: durationFromMs(waitMs) } : {}) };
      return (await fx.ops.call((c, o) => c.claim(request, o), policy)).leases;
    };
    // Ten asked, one leased: the second waits behind the first.
    const leases = await claim(0);
    assert.deepEqual(leases.map((l) => l.intent?.id), [first.id]);
    assert.equal(leases[0]?.intent?.orderingKey, "account/7");
    assert.equal((await claim(0)).length, 0);
    const acked = await fx.ops.call((c, o) => c.ack({ leases: [{ intentId: first.id, leaseId: leases[0]?.leaseId ?? "" }] }, o), policy);
    assert.equal(acked.results[0]?.error, undefined);
    // The Ack made the second the key's head, in its own transaction: claimable now.
    assert.deepEqual((await claim(5_000)).map((l) => l.intent?.id), [second.id]);
  });

  test("higher priorities are claimed first, and handlers see the priority", async () => {
    const kind = "prioritized.kind";
    const batch = await outbox.enqueueDirect([
      { kind, payload: "a", priority: 0 },
      { kind, payload: "b", priority: 5 },
      { kind, payload: "c", priority: -3 },
      { kind, payload: "d", priority: 10 },
    ]);
    assert.deepEqual(batch.map((r) => r.state), ["PENDING", "PENDING", "PENDING", "PENDING"]);
    // Enqueued later: behind the batch's intent of the same priority (oldest first).
    const [later] = await outbox.enqueueDirect({ kind, payload: "e", priority: 5 });
    assert.ok(later);
    const stored = await fx.ops.call((c, o) => c.getIntent({ id: later.id }, o), { budgetMs: 5_000, tryTimeoutMs: 5_000 });
    assert.equal(stored.intent?.priority, 5);

    // One slot: one intent claimed at a time, the handler called in claim order.
    const seen: [string, number][] = [];
    const w = new Worker({ endpoints: fx.endpoints, apiKey: fx.apiKey, handleSignals: false, claimWaitMs: 1_000, concurrency: 1 });
    w.handle(kind, (intent) => {
      seen.push([intent.payload.toString(), intent.priority]);
    });
    const run = w.run();
    try {
      await waitFor("five handled", () => seen.length === 5);
    } finally {
      await w.stop();
      await run;
    }
    assert.deepEqual(seen, [["d", 10], ["b", 5], ["e", 5], ["a", 0], ["c", -3]]);

    await assert.rejects(outbox.enqueueDirect({ kind, payload: "f", priority: 11 }), (error: unknown) => {
      assert.ok(error instanceof OutboxError);
      assert.equal(error.reason, "INVALID_ARGUMENT");
      assert.match(error.message, /intents\[0\]\.priority/);
      return true;
    });
  });
});

describe("ORM transactions", () => {
  test("Knex: enqueueKnex inside knex.transaction commits with it; outside one it refuses", async () => {
    const knex = knexFactory({ client: "pg", connection: fx.postgres.url("outbox"), pool: { min: 0, max: 2 } });
    try {
      const [intent] = await knex.transaction(async (trx) => {
        await trx("orders").insert({ customer: "knex" });
        return outbox.enqueueKnex(trx, { kind: "knex.created", payload: "{}" });
      });
      assert.equal(intent?.state, "STAGED");
      await waitFor("PENDING", async () => (await fx.intent(intent?.id ?? "")).state === "PENDING");
      await assert.rejects(
        knex.transaction(async (trx) => {
          const [staged] = await outbox.enqueueKnex(trx, { kind: "knex.created", payload: "{}" });
          throw new Error(`roll back ${staged?.id ?? ""}`);
        }),
        /roll back/,
      );
      const fake = { isTransaction: false, isCompleted: () => false, raw: (sql: string) => knex.raw(sql) };
      await assert.rejects(outbox.enqueueKnex(fake, { kind: "knex.created" }), NotInTransactionError);
    } finally {
      await knex.destroy();
    }
  });

  test("Prisma: enqueuePrisma works through $queryRawUnsafe in a transaction and refuses outside one", async () => {
    const client = await pool.connect();
    // What Prisma's interactive transaction client offers, over node-postgres.
    const tx: PrismaTransactionLike = {
      $queryRawUnsafe: async <T>(sql: string) => (await client.query(sql)).rows as T,
      $executeRawUnsafe: async (sql: string) => (await client.query(sql)).rowCount ?? 0,
    };
    try {
      await assert.rejects(outbox.enqueuePrisma(tx, { kind: "prisma.created" }), NotInTransactionError);
      await client.query("BEGIN");
      const [intent] = await outbox.enqueuePrisma(tx, { kind: "prisma.created", payload: "{}" });
      assert.equal(intent?.state, "STAGED");
      await client.query("COMMIT");
      await waitFor("PENDING", async () => (await fx.intent(intent?.id ?? "")).state === "PENDING");
    } finally {
      client.release();
    }
  });
});

describe("tokens", () => {
  test("enqueueWithToken with an empty token rejects (never throws synchronously) and sends nothing", async () => {
    let pending: Promise<unknown> | undefined;
    assert.doesNotThrow(() => {
      pending = outbox.enqueueWithToken("", { kind: "token.empty" });
    });
    await assert.rejects(pending ?? Promise.resolve(), TypeError);
  });
});
