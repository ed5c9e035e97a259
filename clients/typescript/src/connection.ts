// Transports to outboxd endpoints, the API key, and retries with endpoint rotation.
import { Code, ConnectError, createClient, type CallOptions, type Client, type Interceptor } from "@connectrpc/connect";
import { Http2SessionManager, createGrpcTransport, type GrpcTransportOptions } from "@connectrpc/connect-node";
import { OutboxService } from "./gen/outbox/v1/outbox_pb.js";
import { OutboxError } from "./errors.js";
import { activeTraceContext, loadTracing } from "./tracing.js";

/** The generated Connect client of `outbox.v1.OutboxService`. */
export type OutboxServiceClient = Client<typeof OutboxService>;

/** How to reach outboxd; shared by `Worker` and `Outbox`. */
export interface ConnectionOptions {
  /**
   * outboxd replicas: `host:port` (plaintext), `http://host:port` or `https://host:port`
   * (TLS; CA and client certificate through `transportOptions.nodeOptions`). Calls go to
   * the first and move to the next when one answers UNAVAILABLE (or the connection breaks),
   * whether or not the failed call is tried again.
   */
  endpoints: readonly string[];
  /** `obx_…` key from `outboxd keys create`, sent as `authorization: Bearer …`. */
  apiKey: string;
  /** Sent as `x-outbox-tenant`: needed by Enqueue when the key has several tenants. */
  tenant?: string;
  /** Connect interceptors, run after the SDK's own (logging, metrics, tests). */
  interceptors?: readonly Interceptor[];
  /**
   * Passed to `createGrpcTransport` of `@connectrpc/connect-node`: `nodeOptions` (TLS CA,
   * client certificate), HTTP/2 pings, message limits.
   */
  transportOptions?: Partial<Omit<GrpcTransportOptions, "baseUrl" | "interceptors" | "sessionManager">>;
}

/** How a logical call is retried. */
export interface RetryPolicy {
  /** Give up retrying after this long (the last error is thrown). */
  budgetMs: number;
  /** Deadline of each try (sent as `grpc-timeout`). */
  tryTimeoutMs: number;
  /** A retry's deadline ends with the budget too, so the budget bounds the whole call (not for long polls). */
  bounded?: boolean;
  /** Cancels the call and its retries. */
  signal?: AbortSignal | undefined;
  /** Which failures are worth another try; default: UNAVAILABLE and DEADLINE_EXCEEDED. */
  retryable?: (error: OutboxError) => boolean;
}

const BACKOFF_BASE_MS = 50;
const BACKOFF_CAP_MS = 2_000;

/** A failure that another try, maybe on another endpoint, may not see. */
export function transient(error: OutboxError): boolean {
  if (error.code === Code.Unavailable || error.code === Code.DeadlineExceeded) return true;
  // A deadlock or serialization failure in PostgreSQL: the call changed nothing.
  if (error.code === Code.Aborted && error.reason === "CONFLICT") return true;
  // A request this side cannot encode (a value its field cannot hold) fails every try.
  if (unencodable(error)) return false;
  // A connection that broke mid-call surfaces as INTERNAL, UNKNOWN, CANCELED or (a TCP
  // reset: ECONNRESET) ABORTED made here, with no status from a server.
  const broken = [Code.Internal, Code.Unknown, Code.Canceled, Code.Aborted];
  return !error.fromServer && broken.includes(error.code);
}

/** Connect's error for a request message that protobuf could not serialize (made here, never sent). */
function unencodable(error: OutboxError): boolean {
  const cause = error.cause;
  return !error.fromServer && cause instanceof ConnectError && cause.rawMessage.startsWith("serialize binary:");
}

/**
 * True when the request never reached a server (the connection was refused, or the name
 * did not resolve), so sending it again cannot act twice, whatever it asks.
 */
export function neverSent(error: OutboxError): boolean {
  if (error.fromServer || error.code !== Code.Unavailable) return false;
  for (let cause: unknown = error.cause; cause instanceof Error; cause = cause.cause) {
    if (failedToConnect(cause)) return true;
  }
  return false;
}

/**
 * A socket that never connected: its connect or lookup failed (for each address, when
 * Node tried several addresses of one name).
 */
