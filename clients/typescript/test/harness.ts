// Test harness: a throwaway PostgreSQL cluster and real outboxd servers on 127.0.0.1.
// As root, PostgreSQL runs as `postgres` (it refuses root); otherwise as the caller.
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { chmodSync, chownSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer, type AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import pg from "pg";
import { Connection } from "../src/index.js";
import { IntentState } from "../src/gen/outbox/v1/outbox_pb.js";

export const REPO = resolve(dirname(fileURLToPath(import.meta.url)), "../../../..");
export const PACKAGE = resolve(REPO, "clients/typescript");
export const OUTBOXD = process.env["OUTBOXD_BIN"] ?? join(REPO, "target/debug/outboxd");
const ROOT = process.getuid?.() === 0;

/** Releases since the tenancy split need a fleet login for work across tenants; older ones refuse the variable. */
let fleet: boolean | undefined;
function needsFleet(): boolean {
  fleet ??= execFileSync(OUTBOXD, ["--help"], { encoding: "utf8" }).includes("OUTBOX_DATABASE__FLEET_URL");
  return fleet;
}
function fleetEnv(postgres: Postgres): Record<string, string> {
  return needsFleet() ? { OUTBOX_DATABASE__FLEET_URL: postgres.url("outbox", "outboxd_fleet_login") } : {};
}

/** A free TCP port on 127.0.0.1. */
export async function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as AddressInfo;
      server.close(() => resolvePort(port));
    });
  });
}

/** Polls `check` until it returns a truthy value or the deadline passes. */
export async function waitFor<T>(what: string, check: () => Promise<T> | T, timeoutMs = 20_000): Promise<NonNullable<T>> {
  const deadline = performance.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    try {
      const value = await check();
      if (value) return value;
    } catch (error) {
      last = error;
    }
    if (performance.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${last instanceof Error ? `: ${last.message}` : ""}`);
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}

function pgBin(name: string): string {
  const base = "/usr/lib/postgresql";
  if (existsSync(base)) {
    const versions = readdirSync(base)
      .filter((v) => existsSync(join(base, v, "bin", name)))
      .sort((a, b) => Number(b) - Number(a));
    if (versions[0] !== undefined) return join(base, versions[0], "bin", name);
  }
  return name; // on PATH
}

function asPostgres(command: string, args: string[]): [string, string[]] {
  return ROOT ? ["runuser", ["-u", "postgres", "--", command, ...args]] : [command, args];
}

export class Postgres {
  readonly dir: string;
  readonly port: number;
  private constructor(dir: string, port: number) {
    this.dir = dir;
    this.port = port;
  }

  static async start(): Promise<Postgres> {
    const dir = mkdtempSync(join(tmpdir(), "outboxd-ts-"));
    chmodSync(dir, 0o755);
    const data = join(dir, "pgdata");
    if (ROOT) {
      const uid = Number(execFileSync("id", ["-u", "postgres"]).toString().trim());
      const gid = Number(execFileSync("id", ["-g", "postgres"]).toString().trim());
      chownSync(dir, uid, gid);
    }
    const port = await freePort();
    const run = (cmd: string, args: string[]): void => {
      const [c, a] = asPostgres(cmd, args);
      execFileSync(c, a, { stdio: ["ignore", "pipe", "pipe"] });
    };
    run(pgBin("initdb"), ["-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"]);
    run(pgBin("pg_ctl"), [
      "-D",
      data,
      "-l",
      join(dir, "postgres.log"),
      "-w",
      "-o",
      // track_commit_timestamp: commit times order the intents of an ordering key.
      `-p ${port} -k ${dir} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 -c track_commit_timestamp=on`,
      "start",
    ]);
    const cluster = new Postgres(dir, port);
    await cluster.sql("postgres", "CREATE DATABASE outbox");
    await cluster.sql("postgres", "CREATE ROLE outboxd LOGIN");
    // Work across tenants (sweeps, promotion) runs as a member of outboxd_fleet, which the
    // migrations create and grant to the login OUTBOX_DATABASE__FLEET_URL names.
    await cluster.sql("postgres", "CREATE ROLE outboxd_fleet_login LOGIN");
    return cluster;
  }

  url(database: string, user = "postgres"): string {
    return `postgres://${user}@127.0.0.1:${this.port}/${database}`;
  }

  async sql(database: string, text: string, values: unknown[] = []): Promise<pg.QueryResult> {
    const client = new pg.Client({ connectionString: this.url(database) });
    await client.connect();
    try {
      return await client.query(text, values);
    } finally {
      await client.end();
    }
  }

  stop(): void {
    const [c, a] = asPostgres(pgBin("pg_ctl"), ["-D", join(this.dir, "pgdata"), "-m", "immediate", "-w", "stop"]);
    try {
      execFileSync(c, a, { stdio: "ignore" });
    } catch {
      // already stopped
    }
    rmSync(this.dir, { recursive: true, force: true });
  }
}

export class Server {
  readonly endpoint: string;
  readonly process: ChildProcess;
  readonly log: string;
  private constructor(endpoint: string, child: ChildProcess, log: string) {
    this.endpoint = endpoint;
    this.process = child;
    this.log = log;
  }

