// The worker: claims for free slots only, long-polls with request_id replay, heartbeats
// every live lease, batches Acks and Fails, and drains on SIGTERM/SIGINT or stop().
import { randomUUID } from "node:crypto";
import { hostname } from "node:os";
import { create } from "@bufbuild/protobuf";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import { Code, type CallOptions } from "@connectrpc/connect";
import {
  FailOutcome,
  FailureSchema,
  LeaseRefSchema,
  type Failure,
  type Lease,
  type LeaseResult,
} from "./gen/outbox/v1/outbox_pb.js";
import { Connection, sleep, transient, type ConnectionOptions, type OutboxServiceClient } from "./connection.js";
import { LeaseLostError, OutboxError, Permanent, Retry, ShutdownError, Unknown } from "./errors.js";
import { intentOf, type Intent } from "./intent.js";
import { loadTracing, traced } from "./tracing.js";

/** What a handler gets besides the intent. */
export interface HandlerContext {
  /**
   * Fires when the lease is lost (a heartbeat was refused, or it expired before one got
   * through: `reason` is a `LeaseLostError`) or when shutdown's grace ends (`ShutdownError`).
   * Pass it to fetch, database drivers, timers.
   */
  readonly signal: AbortSignal;
  /** True once the lease is known lost; whatever the handler reports then is not counted. */
  readonly leaseLost: boolean;
  /** This worker's id (sent with Claim). */
  readonly workerId: string;
  /**
   * Marks the intent SUBMITTED (`MarkSubmitted`), then runs `call`: the non-idempotent
   * external call. From then on an outcome nobody knows (the call throws, the worker dies,
   * the lease expires) sends the intent to NEEDS_RECONCILE, never to a blind retry. Throw
   * `Retry` or `Permanent` from inside when the target said for sure that nothing happened.
   */
  submitting<T>(call: () => Promise<T> | T): Promise<T>;
}

/**
 * Handles one intent: return (Ack), or throw `Retry`, `Permanent`, `Unknown` or any error
 * (RETRY). What it returns (or its promise resolves to) is ignored, so
 * `(intent, ctx) => ctx.submitting(() => psp.charge(…))` is a handler.
 */
export type Handler = (intent: Intent, context: HandlerContext) => unknown;

/** What the worker reports through `onEvent`. */
export type WorkerEvent =
  | { type: "claimed"; count: number; replayed: boolean }
  | { type: "acked"; intent: Intent }
  | { type: "failed"; intent: Intent; outcome: "retry" | "permanent" | "unknown"; error: string }
  | { type: "leaseLost"; intent: Intent; reason: string }
  | { type: "settleRejected"; intent: Intent; call: "ack" | "fail"; code: number; reason: string; message: string }
  | { type: "settleFailed"; intent: Intent; call: "ack" | "fail"; error: OutboxError }
  | { type: "claimFailed"; error: OutboxError }
  | { type: "heartbeatFailed"; error: OutboxError; leases: number }
  | { type: "abandoned"; intent: Intent; outcome: "retry" | "expire" };

/** Counters since the worker was made. */
export interface WorkerStats {
  /** Leases received from Claim. */
  claimed: number;
  /** Acks the server applied. */
  acked: number;
  /** Fails the server applied (any outcome). */
  failed: number;
  /** Leases found lost (heartbeat or settle refused with LEASE_LOST). */
  leaseLost: number;
  /** ExtendLease calls that failed as a whole. */
  heartbeatFailures: number;
  /** Claim calls retried after a transient failure (the same request_id). */
  claimRetries: number;
  /** Times claiming paused because 4 × `settleBatch` results awaited their settle (slow Acks). */
  claimsPaused: number;
  /** Handlers running now. */
  running: number;
}

export interface WorkerOptions extends ConnectionOptions {
  /** Handlers running at once; the worker never leases more than it can start. Default 8. */
  concurrency?: number;
  /** The worker's region: it gets that region's intents and region-less ones. */
  region?: string;
  /** Sent as `worker_id`. Default `<hostname>-<pid>-<random>`. */
  workerId?: string;
  /**
   * Which kinds to claim: `"handled"` (default) the kinds with a handler; `"all"` every
   * kind (an intent without a handler is then dead-lettered with a clear error); or a
   * non-empty list (an empty one is refused: the server would read it as every kind).
   */
  kinds?: "handled" | "all" | readonly string[];
  /** Lease length asked for. Default 30 s. */
  leaseMs?: number;
  /** How often live leases are extended. Default a third of `leaseMs`. */
  heartbeatMs?: number;
  /** Long-poll of each Claim. Default 20 s. */
  claimWaitMs?: number;
  /**
   * Most leases per Claim, and the free slots a Claim waits for after one that came back
   * full (a backlog), so quick handlers share one Claim and one Ack. Default `concurrency`
   * (at most 1,000; it was 100). An idle worker and a Claim after a short one never wait.
   */
  claimBatch?: number;
  /**
   * The longest a free slot waits for `claimBatch` company before the worker claims with
   * fewer: what slow handlers with a backlog may lose per slot and Claim. Default 5 ms;
   * 0 claims as soon as any slot is free.
   */
  claimLingerMs?: number;
  /** Claims in flight at once while there is a backlog (one long poll when idle). Default 2. */
  claimers?: number;
  /** Most leases per Ack or Fail call. Default 500, at most 1,000 (the server's limit). */
  settleBatch?: number;
  /** Acks and Fails wait at most this long to share a call. Default 2 ms. */
  settleDelayMs?: number;
  /** How long running handlers may finish after a stop. Default 30 s. */
  shutdownGraceMs?: number;
  /** Stop on SIGTERM and SIGINT (a second one ends the grace at once). Default true. */
  handleSignals?: boolean;
  /** Every event; default: warnings for failures on stderr. */
  onEvent?: (event: WorkerEvent) => void;
}

