// Errors a handler throws to choose the outcome, and errors the SDK raises.
import { Code, ConnectError } from "@connectrpc/connect";

/** Options of the outcome errors. */
export interface OutcomeOptions {
  /**
   * The standard `Error.cause` (the error that led to this one), for your logs. It is not
   * reported: the intent's `last_error` is the outcome error's message.
   */
  cause?: unknown;
}

/**
 * The longest `retry_after` the server accepts by default (`OUTBOX_LIMITS__MAX_DELAY`,
 * 366 days): a longer one would refuse the Fail.
 */
const MAX_RETRY_AFTER_MS = 366 * 86_400_000;

/**
 * Throw from a handler: the side effect did not happen and may be tried again
 * (`Fail` RETRY). `afterMs` overrides the server's exponential backoff. A negative or
 * non-finite `afterMs` is ignored (the server's backoff applies), and one past 366 days
 * (the server's default `OUTBOX_LIMITS__MAX_DELAY`) is cut to 366 days.
 */
export class Retry extends Error {
  override readonly name = "Retry";
  /** The delay asked for, in milliseconds: undefined, or from 0 to 366 days. */
  readonly afterMs: number | undefined;
  constructor(message = "retry requested by the handler", afterMs?: number, options?: OutcomeOptions) {
    super(message, options);
    this.afterMs =
      typeof afterMs === "number" && Number.isFinite(afterMs) && afterMs >= 0 ? Math.min(afterMs, MAX_RETRY_AFTER_MS) : undefined;
  }
}

/** Throw from a handler: the side effect did not happen and never will (dead letter). */
export class Permanent extends Error {
  override readonly name = "Permanent";
  constructor(message = "permanent failure reported by the handler", options?: OutcomeOptions) {
    super(message, options);
  }
}

/**
 * Throw from a handler: the side effect may or may not have happened (`Fail` UNKNOWN,
 * the intent goes to NEEDS_RECONCILE for an operator). Any other error thrown inside or
 * after `ctx.submitting()` is reported this way too.
 */
export class Unknown extends Error {
  override readonly name = "Unknown";
  constructor(message = "outcome unknown", options?: OutcomeOptions) {
    super(message, options);
  }
}

/** Why a handler's `signal` fired: its lease is not held any more. */
export class LeaseLostError extends Error {
  override readonly name = "LeaseLostError";
  readonly intentId: string;
  constructor(intentId: string, message: string) {
    super(message);
    this.intentId = intentId;
  }
}

/** Why a handler's `signal` fired: the worker's shutdown grace ended. */
export class ShutdownError extends Error {
  override readonly name = "ShutdownError";
  constructor(message = "the worker's shutdown grace ended") {
    super(message);
  }
}

/** The status an RPC failed with, and outboxd's stable reason (ErrorInfo) when it sent one. */
export class OutboxError extends Error {
  override readonly name = "OutboxError";
  /** gRPC status code (Connect's `Code`, numerically the gRPC code). */
  readonly code: Code;
  /** outboxd's stable reason, e.g. `LEASE_LOST`, `TXN_ABORTED`; empty when none was sent. */
  readonly reason: string;
  /** False when the status was made on this side (connection lost, local deadline). */
  readonly fromServer: boolean;
  constructor(message: string, code: Code, reason: string, options?: { cause?: unknown; fromServer?: boolean }) {
    super(message, options);
    this.code = code;
    this.reason = reason;
    this.fromServer = options?.fromServer ?? true;
  }

  /** Wraps whatever an RPC threw. */
  static from(error: unknown): OutboxError {
    if (error instanceof OutboxError) return error;
    const connect = ConnectError.from(error);
    return new OutboxError(connect.message, connect.code, reasonOf(connect), {
      cause: error,
      // The server answered with a status of its own (a trailer), not a broken connection.
      fromServer: connect.metadata.has("grpc-status"),
    });
  }
}

/** The reason of a `google.rpc.ErrorInfo` detail (field 1), decoded by hand: it is not in proto/. */
export function reasonOf(error: ConnectError): string {
  for (const detail of error.details) {
    if (!("type" in detail) || detail.type !== "google.rpc.ErrorInfo") continue;
    const bytes = detail.value;
    if (!(bytes instanceof Uint8Array)) continue;
    let i = 0;
    while (i < bytes.length) {
      const [tag, afterTag] = varint(bytes, i);
      i = afterTag;
      const field = tag >>> 3;
      const wire = tag & 7;
      if (wire === 2) {
        const [length, afterLength] = varint(bytes, i);
        if (field === 1) return new TextDecoder().decode(bytes.subarray(afterLength, afterLength + length));
        i = afterLength + length;
      } else if (wire === 0) {
        i = varint(bytes, i)[1];
      } else {
        break;
      }
    }
  }
  return "";
}

function varint(bytes: Uint8Array, start: number): [number, number] {
  let value = 0;
  let shift = 0;
  let i = start;
  while (i < bytes.length) {
    const byte = bytes[i++] ?? 0;
    value += (byte & 0x7f) * 2 ** shift;
    if ((byte & 0x80) === 0) break;
    shift += 7;
  }
  return [value, i];
}