function failedToConnect(error: Error): boolean {
  const syscall = (error as { syscall?: unknown }).syscall;
  if (syscall === "connect" || syscall === "getaddrinfo") return true;
  return error instanceof AggregateError && error.errors.length > 0 && error.errors.every((e) => e instanceof Error && failedToConnect(e));
}

/**
 * Failures after which the server cannot have acted: the request never left, or outboxd
 * said nothing was written (`UNAVAILABLE`/`UNAVAILABLE`, `ABORTED`/`CONFLICT`). For calls
 * whose repeat could act twice (an Enqueue of intents without idempotency keys).
 */
export function notApplied(error: OutboxError): boolean {
  if (neverSent(error)) return true;
  if (error.code === Code.Unavailable) return error.reason === "UNAVAILABLE";
  return error.code === Code.Aborted && error.reason === "CONFLICT";
}

export class Connection {
  private readonly clients: OutboxServiceClient[];
  private readonly sessions: Http2SessionManager[] = [];
  private current: number;

  constructor(options: ConnectionOptions) {
    if (options.endpoints.length === 0) throw new TypeError("outboxd: at least one endpoint is needed");
    if (!options.apiKey) throw new TypeError("outboxd: an apiKey is needed (outboxd keys create)");
    const auth: Interceptor = (next) => (request) => {
      request.header.set("authorization", `Bearer ${options.apiKey}`);
      if (options.tenant) request.header.set("x-outbox-tenant", options.tenant);
      return next(request);
    };
    const transport = options.transportOptions ?? {};
    this.clients = options.endpoints.map((endpoint) => {
      const url = baseUrl(endpoint);
      const session = new Http2SessionManager(url, transport, transport.nodeOptions);
      this.sessions.push(session);
      return createClient(
        OutboxService,
        createGrpcTransport({
          ...transport,
          baseUrl: url,
          sessionManager: session,
          interceptors: [auth, ...(options.interceptors ?? [])],
        }),
      );
    });
    // The first endpoint first, the next after a failure: predictable, and a Kubernetes
    // Service name as the one endpoint spreads the load anyway.
    this.current = 0;
  }

  /**
   * Runs `call` until it succeeds, fails with a non-retryable error, or the budget is
   * spent, moving to the next endpoint after each retryable failure. The caller makes
   * the call safe to repeat (the same request_id, lease or idempotency key).
   */
  async call<T>(call: (client: OutboxServiceClient, options: CallOptions) => Promise<T>, policy: RetryPolicy): Promise<T> {
    // The caller's trace context, so that the server's span of the call is a child of it.
    const headers = activeTraceContext(await loadTracing());
    const started = performance.now();
    const retryable = policy.retryable ?? transient;
    for (let attempt = 0; ; attempt++) {
      const index = this.current % this.clients.length;
      const client = this.clients[index];
      if (client === undefined) throw new Error("unreachable: no client");
      const left = policy.budgetMs - (performance.now() - started);
      const wanted = attempt === 0 || policy.bounded !== true ? policy.tryTimeoutMs : Math.min(policy.tryTimeoutMs, left);
      // Whole milliseconds: a fraction makes a grpc-timeout header that servers ignore.
      const timeoutMs = Math.max(1, Math.floor(wanted));
      try {
        return await call(client, { timeoutMs, signal: policy.signal, headers });
      } catch (thrown) {
        const error = OutboxError.from(thrown);
        if (policy.signal?.aborted === true) throw error;
        // The next try, or the next call when this one is not tried again (it may not be
        // safe to), goes to the next endpoint. Only from the one that failed: concurrent
        // failures on one endpoint move once.
        const again = retryable(error);
        if ((again || transient(error)) && this.current === index) this.current = (index + 1) % this.clients.length;
        if (!again) throw error;
        const delay = Math.random() * Math.min(BACKOFF_CAP_MS, BACKOFF_BASE_MS * 2 ** attempt);
        if (performance.now() - started + delay >= policy.budgetMs) throw error;
        await sleep(delay, policy.signal);
      }
    }
  }

  /** Closes the HTTP/2 connections (calls in flight fail). */
  close(): void {
    for (const session of this.sessions) session.abort();
  }
}

function baseUrl(endpoint: string): string {
  if (/^https?:\/\//.test(endpoint)) return endpoint;
  return `http://${endpoint}`;
}

/** Resolves after `ms`, or at once when `signal` aborts. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    if (signal?.aborted === true) {
      resolve();
      return;
    }
    const done = (): void => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}