interface FailWith {
  kind: "fail";
  outcome: FailOutcome;
  error: string;
  retryAfterMs: number | undefined;
}

type Outcome = { kind: "ack" } | FailWith | { kind: "lost" };

interface Live {
  readonly intent: Intent;
  readonly leaseId: string;
  readonly controller: AbortController;
  /** Local estimate of the expiry: when the Claim or ExtendLease was sent, plus the lease. */
  expiresAt: number;
  extending: boolean;
  submitted: boolean;
  /** The server said the lease is gone: nothing more is reported for it. */
  lost: boolean;
  /** The local estimate of the expiry passed: the signal fired; the server decides the settle. */
  expired: boolean;
  done: boolean;
  settled: (() => void) | undefined;
}

interface PendingSettle {
  live: Live;
  failure: Failure | undefined;
}

const OUTCOME_NAMES = {
  [FailOutcome.UNSPECIFIED]: "retry",
  [FailOutcome.RETRY]: "retry",
  [FailOutcome.PERMANENT]: "permanent",
  [FailOutcome.UNKNOWN]: "unknown",
} as const;

export class Worker {
  readonly workerId: string;
  private readonly options: WorkerOptions;
  private readonly connection: Connection;
  private readonly handlers = new Map<string, Handler>();
  private readonly live = new Map<string, Live>();
  private readonly acks: PendingSettle[] = [];
  private readonly fails: PendingSettle[] = [];
  private readonly counters: Omit<WorkerStats, "running"> = {
    claimed: 0,
    acked: 0,
    failed: 0,
    leaseLost: 0,
    heartbeatFailures: 0,
    claimRetries: 0,
    claimsPaused: 0,
  };
  private running = 0;
  private settling = 0;
  private flushTimer: NodeJS.Timeout | undefined;
  private readonly waiters = new Set<() => void>();
  private reserved = 0;
  private backlog = false;
  /** A claimer is waiting for `claimBatch` free slots: the others leave them to it. */
  private gathering = false;
  private readonly stopping = new AbortController();
  private readonly graceOver = new AbortController();
  /** Aborts the settles still in flight, a short while after the grace ends. */
  private readonly settlesCut = new AbortController();
  private stoppedAt: number | undefined;
  private runPromise: Promise<void> | undefined;
  /** What stopped the worker on its own (a Claim refused for good): `run()` rejects with it. */
  private fatal: OutboxError | undefined;

  private readonly concurrency: number;
  private readonly leaseMs: number;
  private readonly heartbeatMs: number;
  private readonly claimWaitMs: number;
  private readonly claimBatch: number;
  private readonly claimLingerMs: number;
  private readonly claimers: number;
  private readonly settleBatch: number;
  private readonly settleDelayMs: number;
  private readonly graceMs: number;

  constructor(options: WorkerOptions) {
    this.options = options;
    this.connection = new Connection(options);
    this.workerId = options.workerId ?? `${hostname()}-${process.pid}-${randomUUID().slice(0, 8)}`;
    // Counts are sent as int32 and durations as whole milliseconds: a value the wire
    // cannot carry would fail every call, so it is refused here.
    this.concurrency = count("concurrency", options.concurrency ?? 8);
    this.leaseMs = millis("leaseMs", options.leaseMs ?? 30_000, 1);
    this.heartbeatMs = millis("heartbeatMs", options.heartbeatMs ?? Math.max(50, Math.floor(this.leaseMs / 3)), 1);
    this.claimWaitMs = millis("claimWaitMs", options.claimWaitMs ?? 20_000, 100);
    // The server refuses a batch of more than 1,000 (OUTBOX_LIMITS__MAX_BATCH).
    this.claimBatch = Math.min(count("claimBatch", options.claimBatch ?? this.concurrency), MAX_BATCH);
    this.claimLingerMs = millis("claimLingerMs", options.claimLingerMs ?? 5, 0);
    this.claimers = count("claimers", options.claimers ?? 2);
    this.settleBatch = Math.min(count("settleBatch", options.settleBatch ?? 500), MAX_BATCH);
    this.settleDelayMs = millis("settleDelayMs", options.settleDelayMs ?? 2, 0);
    this.graceMs = millis("shutdownGraceMs", options.shutdownGraceMs ?? 30_000, 0);
    if (this.heartbeatMs >= this.leaseMs) throw new RangeError("outboxd: heartbeatMs must be shorter than leaseMs");
    const kinds = options.kinds;
    if (kinds !== undefined && typeof kinds !== "string" && kinds.length === 0) {
      // The server reads an empty filter as every kind: intents of kinds without a handler
      // would be dead-lettered. "all" says that on purpose.
      throw new RangeError('outboxd: kinds must not be an empty list (use "all" to claim every kind)');
    }
  }