  /** Starts outboxd on `postgres` (migrating as its owner, serving as the `outboxd` role). */
  static async start(postgres: Postgres, env: Record<string, string> = {}): Promise<Server> {
    if (!existsSync(OUTBOXD)) throw new Error(`no outboxd binary at ${OUTBOXD} (set OUTBOXD_BIN)`);
    const port = await freePort();
    const endpoint = `127.0.0.1:${port}`;
    const log = join(postgres.dir, `outboxd-${port}.log`);
    writeFileSync(log, "");
    const child = spawn(OUTBOXD, ["serve"], {
      env: {
        PATH: process.env["PATH"] ?? "/usr/bin:/bin",
        NO_COLOR: "1",
        OUTBOX_DATABASE__URL: postgres.url("outbox", "outboxd"),
        ...fleetEnv(postgres),
        OUTBOX_DATABASE__MIGRATION_URL: postgres.url("outbox"),
        OUTBOX_LISTEN_ADDR: endpoint,
        OUTBOX_METRICS__LISTEN_ADDR: "",
        OUTBOX_RETRY__BASE: "100ms",
        OUTBOX_RETRY__CAP: "1s",
        OUTBOX_MAINTENANCE__RESCUE_INTERVAL: "200ms",
        OUTBOX_SHUTDOWN__GRACE: "5s",
        ...env,
      },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let output = "";
    const append = (chunk: Buffer): void => {
      output += chunk.toString();
      writeFileSync(log, chunk, { flag: "a" });
    };
    child.stdout?.on("data", append);
    child.stderr?.on("data", append);
    const exited = (): boolean => child.exitCode !== null || child.signalCode !== null;
    await waitFor(`outboxd serving on ${endpoint}`, () => output.includes("outboxd serving gRPC") || exited(), 60_000);
    if (exited()) throw new Error(`outboxd exited (${String(child.exitCode ?? child.signalCode)}): ${output}`);
    return new Server(endpoint, child, log);
  }

  async stop(): Promise<void> {
    if (this.process.exitCode !== null || this.process.signalCode !== null) return;
    const exited = new Promise((r) => this.process.once("exit", r));
    this.process.kill("SIGTERM");
    await exited;
  }

  output(): string {
    return readFileSync(this.log, "utf8");
  }
}

/** Mints an API key for tenant `default` with every scope. */
export function createKey(postgres: Postgres, name = "ts-tests"): string {
  return execFileSync(OUTBOXD, ["keys", "create", "--name", name, "--tenant", "default", "--scope", "admin"], {
    env: {
      PATH: process.env["PATH"] ?? "/usr/bin:/bin",
      NO_COLOR: "1",
      OUTBOX_DATABASE__MIGRATION_URL: postgres.url("outbox"),
      OUTBOX_DATABASE__URL: postgres.url("outbox", "outboxd"),
      ...fleetEnv(postgres),
    },
    stdio: ["ignore", "pipe", "pipe"],
  })
    .toString()
    .trim();
}

/** One cluster, `servers` outboxd replicas on it, a key, and an operator connection. */
export class Fixture {
  readonly postgres: Postgres;
  readonly servers: Server[];
  readonly apiKey: string;
  readonly ops: Connection;
  private constructor(postgres: Postgres, servers: Server[], apiKey: string) {
    this.postgres = postgres;
    this.servers = servers;
    this.apiKey = apiKey;
    this.ops = new Connection({ endpoints: servers.map((s) => s.endpoint), apiKey });
  }

  static async start(servers = 1, env: Record<string, string> = {}): Promise<Fixture> {
    const postgres = await Postgres.start();
    try {
      const started: Server[] = [];
      for (let i = 0; i < servers; i++) started.push(await Server.start(postgres, env));
      return new Fixture(postgres, started, createKey(postgres));
    } catch (error) {
      postgres.stop();
      throw error;
    }
  }

  get endpoints(): string[] {
    return this.servers.map((s) => s.endpoint);
  }

  async intent(id: string): Promise<{ state: string; attempts: number; lastError: string; workerId: string }> {
    const reply = await this.ops.call((c, o) => c.getIntent({ id }, o), { budgetMs: 5_000, tryTimeoutMs: 5_000 });
    const intent = reply.intent;
    const { stateName } = await import("../src/producer.js");
    return {
      state: stateName(intent?.state ?? IntentState.UNSPECIFIED),
      attempts: intent?.attempts ?? 0,
      lastError: intent?.lastError ?? "",
      workerId: intent?.workerId ?? "",
    };
  }

  /** Counts of intents per state (all regions). */
  async counts(): Promise<Record<string, number>> {
    const reply = await this.ops.call((c, o) => c.getQueueStats({}, o), { budgetMs: 5_000, tryTimeoutMs: 5_000 });
    const { stateName } = await import("../src/producer.js");
    const counts: Record<string, number> = {};
    for (const c of reply.counts) counts[stateName(c.state)] = (counts[stateName(c.state)] ?? 0) + Number(c.count);
    return counts;
  }

  async stop(): Promise<void> {
    this.ops.close();
    for (const server of this.servers) await server.stop();
    this.postgres.stop();
  }
}
