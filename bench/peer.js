// Peer harness for outboxd-bench: runs one scenario against graphile-worker or pg-boss on
// the database given, and prints one JSON line with the figures. The Rust harness reads it,
// and measures PostgreSQL (CPU, commits, WAL) itself around the measured section.
//
//   node peer.js <graphile-worker|pg-boss> <enqueue-batch|enqueue-single|burn-down|rate> \
//       --url URL --n N [--concurrency C] [--batch B] [--rate R] [--local-queue N] [--notify 0|1]
//
// `rate` is the fixed-rate scenario: N jobs sent one per call at R/s (open loop) while C
// workers of the library's own kind (graphile-worker's runner, pg-boss `work`) take them;
// the latency is from the send returning to the handler starting. `--local-queue N` gives
// graphile-worker's runners there a local queue of N; `--notify 1` runs pg-boss with
// LISTEN/NOTIFY instead of polling alone.
//
// Protocol on stdout, one JSON object per line:
//   {"ready":true}  after setup (schema migrations, queue creation, connection pools);
//                   the harness takes its "before" snapshot, then writes a line to stdin;
//   {"n":…, "seconds":…, "cpu_seconds":…, "latencies_us":[…]}  at the end of the run
//                   (`rate` adds "sent" and "behind", the sends dropped while
//                   MAX_IN_FLIGHT were unanswered).
// `cpu_seconds` is this process's user + system CPU over the measured section only (module
// loading and migrations are setup, not work per intent).
"use strict";

const readline = require("node:readline");

const QUEUE = "bench";
// Same shape and size as the intents outboxd-bench enqueues (see PAYLOAD_PAD in Rust).
const PAD = "x".repeat(48);
const payload = (i) => ({ n: i, pad: PAD });

function parseArgs(argv) {
  const [system, scenario, ...rest] = argv;
  const opts = { system, scenario, concurrency: 1, batch: 100 };
  for (let i = 0; i < rest.length; i += 2) {
    const key = rest[i].replace(/^--/, "");
    opts[key] = key === "url" ? rest[i + 1] : Number(rest[i + 1]);
  }
  if (!opts.url || !opts.n) throw new Error("usage: peer.js SYSTEM SCENARIO --url URL --n N");
  return opts;
}

// Resolves once the line is handed to the OS: exiting earlier would cut a long line
// written to a pipe (stdout to a pipe is asynchronous in Node).
function emit(obj) {
  return new Promise((resolve) => process.stdout.write(JSON.stringify(obj) + "\n", resolve));
}

// Waits for the harness's go-ahead line on stdin.
function waitForGo() {
  return new Promise((resolve, reject) => {
    const rl = readline.createInterface({ input: process.stdin });
    rl.once("line", () => {
      resolve();
      rl.close();
    });
    rl.once("close", () => reject(new Error("stdin closed before go")));
  });
}

// Runs `count` calls of `fn(index)` from `concurrency` loops; returns per-call latencies.
async function closedLoop(count, concurrency, fn) {
  const latencies = [];
  let next = 0;
  async function loop() {
    for (;;) {
      const i = next++;
      if (i >= count) return;
      const t0 = process.hrtime.bigint();
      await fn(i);
      latencies.push(Number((process.hrtime.bigint() - t0) / 1000n));
    }
  }
  await Promise.all(Array.from({ length: concurrency }, loop));
  return latencies;
}

const MAX_IN_FLIGHT = 1024; // as the Rust harness's fixed-rate producer
// How long the workers get to take what was sent, after the last send (as DRAIN_TIMEOUT).
const DRAIN_MS = 5000;

const nowNs = () => Number(process.hrtime.bigint());
const sleepMs = (ms) => new Promise((r) => setTimeout(r, ms));