  /** Registers the handler of one kind (one per kind). */
  handle(kind: string, handler: Handler): this {
    if (this.handlers.has(kind)) throw new Error(`outboxd: kind ${kind} already has a handler`);
    this.handlers.set(kind, handler);
    return this;
  }

  /** Counters since the worker was made. */
  stats(): WorkerStats {
    return { ...this.counters, running: this.running };
  }

  /**
   * Claims and handles intents until `stop()` or SIGTERM/SIGINT, then drains: no new
   * claims, running handlers get the grace to finish, their Acks and Fails are flushed.
   * Handlers still running when the grace ends see their `signal` fire; their leases are
   * failed RETRY (or left to expire into NEEDS_RECONCILE once submitted).
   */
  run(): Promise<void> {
    this.runPromise ??= this.loop();
    return this.runPromise;
  }

  /**
   * Starts the drain; resolves when `run()` has finished (at once if it never ran). It
   * never rejects: `run()` reports what stopped the worker.
   */
  stop(): Promise<void> {
    this.beginStop();
    return (this.runPromise ?? Promise.resolve()).catch(() => undefined);
  }

  private beginStop(): void {
    this.stoppedAt ??= performance.now();
    this.stopping.abort();
    this.wakeAll();
  }

  private get stopped(): boolean {
    return this.stopping.signal.aborted;
  }

  private async loop(): Promise<void> {
    const kinds = this.claimKinds();
    const tracing = await loadTracing();
    // A second signal, not a signal after stop(): an app's own SIGTERM hook that calls
    // stop() must not cut the grace short.
    let signalled = false;
    const onSignal = (): void => {
      if (signalled) this.graceOver.abort();
      signalled = true;
      void this.stop();
    };
    if (this.options.handleSignals ?? true) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    // Often enough that a lease expiring locally fires its signal within 250 ms.
    const heartbeat = setInterval(() => {
      this.heartbeat();
    }, Math.max(20, Math.min(250, Math.floor(this.heartbeatMs / 2))));
    try {
      await this.claimLoop(kinds, tracing);
      await this.drain();
      if (this.fatal) throw this.fatal;
    } finally {
      clearInterval(heartbeat);
      if (this.options.handleSignals ?? true) {
        process.off("SIGTERM", onSignal);
        process.off("SIGINT", onSignal);
      }
      this.connection.close();
    }
  }

  private claimKinds(): string[] {
    const kinds = this.options.kinds ?? "handled";
    if (kinds === "all") return [];
    if (kinds === "handled") {
      if (this.handlers.size === 0) throw new Error("outboxd: no handler registered (worker.handle(kind, fn))");
      return [...this.handlers.keys()];
    }
    return [...kinds];
  }

  private async claimLoop(kinds: string[], tracing: Awaited<ReturnType<typeof loadTracing>>): Promise<void> {
    const loops = Array.from({ length: this.claimers }, (_, i) => this.claimer(i, kinds, tracing));
    await Promise.all(loops);
  }

  /**
   * One claim loop. Claimer 0 always runs; the others claim only while the last reply was
   * full (a backlog), so an idle worker holds a single long poll. During a backlog one
   * claimer at a time waits for `claimBatch` free slots (or `claimLingerMs`).
   */
  private async claimer(index: number, kinds: string[], tracing: Awaited<ReturnType<typeof loadTracing>>): Promise<void> {
    let failures = 0;
    const backOff = (): Promise<void> =>
      sleep(Math.random() * Math.min(5_000, 100 * 2 ** failures++), this.stopping.signal);
    let paused = false;
    while (!this.stopping.signal.aborted) {
      // Acks slower than the handlers: claiming on would pile up leases, each heartbeated.
      const settlesLag = this.settling > 4 * this.settleBatch;
      if (settlesLag && !paused && index === 0) this.counters.claimsPaused++;
      paused = settlesLag;
      let free = this.freeSlots();
      if (free <= 0 || settlesLag || (index > 0 && !this.backlog) || this.gathering) {
        await new Promise<void>((resolve) => this.waiters.add(resolve));
        continue;
      }
      const gathered = this.backlog && free < Math.min(this.claimBatch, this.concurrency);
      if (gathered) {
        // A backlog: quick handlers free their slots within moments of each other, and
        // one Claim (then one Ack) for all of them costs PostgreSQL one commit, not one each.
        this.gathering = true;
        try {
          await this.gather();
        } finally {
          this.gathering = false;
        }
        if (this.stopped) break;
        free = this.freeSlots();
        if (free <= 0) continue;
      }
      // Reserved before the call: never lease more than can be started.
      const max = Math.min(free, this.claimBatch);
      this.reserved += max;
      // A claimer left waiting while this one gathered may claim what is still free.
      if (gathered) this.wakeAll();
      const requestId = randomUUID();
      const sentAt = performance.now();
      let tries = 0;
      let leases: Lease[] | undefined;
      while (leases === undefined) {
        try {
          const reply = await this.connection.call(
            (client, options) => {
              tries++;
              return client.claim(
                {
                  workerId: this.workerId,
                  region: this.options.region ?? "",
                  kinds,
                  maxIntents: max,
                  leaseDuration: durationFromMs(this.leaseMs),
                  wait: durationFromMs(this.claimWaitMs),
                  // A retry after a lost answer gets the leases the first try took.
                  requestId,
                },
                options,
              );
            },
            {
              budgetMs: this.leaseMs,
              tryTimeoutMs: this.claimWaitMs + 10_000,
              signal: this.stopping.signal,
            },
          );
          leases = reply.leases;
          failures = 0;
        } catch (thrown) {
          const error = OutboxError.from(thrown);
          if (!this.stopped) this.emit({ type: "claimFailed", error });
          if (this.stopped) break;
          if (!transient(error)) {
            // A refused key, a missing scope, a bad request: retrying cannot help. The
            // worker drains what it holds and `run()` rejects with the error.
            this.fatal ??= error;
            this.beginStop();
            break;
          }
          // Its budget spent on a transient failure, the same Claim (request id, size,
          // reserved slots) goes on, slower: a lost answer's leases come back to it.
          await backOff();
        }
      }
      this.counters.claimRetries += Math.max(0, tries - 1);
      if (leases === undefined) {
        this.reserved -= max;
        if (this.stopped) break;
        await backOff();
        continue;
      }
      this.backlog = leases.length >= max;
      if (leases.length > 0) {
        this.counters.claimed += leases.length;
        this.emit({ type: "claimed", count: leases.length, replayed: tries > 1 });
      }
      // When the leases began, on this clock: answered within the margin, after the send
      // and not long before the answer. Later (a long poll's wait, a retry, or an answer
      // held on its way back), they may have begun long before it: renewed first.
      const margin = Math.min(1_000, this.leaseMs / 4);
      let leasedAt = sentAt;
      if (performance.now() - sentAt > margin) ({ leases, leasedAt } = await this.renewClaimed(leases, sentAt));
      // Reserved until started: a slot freed meanwhile must not be claimed twice.
      this.reserved -= max;
      // The grace ended (a second signal) during the renewal: nothing more starts; the
      // leases expire unstarted.
      if (this.graceOver.signal.aborted) break;
      for (const lease of leases) this.start(lease, leasedAt, tracing);
      // A full reply lets the other claimers claim; a short one ends another claimer's
      // wait for company (the queue is short).
      this.wakeAll();
    }
  }

