// The producer: intents enqueued with a token naming the caller's open transaction, so
// they exist if and only if it commits. enqueueDirect is the explicit non-transactional call.
import { create } from "@bufbuild/protobuf";
import { durationFromMs, timestampFromDate } from "@bufbuild/protobuf/wkt";
import { IntentState, NewIntentSchema, type EnqueueResult, type NewIntent } from "./gen/outbox/v1/outbox_pb.js";
import { Connection, notApplied, transient, type ConnectionOptions } from "./connection.js";
import { OutboxError } from "./errors.js";
import { activeTraceContext, loadTracing } from "./tracing.js";

/** One intent to enqueue. */
export interface IntentInput {
  /** Routing key workers filter on, e.g. `email.send`. */
  kind: string;
  /** The body, as bytes or a UTF-8 string. */
  payload?: Uint8Array | string;
  /** A value sent as JSON (sets `contentType` to `application/json` unless given). */
  json?: unknown;
  /** Media type of the payload. */
  contentType?: string;
  /** Region whose workers may claim it; empty: any. */
  region?: string;
  /**
   * Deduplication key (per tenant): repeating it returns the existing intent. Derive it
   * from the business fact (`orders/42/created`); it also makes a lost answer safe to retry.
   */
  idempotencyKey?: string;
  /** Headers carried to the worker. The active OpenTelemetry span's `traceparent` is added. */
  headers?: Record<string, string>;
  /**
   * Intents of one tenant with the same ordering key are delivered one at a time, in the
   * order their transactions committed (within one call, array order); a later one is
   * WAITING until the earlier ones finish. Empty or absent: unordered.
   */
  orderingKey?: string;
  /**
   * From -10 to 10, default 0: among the claimable intents of its tenant and kind, higher
   * priorities are claimed first (equal ones oldest first).
   */
  priority?: number;
  /** Claims allowed before it is dead-lettered; default the server's (5). */
  maxAttempts?: number;
  /** Claimable this long after the call. */
  delayMs?: number;
  /** Claimable from this instant on. */
  availableAt?: Date;
}

/** Where an intent stands after Enqueue. */
export type IntentStateName =
  | "UNSPECIFIED"
  | "STAGED"
  | "PENDING"
  | "LEASED"
  | "SUBMITTED"
  | "DELIVERED"
  | "NEEDS_RECONCILE"
  | "DEAD_LETTERED"
  | "DISCARDED"
  | "WAITING"
  | "CANCELLED";

/** One enqueued intent, in request order. */
export interface Enqueued {
  id: string;
  /**
   * STAGED (two-phase: until the transaction commits), PENDING (direct), WAITING (direct,
   * behind an unfinished intent of its ordering key), or a deduplicated intent's state.
   */
  state: IntentStateName;
  /** The idempotency key matched an intent already recorded. */
  deduplicated: boolean;
}

/** A node-postgres `Client` or `PoolClient` (or anything with the same `query`). */
export interface PgClientLike {
  query(text: string): Promise<{ rows: unknown[] }>;
  /** Recent node-postgres: `I` idle, `T` in a transaction, `E` in a failed one. */
  getTransactionStatus?: () => string | null;
}

/** A Knex transaction (`knex.transaction(async (trx) => …)`) on PostgreSQL. */
export interface KnexTransactionLike {
  readonly isTransaction?: boolean;
  isCompleted(): boolean;
  raw(sql: string): PromiseLike<unknown>;
}

/** The client Prisma's interactive `$transaction(async (tx) => …)` passes (PostgreSQL). */
export interface PrismaTransactionLike {
  $queryRawUnsafe<T = unknown>(query: string): PromiseLike<T>;
  $executeRawUnsafe(query: string): PromiseLike<number>;
}

/** Where the transaction token comes from. */
export type TokenSource =
  /** `outbox.txn_token()` where the caller's database has it (promoted at once), else plain SQL. */
  | "auto"
  /** `SELECT outbox.txn_token()`: the caller's tables are in the outbox's database. */
  | "outbox"
  /** Plain SQL, from any database of the outbox's cluster (promoted by the sweep, ~100 ms). */
  | "plain";

export interface OutboxOptions extends ConnectionOptions {
  /** Deadline of one Enqueue, so a stuck call never holds the transaction open. Default 10 s. */
  callTimeoutMs?: number;
  /** Default `"auto"`. */
  token?: TokenSource;
}

/** Raised when `enqueue` is called outside a transaction (nothing is sent). */
export class NotInTransactionError extends Error {
  override readonly name = "NotInTransactionError";
}