// Sends job i at start + i/rate, whatever earlier sends are doing (open loop), and
// records when each send returned; a send due while MAX_IN_FLIGHT are unanswered is
// dropped and counted as behind.
async function openLoop(n, rate, send) {
  const okAt = new Array(n).fill(null);
  const pending = [];
  let inFlight = 0;
  let behind = 0;
  const t0 = nowNs();
  for (let i = 0; i < n; i++) {
    const wait = (t0 + (i * 1e9) / rate - nowNs()) / 1e6;
    if (wait >= 1) await sleepMs(wait);
    if (inFlight >= MAX_IN_FLIGHT) {
      behind += 1;
      continue;
    }
    inFlight += 1;
    pending.push(
      send(i).then(() => {
        okAt[i] = nowNs();
        inFlight -= 1;
      }),
    );
  }
  await Promise.all(pending);
  return { okAt, behind, seconds: (nowNs() - t0) / 1e9 };
}

// The fixed-rate scenario around a library: `startWorkers(onJob)` starts its workers, which
// call onJob(n) as each handler starts; `send(n)` enqueues job n. Waits until every sent
// job was taken (or DRAIN_MS passed), then joins send and take times by n.
async function fixedRate(opts, startWorkers, send, stopWorkers) {
  const takenAt = new Array(opts.n).fill(null);
  let taken = 0;
  await startWorkers((n) => {
    if (takenAt[n] === null) {
      takenAt[n] = nowNs();
      taken += 1;
    }
  });
  emit({ ready: true });
  await waitForGo();
  const start = process.cpuUsage();
  const { okAt, behind, seconds } = await openLoop(opts.n, opts.rate, send);
  const sent = okAt.filter((t) => t !== null).length;
  const deadline = Date.now() + DRAIN_MS;
  while (taken < sent && Date.now() < deadline) await sleepMs(5);
  await stopWorkers();
  const cpu = process.cpuUsage(start);
  const latencies = [];
  for (let i = 0; i < opts.n; i++) {
    if (okAt[i] !== null && takenAt[i] !== null) {
      // A handler that started before its send returned counts as 0, as in Rust.
      latencies.push(Math.max(0, Math.round((takenAt[i] - okAt[i]) / 1000)));
    }
  }
  return {
    n: latencies.length,
    sent,
    behind,
    seconds,
    cpu_seconds: (cpu.user + cpu.system) / 1e6,
    latencies_us: latencies,
  };
}

// --- graphile-worker ----------------------------------------------------------------------

// The configuration graphile-worker's documentation gives for throughput (its Performance
// page, "Quick stats" and "Batching"): 24 concurrent jobs per runner on a pool of 25
// connections, jobs fetched in batches into a local queue, completions and failures
// batched (`completeJobBatchDelay`/`failJobBatchDelay` 0: released on the next tick), and
// prepared statements (its default, named here so that no one turns them off by accident).
// The local queue holds as many jobs as the other systems claim at once (`localQueueSize`;
// 0: none, each job fetched by its own slot when LISTEN/NOTIFY wakes it).
const GRAPHILE_CONCURRENT_JOBS = 24;
function graphilePreset(url, localQueueSize) {
  return {
    worker: {
      connectionString: url,
      concurrentJobs: GRAPHILE_CONCURRENT_JOBS,
      maxPoolSize: GRAPHILE_CONCURRENT_JOBS + 1,
      preparedStatements: true,
      completeJobBatchDelay: 0,
      failJobBatchDelay: 0,
      localQueue: { size: localQueueSize > 0 ? localQueueSize : -1 },
    },
  };
}

// Starts `count` runners (one per worker of the other systems: graphile-worker's own
// performance test runs several instances side by side) with `handler` for the task.
async function graphileRunners(opts, count, localQueueSize, handler) {
  const { run } = require("graphile-worker");
  return Promise.all(
    Array.from({ length: count }, () =>
      run({
        preset: graphilePreset(opts.url, localQueueSize),
        taskList: { [QUEUE]: handler },
        noHandleSignals: true,
        logger: quietLogger(),
      }),
    ),
  );
}