  /**
   * Leases of a Claim answered late, which may have begun at any time since its first send
   * (a long poll's wait, fresh leases of a retry, an answer held on its way back): one
   * ExtendLease gives every one a known expiry, counted from its send; those it finds lost
   * are dropped unstarted. If it fails, or fails for one of them without losing it, they
   * count from the Claim's first send, the earliest they can have begun.
   */
  private async renewClaimed(leases: Lease[], sentAt: number): Promise<{ leases: Lease[]; leasedAt: number }> {
    if (leases.length === 0) return { leases, leasedAt: sentAt };
    const renewedAt = performance.now();
    const results = await this.extendLeases(
      leases.map((l) => ({ intentId: l.intent?.id ?? "", leaseId: l.leaseId })),
      this.heartbeatMs,
    );
    if (results === undefined) return { leases, leasedAt: sentAt };
    const kept: Lease[] = [];
    let unsure = false;
    for (const [i, lease] of leases.entries()) {
      const error = results[i]?.error;
      if (results[i] === undefined || (error !== undefined && !LOST_REASONS.has(error.reason))) {
        // Not renewed, but not lost either: it holds until its first expiry.
        this.counters.heartbeatFailures++;
        unsure = true;
      } else if (error !== undefined) {
        this.counters.leaseLost++;
        const reason = `a late Claim's lease was not renewed: ${error.reason} ${error.message}`;
        this.emit({ type: "leaseLost", intent: intentOf(lease), reason });
        continue;
      }
      kept.push(lease);
    }
    return { leases: kept, leasedAt: unsure ? sentAt : renewedAt };
  }

  private freeSlots(): number {
    return this.concurrency - this.running - this.reserved;
  }

  /**
   * Waits until `claimBatch` slots are free, `claimLingerMs` has passed, the queue turned
   * out short (another claimer's reply), or the worker stops.
   */
  private async gather(): Promise<void> {
    const target = Math.min(this.claimBatch, this.concurrency);
    const deadline = performance.now() + this.claimLingerMs;
    while (!this.stopped && this.backlog && this.freeSlots() < target) {
      const left = deadline - performance.now();
      if (left <= 0) return;
      await new Promise<void>((resolve) => {
        const wake = (): void => {
          clearTimeout(timer);
          resolve();
        };
        const timer = setTimeout(() => {
          this.waiters.delete(wake);
          resolve();
        }, left);
        this.waiters.add(wake);
      });
    }
  }

  private wakeAll(): void {
    const waiters = [...this.waiters];
    this.waiters.clear();
    for (const wake of waiters) wake();
  }

  private start(lease: Lease, leasedAt: number, tracing: Awaited<ReturnType<typeof loadTracing>>): void {
    if (leasedAt + this.leaseMs <= performance.now()) {
      // Past its local expiry before it started (a late answer whose renewal failed): it
      // may be leased again by now, so the side effect is not begun.
      this.counters.leaseLost++;
      const reason = "the lease expired before the Claim's answer arrived";
      this.emit({ type: "leaseLost", intent: intentOf(lease), reason });
      return;
    }
    const live: Live = {
      intent: intentOf(lease),
      leaseId: lease.leaseId,
      controller: new AbortController(),
      expiresAt: leasedAt + this.leaseMs,
      extending: false,
      submitted: false,
      lost: false,
      expired: false,
      done: false,
      settled: undefined,
    };
    this.live.set(live.leaseId, live);
    this.running++;
    this.execute(live, tracing).catch((error: unknown) => {
      // execute() guards every step; should something still throw, the lease is given
      // back rather than the rejection ending the process.
      this.reportFallback(live, error);
    });
  }