/**
 * The token naming the current transaction, in plain SQL that works from any database of
 * the cluster: `v2.<system id>.<server incarnation>.<xid>`. The logical-decoding message
 * makes the transaction write WAL, so its COMMIT is flushed (and replicated to a
 * synchronous standby) even if it wrote nothing else.
 */
export const PLAIN_TOKEN_SQL = `SELECT 'v2.' || system_identifier || '.' ||
  (extract(epoch FROM least(pg_stat_get_bgwriter_stat_reset_time(),
                            (SELECT stats_reset FROM pg_stat_archiver))) * 1000000)::bigint
  || '.' || pg_current_xact_id() AS token
FROM pg_control_system(), pg_logical_emit_message(true, 'outboxd', '')`;

const PROBE_SQL = `SELECT CASE WHEN to_regproc('outbox.txn_token') IS NOT NULL
  THEN has_function_privilege('outbox.txn_token()', 'EXECUTE') ELSE false END AS outbox_token,
  (${PLAIN_TOKEN_SQL}) AS token`;
const OUTBOX_TOKEN_SQL = "SELECT outbox.txn_token() AS token";

type Query = (sql: string) => Promise<Record<string, unknown> | undefined>;

export class Outbox {
  private readonly connection: Connection;
  private readonly callTimeoutMs: number;
  private readonly tokenSource: TokenSource;
  /** Per database client: does it have outbox.txn_token()? */
  private readonly hasOutboxToken = new WeakMap<object, boolean>();

  constructor(options: OutboxOptions) {
    this.connection = new Connection(options);
    this.callTimeoutMs = options.callTimeoutMs ?? 10_000;
    this.tokenSource = options.token ?? "auto";
  }

  /**
   * Enqueues inside the caller's open node-postgres transaction (`BEGIN` … `COMMIT`): the
   * intents are STAGED now, PENDING when it commits, DISCARDED if it rolls back. Refuses
   * (NotInTransactionError) when the client is not in a transaction.
   */
  async enqueue(client: PgClientLike, intents: IntentInput | readonly IntentInput[]): Promise<Enqueued[]> {
    // null where the client does not track it (pg-native): probed as when it is missing.
    const status = client.getTransactionStatus?.() ?? undefined;
    if (status !== undefined) {
      if (status === "E") throw new NotInTransactionError("outboxd: the transaction has failed; roll it back");
      if (status !== "T") throw new NotInTransactionError("outboxd: enqueue needs an open transaction (BEGIN first); use enqueueDirect otherwise");
    }
    const query: Query = async (sql) => {
      try {
        return (await client.query(sql)).rows[0] as Record<string, unknown> | undefined;
      } catch (error) {
        // The status is updated when the server is ready again, which can lag an error.
        if ((error as { code?: unknown }).code === "25P02") {
          throw new NotInTransactionError("outboxd: the transaction has failed; roll it back", { cause: error });
        }
        throw error;
      }
    };
    if (status === undefined) await this.probeTransaction(query, (sql) => client.query(sql));
    return this.enqueueWithToken(await this.token(client, query), intents);
  }

  /** `enqueue` in a Knex transaction (`await knex.transaction(async (trx) => outbox.enqueueKnex(trx, …))`). */
  async enqueueKnex(trx: KnexTransactionLike, intents: IntentInput | readonly IntentInput[]): Promise<Enqueued[]> {
    if (trx.isTransaction !== true || trx.isCompleted()) {
      throw new NotInTransactionError("outboxd: enqueueKnex needs an open Knex transaction (knex.transaction(trx => …))");
    }
    const query: Query = async (sql) => {
      const result = (await trx.raw(sql)) as { rows?: unknown[] };
      return result.rows?.[0] as Record<string, unknown> | undefined;
    };
    return this.enqueueWithToken(await this.token(trx, query), intents);
  }

  /** `enqueue` in Prisma's interactive transaction (`prisma.$transaction(async (tx) => …)`). */
  async enqueuePrisma(tx: PrismaTransactionLike, intents: IntentInput | readonly IntentInput[]): Promise<Enqueued[]> {
    const query: Query = async (sql) => (await tx.$queryRawUnsafe<Record<string, unknown>[]>(sql))[0];
    await this.probeTransaction(query, (sql) => tx.$executeRawUnsafe(sql));
    return this.enqueueWithToken(await this.token(tx, query), intents);
  }

  /** Enqueues without a transaction: the intents are PENDING at once. */
  enqueueDirect(intents: IntentInput | readonly IntentInput[]): Promise<Enqueued[]> {
    return this.send("", intents);
  }