async function graphile(opts) {
  const { makeWorkerUtils } = require("graphile-worker");
  const utils = await makeWorkerUtils({ preset: graphilePreset(opts.url, 0) });
  await utils.migrate();
  if (opts.scenario === "rate") {
    // Without a local queue (--local-queue 0) a free job slot fetches a job as each
    // LISTEN/NOTIFY wake-up arrives; with one, a runner fetches up to N at a time.
    let runners = [];
    const result = await fixedRate(
      opts,
      async (onJob) => {
        runners = await graphileRunners(opts, opts.concurrency, opts["local-queue"] || 0, async (job) =>
          onJob(job.n),
        ); // job: the payload
      },
      (i) => utils.addJob(QUEUE, payload(i)),
      () => Promise.all(runners.map((r) => r.stop())),
    );
    await utils.release();
    return result;
  }
  if (opts.scenario === "burn-down") {
    // `concurrency` runners, each fetching `batch` jobs at a time into its local queue.
    let done = 0;
    let finished;
    const allDone = new Promise((r) => (finished = r));
    emit({ ready: true });
    await waitForGo();
    const start = process.cpuUsage();
    const t0 = process.hrtime.bigint();
    const runners = await graphileRunners(opts, opts.concurrency, opts.batch, async () => {
      done += 1;
      if (done === opts.n) finished();
    });
    await allDone;
    const handlerSeconds = Number(process.hrtime.bigint() - t0) / 1e9;
    // Completions are batched asynchronously: stop() flushes them before returning.
    await Promise.all(runners.map((r) => r.stop()));
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    const cpu = process.cpuUsage(start);
    await utils.release();
    const left = await countRows(opts.url, "SELECT count(*)::int AS n FROM graphile_worker._private_jobs");
    if (left !== 0) throw new Error(`${left} jobs left after the burn-down`);
    return { n: done, seconds, handler_seconds: handlerSeconds, cpu_seconds: (cpu.user + cpu.system) / 1e6, latencies_us: [] };
  }
  emit({ ready: true });
  await waitForGo();
  const start = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  let latencies;
  if (opts.scenario === "enqueue-batch") {
    const calls = Math.ceil(opts.n / opts.batch);
    latencies = await closedLoop(calls, opts.concurrency, (c) => {
      const size = Math.min(opts.batch, opts.n - c * opts.batch);
      const specs = Array.from({ length: size }, (_, k) => ({
        identifier: QUEUE,
        payload: payload(c * opts.batch + k),
      }));
      return utils.addJobs(specs);
    });
  } else if (opts.scenario === "enqueue-single") {
    latencies = await closedLoop(opts.n, opts.concurrency, (i) => utils.addJob(QUEUE, payload(i)));
  } else {
    throw new Error(`unknown scenario ${opts.scenario}`);
  }
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  const cpu = process.cpuUsage(start);
  await utils.release();
  return { n: opts.n, seconds, cpu_seconds: (cpu.user + cpu.system) / 1e6, latencies_us: latencies };
}

function quietLogger() {
  const { Logger } = require("graphile-worker");
  return new Logger(() => (level, message) => {
    if (level === "error") process.stderr.write(`graphile-worker: ${message}\n`);
  });
}

// One count from a query of its own connection (the checks after a burn-down).
async function countRows(url, sql) {
  const { Client } = require("pg");
  const client = new Client({ connectionString: url });
  await client.connect();
  try {
    return (await client.query(sql)).rows[0].n;
  } finally {
    await client.end();
  }
}

// --- pg-boss ------------------------------------------------------------------------------