  private async execute(live: Live, tracing: Awaited<ReturnType<typeof loadTracing>>): Promise<void> {
    let outcome: Outcome;
    try {
      outcome = await this.invoke(live, tracing);
    } catch (error) {
      outcome = fallbackOutcome(live, error);
    } finally {
      this.running--;
      this.wakeAll();
    }
    if (live.done) return; // abandoned at the end of the grace
    if (live.lost) {
      this.lose(live, "the lease was lost before the handler finished");
      return;
    }
    if (outcome.kind === "lost") {
      // The handler gave up on a lease it saw expire; the server may still hold it for us.
      outcome = fail(live.submitted ? FailOutcome.UNKNOWN : FailOutcome.RETRY, "the handler stopped: its lease expired");
    }
    let failure: Failure | undefined;
    try {
      failure = outcome.kind === "fail" ? failureOf(live, outcome) : undefined;
    } catch (error) {
      failure = failureOf(live, fallbackOutcome(live, error));
    }
    await this.queueSettle({ live, failure });
  }

  /** Runs the handler; what it threw becomes the outcome. */
  private async invoke(live: Live, tracing: Awaited<ReturnType<typeof loadTracing>>): Promise<Outcome> {
    const { intent } = live;
    const handler = this.handlers.get(intent.kind);
    if (handler === undefined) {
      return fail(
        FailOutcome.PERMANENT,
        `no handler for kind "${intent.kind}" on worker ${this.workerId} (register one with worker.handle)`,
      );
    }
    try {
      const context = this.context(live);
      await traced(
        tracing,
        intent.headers,
        { id: intent.id, kind: intent.kind, attempt: intent.attempt, workerId: this.workerId },
        async () => {
          await handler(intent, context);
        },
      );
      return { kind: "ack" };
    } catch (error) {
      return outcomeOf(error, live.submitted);
    }
  }

  /** Queues an Ack or Fail; resolves once its call answered (or the lease was lost). */
  private queueSettle(settle: PendingSettle): Promise<void> {
    return new Promise<void>((resolve) => {
      settle.live.settled = resolve;
      (settle.failure ? this.fails : this.acks).push(settle);
      this.settling++;
      this.scheduleFlush();
    });
  }

  /** The last resort of a handler's run that threw past its guards: Fail RETRY (UNKNOWN once submitted). */
  private reportFallback(live: Live, error: unknown): void {
    if (live.done || live.lost || live.settled !== undefined) return;
    try {
      void this.queueSettle({ live, failure: failureOf(live, fallbackOutcome(live, error)) });
    } catch {
      // Nothing is left to report with: the lease expires instead.
    }
  }

  private context(live: Live): HandlerContext {
    const submitting = async <T>(call: () => Promise<T> | T): Promise<T> => {
      await this.markSubmitted(live);
      return await call();
    };
    return {
      signal: live.controller.signal,
      workerId: this.workerId,
      get leaseLost() {
        return live.lost;
      },
      submitting,
    };
  }

  /**
   * One try of an ExtendLease: a third of the interval (at least 0.5 s), so that a replica
   * that never answers (two in a row) leaves time for the next endpoint within the round.
   */
  private heartbeatTryTimeoutMs(): number {
    return Math.min(5_000, this.heartbeatMs, Math.max(this.heartbeatMs / 3, 500));
  }

  /**
   * One try of a settle or MarkSubmitted: short enough that a replica that never answers
   * leaves time within the lease for a retry on the next one.
   */
  private leaseCallTimeoutMs(): number {
    return Math.min(10_000, Math.max(this.heartbeatMs, 1_000));
  }

  private async markSubmitted(live: Live): Promise<void> {
    if (live.lost) throw new LeaseLostError(live.intent.id, "the lease was lost before MarkSubmitted");
    let result: LeaseResult | undefined;
    try {
      const reply = await this.connection.call(
        (client, options) =>
          client.markSubmitted({ leases: [{ intentId: live.intent.id, leaseId: live.leaseId }] }, options),
        {
          budgetMs: Math.max(0, live.expiresAt - performance.now()),
          tryTimeoutMs: Math.min(5_000, this.leaseCallTimeoutMs()),
          signal: live.controller.signal,
        },
      );
      result = reply.results[0];
    } catch (thrown) {
      // Neither Retry nor Unknown: decided when the handler ends, UNKNOWN if the lease is
      // submitted by then (another submitting() of this run may have begun its call).
      throw new Error(`MarkSubmitted failed: ${OutboxError.from(thrown).message}`);
    }
    if (result?.error) {
      if (result.error.reason === "LEASE_LOST" || result.error.code === (Code.NotFound as number)) {
        this.markLost(live);
        const lost = new LeaseLostError(live.intent.id, `MarkSubmitted refused: ${result.error.message}`);
        live.controller.abort(lost);
        throw lost;
      }
      throw new Error(`MarkSubmitted refused: ${result.error.reason} ${result.error.message}`);
    }
    live.submitted = true;
  }

