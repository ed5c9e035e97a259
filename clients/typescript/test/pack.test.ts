// `npm pack` installs into an empty project; the README's example type-checks (strict) and
// runs there against a real outboxd, and strict TypeScript consumers type-check against the
// declarations (NodeNext and node10 resolution).
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { createRequire } from "node:module";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { Fixture, PACKAGE } from "./harness.js";

let fx: Fixture;
let project: string;
before(async () => {
  project = mkdtempSync(join(tmpdir(), "outboxd-ts-pack-"));
  fx = await Fixture.start(1);
});
after(async () => {
  if (project) rmSync(project, { recursive: true, force: true });
  await fx?.stop();
});

const npm = (args: string[], cwd: string): string =>
  execFileSync("npm", [...args, "--no-audit", "--no-fund", "--loglevel=error"], { cwd, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] });

/** The README block that follows `<!-- example: name -->`. */
function readmeExample(name: string): string {
  const readme = readFileSync(join(PACKAGE, "README.md"), "utf8");
  const match = new RegExp(`<!-- example: ${name} -->\\s*\`\`\`[a-z]*\\n([\\s\\S]*?)\`\`\``).exec(readme);
  if (!match?.[1]) throw new Error(`README.md has no example "${name}"`);
  return match[1];
}

/** tsc --strict in the consumer project (emitting next to the source unless `--noEmit`). */
function tsc(args: string[]): void {
  execFileSync(join(PACKAGE, "node_modules", ".bin", "tsc"), ["--strict", "--target", "es2022", "--types", "node", ...args], {
    cwd: project,
    stdio: "inherit",
  });
}

test("npm pack installs into an empty project, whose README example type-checks and runs against a real outboxd", async () => {
  const tarball = npm(["pack", "--pack-destination", project], PACKAGE).trim().split("\n").at(-1) ?? "";
  writeFileSync(join(project, "package.json"), JSON.stringify({ name: "consumer", private: true, type: "module" }));
  npm(["install", join(project, tarball), "pg@^8", "@types/pg@^8", "@types/node@^20"], project);

  // The quick start is TypeScript: strict tsc checks it, then node runs what tsc emits.
  writeFileSync(join(project, "quickstart.ts"), readmeExample("quickstart"));
  tsc(["--module", "nodenext", "--moduleResolution", "nodenext", "quickstart.ts"]);
  await fx.postgres.sql("postgres", "CREATE DATABASE app");
  const output = execFileSync(process.execPath, ["quickstart.js"], {
    cwd: project,
    encoding: "utf8",
    timeout: 60_000,
    env: {
      ...process.env,
      OUTBOX_SERVER: fx.endpoints[0] ?? "",
      OUTBOX_API_KEY: fx.apiKey,
      DATABASE_URL: fx.postgres.url("app"),
    },
  });
  assert.match(output, /sending to ada@example\.com/);
  assert.match(output, /delivered: 1/);

  // The declarations serve a strict TypeScript consumer: NodeNext resolution, and node10
  // (which reads no `exports`: `typesVersions` maps `@outboxd/client/gen`).
  writeFileSync(
    join(project, "consumer.ts"),
    `import { Worker, Outbox, Retry, type Intent, type HandlerContext } from "@outboxd/client";
import { FailOutcome, type Lease } from "@outboxd/client/gen";
const worker = new Worker({ endpoints: ["127.0.0.1:1"], apiKey: "obx_x", concurrency: 2 });
worker.handle("k", async (intent: Intent, ctx: HandlerContext): Promise<void> => {
  const body = intent.json<{ n: number }>();
  if (body.n > 1) throw new Retry("later", 1000);
  await ctx.submitting(async () => intent.payload.byteLength);
});
// A handler may return the submitted call's result (it is ignored).
worker.handle("charge", (intent, ctx) => ctx.submitting(async () => ({ id: intent.id, cents: 1999 })));
const outbox = new Outbox({ endpoints: ["127.0.0.1:1"], apiKey: "obx_x" });
export const pending: Promise<unknown> = outbox.enqueueDirect({ kind: "k", json: { n: 1 } });
export const outcome: FailOutcome = FailOutcome.RETRY;
export type Leased = Lease;
`,
  );
  tsc(["--noEmit", "--module", "nodenext", "--moduleResolution", "nodenext", "consumer.ts"]);
  tsc(["--noEmit", "--module", "commonjs", "--moduleResolution", "node10", "consumer.ts"]);
  // Resolvers that ask for neither `import` nor `types` (require, some bundlers) get the same files.
  const require = createRequire(join(project, "package.json"));
  assert.match(require.resolve("@outboxd/client"), /dist[/\\]index\.js$/);
  assert.match(require.resolve("@outboxd/client/gen"), /dist[/\\]gen[/\\]outbox[/\\]v1[/\\]outbox_pb\.js$/);
});
