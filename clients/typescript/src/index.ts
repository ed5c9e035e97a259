// @outboxd/client: a worker with outboxd's whole lease etiquette, and a producer that
// enqueues inside the caller's PostgreSQL transaction.
export { Worker } from "./worker.js";
export type { Handler, HandlerContext, WorkerEvent, WorkerOptions, WorkerStats } from "./worker.js";
export type { Intent } from "./intent.js";
export { Outbox, NotInTransactionError, PLAIN_TOKEN_SQL, stateName } from "./producer.js";
export type {
  Enqueued,
  IntentInput,
  IntentStateName,
  KnexTransactionLike,
  OutboxOptions,
  PgClientLike,
  PrismaTransactionLike,
  TokenSource,
} from "./producer.js";
export { Retry, Permanent, Unknown, LeaseLostError, ShutdownError, OutboxError } from "./errors.js";
export type { OutcomeOptions } from "./errors.js";
export { Connection } from "./connection.js";
export type { ConnectionOptions, OutboxServiceClient, RetryPolicy } from "./connection.js";
export { Code } from "@connectrpc/connect";