  /** Extends leases past a third of their life; fires the signal of those already expired. */
  private heartbeat(): void {
    // After a second signal (the grace ended at once) the handlers are told to stop and
    // their leases given back: nothing more to extend.
    if (this.graceOver.signal.aborted) return;
    const now = performance.now();
    const due: Live[] = [];
    for (const live of this.live.values()) {
      if (live.lost || live.expired || live.done) continue;
      if (live.expiresAt <= now) {
        // Not yet known lost: a settle is still sent, and the server fences it.
        live.expired = true;
        live.controller.abort(
          new LeaseLostError(live.intent.id, "the lease expired before a heartbeat got through"),
        );
        continue;
      }
      if (!live.extending && live.expiresAt - now < this.leaseMs - this.heartbeatMs) due.push(live);
    }
    // One lease per intent in a call (the server refuses a repeated intent): a lease whose
    // settle is in flight gives way to a newer lease of its intent.
    const byIntent = new Map<string, Live>();
    for (const live of due) {
      const kept = byIntent.get(live.intent.id);
      if (kept === undefined || (kept.settled !== undefined && live.settled === undefined)) byIntent.set(live.intent.id, live);
    }
    const calls = [...byIntent.values()];
    for (let i = 0; i < calls.length; i += 1000) void this.extend(calls.slice(i, i + 1000));
  }

  private async extend(leases: Live[]): Promise<void> {
    for (const live of leases) live.extending = true;
    const sentAt = performance.now();
    const earliest = Math.min(...leases.map((l) => l.expiresAt));
    try {
      const results = await this.extendLeases(
        leases.map((l) => ({ intentId: l.intent.id, leaseId: l.leaseId })),
        Math.max(0, earliest - sentAt),
      );
      if (results === undefined) return;
      results.forEach((result, i) => {
        const live = leases[i];
        if (live === undefined || live.done) return;
        // Settled meanwhile: the settle's answer counts, not this one.
        if (result.error && live.settled !== undefined) return;
        if (result.error && !LOST_REASONS.has(result.error.reason)) {
          // Not extended, but not lost either: it holds until its current expiry.
          this.counters.heartbeatFailures++;
        } else if (result.error) {
          if (!live.lost) {
            live.lost = true;
            this.counters.leaseLost++;
            live.controller.abort(
              new LeaseLostError(live.intent.id, `heartbeat refused: ${result.error.reason} ${result.error.message}`),
            );
          }
        } else if (!live.lost) {
          live.expiresAt = sentAt + this.leaseMs;
        }
      });
    } finally {
      for (const live of leases) live.extending = false;
    }
  }

  /**
   * One ExtendLease of `refs` by a lease's length, given up at the end of the grace. On a
   * failure it is counted and reported, and the answer is undefined.
   */
  private async extendLeases(
    refs: { intentId: string; leaseId: string }[],
    budgetMs: number,
  ): Promise<LeaseResult[] | undefined> {
    try {
      const reply = await this.connection.call(
        (client, options) =>
          client.extendLease(
            { leases: refs.map((r) => create(LeaseRefSchema, r)), leaseDuration: durationFromMs(this.leaseMs) },
            options,
          ),
        { budgetMs, tryTimeoutMs: this.heartbeatTryTimeoutMs(), signal: this.graceOver.signal },
      );
      return reply.results;
    } catch (thrown) {
      this.counters.heartbeatFailures++;
      this.emit({ type: "heartbeatFailed", error: OutboxError.from(thrown), leases: refs.length });
      return undefined;
    }
  }

  private scheduleFlush(): void {
    if (this.acks.length >= this.settleBatch || this.fails.length >= this.settleBatch) {
      this.flush();
      return;
    }
    this.flushTimer ??= setTimeout(() => {
      this.flush();
    }, this.settleDelayMs);
  }

  private flush(): void {
    if (this.flushTimer !== undefined) clearTimeout(this.flushTimer);
    this.flushTimer = undefined;
    for (const batch of batches(this.acks.splice(0), this.settleBatch)) void this.sendAcks(batch);
    for (const batch of batches(this.fails.splice(0), this.settleBatch)) void this.sendFails(batch);
  }

  private async sendAcks(batch: PendingSettle[]): Promise<void> {
    await this.settle("ack", batch, (client, options) =>
      client
        .ack({ leases: batch.map(({ live }) => ({ intentId: live.intent.id, leaseId: live.leaseId })) }, options)
        .then((r) => r.results),
    );
  }

  private async sendFails(batch: PendingSettle[], policy?: SettlePolicy): Promise<void> {
    await this.settle(
      "fail",
      batch,
      (client, options) =>
        client.fail({ failures: batch.flatMap(({ failure }) => (failure ? [failure] : [])) }, options).then((r) => r.results),
      policy,
    );
  }