  /** Enqueues with a token the caller took itself (`SELECT outbox.txn_token()` or `PLAIN_TOKEN_SQL`). */
  async enqueueWithToken(token: string, intents: IntentInput | readonly IntentInput[]): Promise<Enqueued[]> {
    // An empty token would mean direct mode: intents of a transaction that may roll back.
    if (!token) throw new TypeError("outboxd: the transaction token is empty");
    return await this.send(token, intents);
  }

  /** Closes the connections to outboxd. */
  close(): void {
    this.connection.close();
  }

  /** A SAVEPOINT is refused outside a transaction block, harmless inside one. */
  private async probeTransaction(query: Query, execute: (sql: string) => PromiseLike<unknown>): Promise<void> {
    try {
      await execute("SAVEPOINT outboxd_in_transaction");
    } catch (error) {
      throw new NotInTransactionError("outboxd: enqueue needs an open transaction (BEGIN first); use enqueueDirect otherwise", {
        cause: error,
      });
    }
    await query("RELEASE SAVEPOINT outboxd_in_transaction");
  }

  private async token(client: object, query: Query): Promise<string> {
    let source = this.tokenSource;
    if (source === "auto") {
      const known = this.hasOutboxToken.get(client);
      if (known === undefined) {
        const row = await query(PROBE_SQL);
        const has = row?.["outbox_token"] === true;
        this.hasOutboxToken.set(client, has);
        if (!has) return tokenOf(row);
      }
      source = this.hasOutboxToken.get(client) === true ? "outbox" : "plain";
    }
    return tokenOf(await query(source === "outbox" ? OUTBOX_TOKEN_SQL : PLAIN_TOKEN_SQL));
  }

  private async send(token: string, input: IntentInput | readonly IntentInput[]): Promise<Enqueued[]> {
    const list: readonly IntentInput[] = Array.isArray(input) ? input : [input as IntentInput];
    if (list.length === 0) return [];
    const traceparent = await activeTraceparent();
    const intents = list.map((intent) => toWire(intent, traceparent));
    // A lost answer is retried only when every intent has an idempotency key: otherwise
    // the retry could record an intent twice.
    const keyed = intents.every((intent) => intent.idempotencyKey !== "");
    try {
      const reply = await this.connection.call((client, options) => client.enqueue({ txnToken: token, intents }, options), {
        budgetMs: this.callTimeoutMs,
        // A retryable call's first try leaves half its time for the next endpoint.
        tryTimeoutMs: keyed ? this.callTimeoutMs / 2 : this.callTimeoutMs,
        bounded: true,
        retryable: keyed ? transient : notApplied,
      });
      return reply.results.map(enqueued);
    } catch (error) {
      throw OutboxError.from(error);
    }
  }
}

function tokenOf(row: Record<string, unknown> | undefined): string {
  const token = row?.["token"];
  if (typeof token !== "string" || token === "") throw new Error("outboxd: the token query returned nothing");
  return token;
}

function toWire(input: IntentInput, traceparent: string | undefined): NewIntent {
  let payload: Uint8Array;
  let contentType = input.contentType ?? "";
  if (input.json !== undefined) {
    payload = Buffer.from(JSON.stringify(input.json), "utf8");
    contentType ||= "application/json";
  } else if (typeof input.payload === "string") {
    payload = Buffer.from(input.payload, "utf8");
  } else {
    payload = input.payload ?? new Uint8Array();
  }
  const headers: Record<string, string> = { ...input.headers };
  if (traceparent !== undefined && headers["traceparent"] === undefined) headers["traceparent"] = traceparent;
  const intent = create(NewIntentSchema, {
    kind: input.kind,
    payload,
    contentType,
    region: input.region ?? "",
    idempotencyKey: input.idempotencyKey ?? "",
    headers,
    maxAttempts: input.maxAttempts ?? 0,
    orderingKey: input.orderingKey ?? "",
    priority: input.priority ?? 0,
  });
  if (input.delayMs !== undefined) intent.schedule = { case: "delay", value: durationFromMs(input.delayMs) };
  else if (input.availableAt !== undefined) {
    intent.schedule = { case: "availableAt", value: timestampFromDate(input.availableAt) };
  }
  return intent;
}

function enqueued(result: EnqueueResult): Enqueued {
  return { id: result.id, state: stateName(result.state), deduplicated: result.deduplicated };
}

/** `IntentState.PENDING` → `"PENDING"`. */
export function stateName(state: IntentState): IntentStateName {
  // A state newer than this client has no name here.
  return (state in IntentState ? IntentState[state] : "UNSPECIFIED") as IntentStateName;
}

async function activeTraceparent(): Promise<string | undefined> {
  return activeTraceContext(await loadTracing()).traceparent;
}

