// The intent as a handler sees it, converted from the wire type at the edge.
import { timestampDate } from "@bufbuild/protobuf/wkt";
import type { Lease } from "./gen/outbox/v1/outbox_pb.js";

/** One claimed intent, handed to a handler. */
export interface Intent {
  /** Server-assigned id (a time-ordered UUID). */
  readonly id: string;
  /** Routing key, e.g. `email.send`. */
  readonly kind: string;
  /** The producer's bytes, as a Buffer (`payload.toString()` decodes UTF-8). */
  readonly payload: Buffer;
  /** Media type given at enqueue, e.g. `application/json`; empty if none. */
  readonly contentType: string;
  /** The intent's tenant: which of its tenants a key acting for several claimed it for. */
  readonly tenant: string;
  /** Region given at enqueue; empty means any. */
  readonly region: string;
  /** Idempotency key given at enqueue; empty if none. Handy as the target's own key. */
  readonly idempotencyKey: string;
  /** Ordering key given at enqueue; empty if none. */
  readonly orderingKey: string;
  /** Priority given at enqueue, from -10 to 10 (0 by default). */
  readonly priority: number;
  /** Headers given at enqueue (`traceparent` among them when traced). */
  readonly headers: Readonly<Record<string, string>>;
  /** Attempt number of this delivery, starting at 1. */
  readonly attempt: number;
  /** Claims allowed before the intent is dead-lettered. */
  readonly maxAttempts: number;
  /** When the intent was enqueued. */
  readonly createdAt: Date | undefined;
  /** The lease (fencing token) this delivery holds. */
  readonly leaseId: string;
  /** Parses the payload as JSON (the type is the caller's claim, not checked). */
  // eslint-disable-next-line @typescript-eslint/no-unnecessary-type-parameters -- a typed JSON.parse, as Response.json() is used
  json<T = unknown>(): T;
}

export function intentOf(lease: Lease): Intent {
  const wire = lease.intent;
  const bytes = wire?.payload ?? new Uint8Array();
  const payload = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  return {
    id: wire?.id ?? "",
    kind: wire?.kind ?? "",
    payload,
    contentType: wire?.contentType ?? "",
    tenant: wire?.tenant ?? "",
    region: wire?.region ?? "",
    idempotencyKey: wire?.idempotencyKey ?? "",
    orderingKey: wire?.orderingKey ?? "",
    priority: wire?.priority ?? 0,
    headers: wire?.headers ?? {},
    attempt: lease.attempt,
    maxAttempts: wire?.maxAttempts ?? 0,
    createdAt: wire?.createdAt ? timestampDate(wire.createdAt) : undefined,
    leaseId: lease.leaseId,
    // eslint-disable-next-line @typescript-eslint/no-unnecessary-type-parameters -- see Intent.json
    json<T = unknown>(): T {
      return JSON.parse(payload.toString("utf8")) as T;
    },
  };
}