  private async settle(
    call: "ack" | "fail",
    batch: PendingSettle[],
    send: (client: OutboxServiceClient, options: CallOptions) => Promise<LeaseResult[]>,
    policy: SettlePolicy = { budgetMs: Math.max(this.leaseMs, 30_000), tryTimeoutMs: this.leaseCallTimeoutMs() },
  ): Promise<void> {
    try {
      // Repeating a settle with the same leases is a replay: answered OK if it applied.
      const results = await this.connection.call(send, { ...policy, retryable: transient, signal: this.settlesCut.signal });
      batch.forEach(({ live, failure }, i) => {
        const result = results[i];
        if (result?.error) {
          if (result.error.reason === "LEASE_LOST") {
            this.lose(live, `${call} refused: ${result.error.message}`);
          } else {
            this.emit({
              type: "settleRejected",
              intent: live.intent,
              call,
              code: result.error.code,
              reason: result.error.reason,
              message: result.error.message,
            });
          }
        } else if (failure) {
          this.counters.failed++;
          this.emit({
            type: "failed",
            intent: live.intent,
            outcome: OUTCOME_NAMES[failure.outcome],
            error: failure.error,
          });
        } else {
          this.counters.acked++;
          this.emit({ type: "acked", intent: live.intent });
        }
      });
    } catch (thrown) {
      const error = OutboxError.from(thrown);
      if (error.code === Code.InvalidArgument && batch.length > 1) {
        // One bad item refuses the whole call: settle each alone, so the others apply.
        this.settling -= batch.length;
        for (const item of batch) {
          this.settling++;
          void (call === "ack" ? this.sendAcks([item]) : this.sendFails([item], policy));
        }
        return;
      }
      for (const { live } of batch) this.emit({ type: "settleFailed", intent: live.intent, call, error });
    }
    for (const { live } of batch) this.finish(live);
    this.settling -= batch.length;
    this.wakeAll();
  }

  private markLost(live: Live): void {
    if (!live.lost) {
      live.lost = true;
      this.counters.leaseLost++;
    }
  }

  private lose(live: Live, reason: string): void {
    this.markLost(live);
    live.controller.abort(new LeaseLostError(live.intent.id, reason));
    this.emit({ type: "leaseLost", intent: live.intent, reason });
    this.finish(live);
  }

  private finish(live: Live): void {
    live.done = true;
    this.live.delete(live.leaseId);
    live.settled?.();
  }

  private async drain(): Promise<void> {
    // The grace counts from the stop, not from when the claim loops ended.
    const deadline = (this.stoppedAt ?? performance.now()) + this.graceMs;
    while (this.running > 0 && performance.now() < deadline && !this.graceOver.signal.aborted) {
      await sleep(Math.min(20, deadline - performance.now()), this.graceOver.signal);
    }
    // Settles still failing SETTLE_AFTER_GRACE_MS after the grace are given up
    // (settleFailed): their leases expire instead, and the worker's exit is bounded.
    const cut = setTimeout(() => {
      this.settlesCut.abort();
    }, SETTLE_AFTER_GRACE_MS);
    try {
      await this.settleAll();
    } finally {
      clearTimeout(cut);
    }
  }

  /** After the grace: gives back the leases of handlers still running, flushes every settle. */
  private async settleAll(): Promise<void> {
    if (this.running > 0) {
      // The grace is over: tell the handlers, then give their leases back.
      const abandoned: PendingSettle[] = [];
      for (const live of [...this.live.values()]) {
        if (live.done || live.settled !== undefined) continue;
        live.controller.abort(new ShutdownError());
        live.done = true;
        this.live.delete(live.leaseId);
        // Refused before (a heartbeat or MarkSubmitted): nothing more is reported for it.
        if (live.lost) continue;
        if (live.submitted) {
          // Its external call may be under way: the expiry sends it to an operator.
          this.emit({ type: "abandoned", intent: live.intent, outcome: "expire" });
        } else {
          abandoned.push({
            live,
            failure: failureOf(live, fail(FailOutcome.RETRY, `worker ${this.workerId} shut down before the handler finished`)),
          });
          this.emit({ type: "abandoned", intent: live.intent, outcome: "retry" });
        }
      }
      // Short calls: the grace is already spent. A lease whose Fail fails expires instead.
      const policy: SettlePolicy = { budgetMs: 5_000, tryTimeoutMs: 2_000 };
      await Promise.all(
        batches(abandoned, this.settleBatch).map((batch) => {
          this.settling += batch.length;
          return this.sendFails(batch, policy);
        }),
      );
    }
    this.flush();
    while (this.settling > 0) await new Promise<void>((resolve) => setTimeout(resolve, 5));
  }

  private emit(event: WorkerEvent): void {
    const onEvent = this.options.onEvent;
    if (onEvent) {
      try {
        onEvent(event);
      } catch {
        // A throwing callback must not break the lease loop.
      }
      return;
    }
    switch (event.type) {
      case "claimFailed":
      case "heartbeatFailed":
        console.warn(`outboxd worker ${this.workerId}: ${event.type}: ${event.error.message}`);
        break;
      case "settleFailed":
        console.warn(`outboxd worker ${this.workerId}: ${event.call} of ${event.intent.id} failed: ${event.error.message}`);
        break;
      case "settleRejected":
        console.warn(`outboxd worker ${this.workerId}: ${event.call} of ${event.intent.id} refused: ${event.reason}`);
        break;
      default:
        break;
    }
  }
}

/** How long a settle call may take, retries included. */
interface SettlePolicy {
  budgetMs: number;
  tryTimeoutMs: number;
}

/** How long settles may still take once the grace is over. */
const SETTLE_AFTER_GRACE_MS = 5_000;

/** The server's most items per call (`OUTBOX_LIMITS__MAX_BATCH`): past it a call is refused. */
const MAX_BATCH = 1_000;

/** Per-item reasons meaning "this lease is not ours any more". */
const LOST_REASONS = new Set(["LEASE_LOST", "NOT_FOUND", "INVALID_STATE"]);