// pg-boss's documented ways to go fast (its Workers and Jobs pages): `work()` with
// `batchSize` (a batch per fetch, the handler given the array, the batch completed in one
// call when it returns), `burstWhenBatchFull` (fetch again at once while fetches come back
// full instead of waiting for the polling interval), and LISTEN/NOTIFY (`useListenNotify`
// on the instance, `notify` on the queue) so that a new job wakes the workers instead of
// their next poll; `insert()` for many jobs in one call.
async function pgboss(opts) {
  const { PgBoss } = require("pg-boss");
  const notify = Boolean(opts.notify);
  const boss = new PgBoss({
    connectionString: opts.url,
    max: Math.max(opts.concurrency + 2, 10),
    useListenNotify: notify,
    // No background maintenance or scheduling inside the measured window.
    supervise: false,
    schedule: false,
  });
  boss.on("error", (e) => process.stderr.write(`pg-boss: ${e.message}\n`));
  await boss.start();
  // The queue outlives one run: later runs on the database set `notify` their own way.
  await boss.createQueue(QUEUE, { notify });
  await boss.updateQueue(QUEUE, { notify });
  // `concurrency` workers (each work() call adds one), each fetching up to `batchSize` jobs;
  // `onBatch(jobs)` runs as each batch is handed over, before pg-boss completes it.
  const startWorkers = async (batchSize, onBatch) => {
    for (let w = 0; w < opts.concurrency; w++) {
      await boss.work(QUEUE, { batchSize, burstWhenBatchFull: true, pollingIntervalSeconds: 0.5 }, async (jobs) =>
        onBatch(jobs, w),
      );
    }
  };
  if (opts.scenario === "rate") {
    const result = await fixedRate(
      opts,
      (onJob) =>
        startWorkers(opts.batch, (jobs) => {
          for (const job of jobs) onJob(job.data.n);
        }),
      (i) => boss.send(QUEUE, payload(i)),
      () => boss.offWork(QUEUE),
    );
    await boss.stop({ graceful: false, close: true, wait: true });
    return result;
  }
  emit({ ready: true });
  await waitForGo();
  const start = process.cpuUsage();
  const t0 = process.hrtime.bigint();
  let latencies;
  let n = opts.n;
  if (opts.scenario === "enqueue-batch") {
    const calls = Math.ceil(opts.n / opts.batch);
    latencies = await closedLoop(calls, opts.concurrency, (c) => {
      const size = Math.min(opts.batch, opts.n - c * opts.batch);
      const jobs = Array.from({ length: size }, (_, k) => ({ data: payload(c * opts.batch + k) }));
      return boss.insert(QUEUE, jobs);
    });
  } else if (opts.scenario === "enqueue-single") {
    latencies = await closedLoop(opts.n, opts.concurrency, (i) => boss.send(QUEUE, payload(i)));
  } else if (opts.scenario === "burn-down") {
    // The latency is a worker's cycle: from one batch handed to its handler to the next,
    // which is the completion of the first and the fetch of the second (the handler itself
    // only counts).
    latencies = [];
    let taken = 0;
    let finished;
    const allTaken = new Promise((r) => (finished = r));
    const last = new Array(opts.concurrency).fill(null);
    await startWorkers(opts.batch, (jobs, w) => {
      const now = process.hrtime.bigint();
      if (last[w] !== null) latencies.push(Number((now - last[w]) / 1000n));
      last[w] = now;
      taken += jobs.length;
      if (taken >= opts.n) finished();
    });
    await allTaken;
    // Waits for the handlers running and the completion of their batches.
    await boss.offWork(QUEUE, { wait: true });
    n = taken;
  } else {
    throw new Error(`unknown scenario ${opts.scenario}`);
  }
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  const cpu = process.cpuUsage(start);
  await boss.stop({ graceful: false, close: true, wait: true });
  if (opts.scenario === "burn-down") {
    const left = await countRows(opts.url, "SELECT count(*)::int AS n FROM pgboss.job WHERE state < 'completed'");
    if (left !== 0) throw new Error(`${left} jobs not completed after the burn-down`);
  }
  return { n, seconds, cpu_seconds: (cpu.user + cpu.system) / 1e6, latencies_us: latencies };
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const result = opts.system === "graphile-worker" ? await graphile(opts) : await pgboss(opts);
  await emit(result);
}

main().then(
  () => process.exit(0),
  (e) => {
    process.stderr.write(`peer.js: ${e.stack || e}\n`);
    process.exit(1);
  },
);
