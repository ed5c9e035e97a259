// Peer harness for outboxd-bench: runs one scenario against graphile-worker or pg-boss on
// the database given, and prints one JSON line with the figures. The Rust harness reads it,
// and measures PostgreSQL (CPU, commits, WAL) itself around the measured section.
//
//   node peer.js <graphile-worker|pg-boss> <enqueue-batch|enqueue-single|burn-down|rate> \
//       --url URL --n N [--concurrency C] [--batch B] [--rate R] [--local-queue N]
//
// `rate` is the fixed-rate scenario: N jobs sent one per call at R/s (open loop) while C
// workers of the library's own kind (graphile-worker's runner, pg-boss `work`) take them;
// the latency is from the send returning to the handler starting.
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

async function graphile(opts) {
  const { makeWorkerUtils, run } = require("graphile-worker");
  const utils = await makeWorkerUtils({ connectionString: opts.url });
  await utils.migrate();
  const maxPool = Math.max(opts.concurrency + 2, 10);
  if (opts.scenario === "rate") {
    // The runner woken by LISTEN/NOTIFY on every new job; with --local-queue N, fetching up
    // to N jobs at a time into its local queue (and completing in batches).
    let runner;
    const result = await fixedRate(
      opts,
      async (onJob) => {
        runner = await run({
          connectionString: opts.url,
          concurrency: opts.concurrency,
          maxPoolSize: maxPool,
          noHandleSignals: true,
          pollInterval: 1000,
          taskList: { [QUEUE]: async (job) => onJob(job.n) }, // job: the payload
          preset: opts["local-queue"]
            ? { worker: { localQueue: { size: opts["local-queue"] }, completeJobBatchDelay: 0 } }
            : undefined,
          logger: quietLogger(),
        });
      },
      (i) => utils.addJob(QUEUE, payload(i)),
      () => runner.stop(),
    );
    await utils.release();
    return result;
  }
  if (opts.scenario === "burn-down") {
    // The runner claims through its local queue in batches of `batch` and completes in
    // batches (the library's documented batching knobs), with `concurrency` job slots.
    let done = 0;
    let finished;
    const allDone = new Promise((r) => (finished = r));
    emit({ ready: true });
    await waitForGo();
    const start = process.cpuUsage();
    const t0 = process.hrtime.bigint();
    const runner = await run({
      connectionString: opts.url,
      concurrency: opts.concurrency,
      maxPoolSize: maxPool,
      noHandleSignals: true,
      pollInterval: 1000,
      taskList: {
        [QUEUE]: async () => {
          done += 1;
          if (done === opts.n) finished();
        },
      },
      preset: {
        worker: {
          localQueue: { size: opts.batch },
          completeJobBatchDelay: 0,
        },
      },
      logger: quietLogger(),
    });
    await allDone;
    const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
    // Completions are batched asynchronously: stop() flushes them before returning.
    await runner.stop();
    const stopSeconds = Number(process.hrtime.bigint() - t0) / 1e9;
    const cpu = process.cpuUsage(start);
    await utils.release();
    return { n: done, seconds: stopSeconds, handler_seconds: seconds, cpu_seconds: (cpu.user + cpu.system) / 1e6, latencies_us: [] };
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

// --- pg-boss ------------------------------------------------------------------------------

async function pgboss(opts) {
  const PgBoss = require("pg-boss");
  const boss = new PgBoss({
    connectionString: opts.url,
    max: Math.max(opts.concurrency + 2, 10),
    // No background maintenance or scheduling inside the measured window.
    supervise: false,
    schedule: false,
  });
  boss.on("error", (e) => process.stderr.write(`pg-boss: ${e.message}\n`));
  await boss.start();
  await boss.createQueue(QUEUE);
  if (opts.scenario === "rate") {
    // pg-boss workers poll (it has no LISTEN/NOTIFY): each fetches up to `batch` jobs (as
    // outboxd's workers claim up to 100) and waits the shortest interval pg-boss allows,
    // 0.5 s, before its next fetch.
    const result = await fixedRate(
      opts,
      async (onJob) => {
        for (let w = 0; w < opts.concurrency; w++) {
          await boss.work(QUEUE, { pollingIntervalSeconds: 0.5, batchSize: opts.batch }, async (jobs) => {
            for (const job of jobs) onJob(job.data.n);
          });
        }
      },
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
      const jobs = Array.from({ length: size }, (_, k) => ({
        name: QUEUE,
        data: payload(c * opts.batch + k),
      }));
      return boss.insert(jobs);
    });
  } else if (opts.scenario === "enqueue-single") {
    latencies = await closedLoop(opts.n, opts.concurrency, (i) => boss.send(QUEUE, payload(i)));
  } else if (opts.scenario === "burn-down") {
    // W workers: fetch a batch, complete it (one call per batch), until the queue is empty.
    latencies = [];
    let acked = 0;
    async function worker() {
      for (;;) {
        const c0 = process.hrtime.bigint();
        const jobs = await boss.fetch(QUEUE, { batchSize: opts.batch });
        if (!jobs || jobs.length === 0) {
          if (acked >= opts.n) return;
          await new Promise((r) => setTimeout(r, 1));
          continue;
        }
        await boss.complete(QUEUE, jobs.map((j) => j.id));
        acked += jobs.length;
        latencies.push(Number((process.hrtime.bigint() - c0) / 1000n));
      }
    }
    await Promise.all(Array.from({ length: opts.concurrency }, worker));
    n = acked;
  } else {
    throw new Error(`unknown scenario ${opts.scenario}`);
  }
  const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
  const cpu = process.cpuUsage(start);
  await boss.stop({ graceful: false, close: true, wait: true });
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