/**
 * Most bytes of one settle call: half the server's default request limit for `Fail`
 * (`OUTBOX_LIMITS__MAX_MESSAGE_BYTES`, 8 MiB), which long non-ASCII error texts could pass.
 */
const MAX_CALL_BYTES = 4 * 1024 * 1024;

/** About what a settle adds to its call on the wire: the ids, the error text, the framing. */
function settleBytes(item: PendingSettle): number {
  const text = item.failure === undefined ? 0 : Buffer.byteLength(item.failure.error, "utf8");
  return item.live.intent.id.length + item.live.leaseId.length + text + 64;
}

/**
 * Splits settles into calls of at most `size` items and `MAX_CALL_BYTES`, never naming one
 * intent twice in a call (a worker may hold an expired lease and a new one on the same
 * intent; a batch naming an intent twice is refused whole).
 */
export function batches(items: PendingSettle[], size: number): PendingSettle[][] {
  const out: { ids: Set<string>; bytes: number; items: PendingSettle[] }[] = [];
  for (const item of items) {
    const id = item.live.intent.id;
    const bytes = settleBytes(item);
    let batch = out.find((b) => b.items.length < size && b.bytes + bytes <= MAX_CALL_BYTES && !b.ids.has(id));
    if (batch === undefined) {
      batch = { ids: new Set(), bytes: 0, items: [] };
      out.push(batch);
    }
    batch.ids.add(id);
    batch.bytes += bytes;
    batch.items.push(item);
  }
  return out.map((b) => b.items);
}

/** Longest `error` sent with a Fail, in characters (code points): the server's default
 * `OUTBOX_LIMITS__MAX_TEXT_LENGTH` (the Rust and Python SDKs cut at the same). */
const MAX_ERROR_CHARS = 4096;

/**
 * The `error` of a Fail as the server accepts it: every control character (a stack trace's
 * newlines, tabs) becomes a space and the text is cut to `MAX_ERROR_CHARS` code points (never
 * inside a surrogate pair). Refused text would refuse the Fail, and the intent would wait out
 * its lease.
 */
export function failText(text: string): string {
  let out = "";
  let chars = 0;
  for (const c of text) {
    if (chars++ === MAX_ERROR_CHARS) break;
    out += c;
  }
  return out.replace(/\p{Cc}/gu, " ");
}

function fail(outcome: FailOutcome, error: string, retryAfterMs?: number): FailWith {
  return { kind: "fail", outcome, error, retryAfterMs };
}

/** Maps what a handler threw to what is reported. */
function outcomeOf(error: unknown, submitted: boolean): Outcome {
  try {
    if (error instanceof LeaseLostError) return { kind: "lost" };
    if (error instanceof Retry) return fail(FailOutcome.RETRY, describe(error.message), error.afterMs);
    if (error instanceof Permanent) return fail(FailOutcome.PERMANENT, describe(error.message));
    if (error instanceof Unknown) return fail(FailOutcome.UNKNOWN, describe(error.message));
    if (error instanceof Error) return fail(submitted ? FailOutcome.UNKNOWN : FailOutcome.RETRY, `${describe(error.name)}: ${describe(error.message)}`);
  } catch {
    // A getter that throws (`instanceof` through a Proxy, `message`): described as below.
  }
  // Once submitted, an error means nobody knows whether the external call happened.
  return fail(submitted ? FailOutcome.UNKNOWN : FailOutcome.RETRY, describe(error));
}

/** Fail RETRY, or UNKNOWN once submitted: what a failure to report the outcome becomes. */
function fallbackOutcome(live: Live, error: unknown): FailWith {
  return fail(live.submitted ? FailOutcome.UNKNOWN : FailOutcome.RETRY, `outboxd: reporting the handler's outcome failed: ${describe(error)}`);
}

/** `String(value)`, or a placeholder for values that cannot be converted (`Object.create(null)`). */
function describe(value: unknown): string {
  try {
    return String(value);
  } catch {
    return `a thrown ${typeof value} that cannot be converted to a string`;
  }
}

/** The `Failure` of a fail outcome (`retry_after` only when it is a delay the wire can carry). */
function failureOf(live: Live, outcome: FailWith): Failure {
  const after = outcome.retryAfterMs;
  const retryAfter =
    after !== undefined && Number.isFinite(after) && after >= 0 ? durationFromMs(Math.max(1, Math.round(after))) : undefined;
  return create(FailureSchema, {
    lease: { intentId: live.intent.id, leaseId: live.leaseId },
    outcome: outcome.outcome,
    error: failText(outcome.error),
    ...(retryAfter !== undefined ? { retryAfter } : {}),
  });
}

/** An option that is a count (sent as an int32, or bounding one): a whole number from 1. */
function count(name: string, value: number): number {
  if (!Number.isSafeInteger(value) || value < 1) throw new RangeError(`outboxd: ${name} must be a whole number of at least 1`);
  return value;
}

/** Longest timer Node runs as asked (2^31 - 1 ms, about 24.8 days); longer ones fire at once. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** An option in milliseconds, rounded to a whole millisecond (durations go on the wire as such). */
function millis(name: string, value: number, min: number): number {
  const ms = Math.round(value);
  if (!Number.isFinite(ms) || ms < min || ms > MAX_TIMER_MS) {
    throw new RangeError(`outboxd: ${name} must be a number of milliseconds from ${min} to ${MAX_TIMER_MS}`);
  }
  return ms;
}
