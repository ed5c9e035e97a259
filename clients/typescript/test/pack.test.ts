// `npm pack` installs into an empty project; the README's example runs there against a
// real outboxd, and a strict TypeScript consumer type-checks against the declarations.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
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

test("npm pack installs into an empty project, whose README example runs against a real outboxd", async () => {
  const tarball = npm(["pack", "--pack-destination", project], PACKAGE).trim().split("\n").at(-1) ?? "";
  writeFileSync(join(project, "package.json"), JSON.stringify({ name: "consumer", private: true, type: "module" }));
  npm(["install", join(project, tarball), "pg@^8"], project);

  writeFileSync(join(project, "quickstart.mjs"), readmeExample("quickstart"));
  await fx.postgres.sql("postgres", "CREATE DATABASE app");
  const output = execFileSync(process.execPath, ["quickstart.mjs"], {
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

  // The declarations serve a strict TypeScript consumer (NodeNext resolution).
  writeFileSync(
    join(project, "consumer.ts"),
    `import { Worker, Outbox, Retry, type Intent, type HandlerContext } from "@outboxd/client";
const worker = new Worker({ endpoints: ["127.0.0.1:1"], apiKey: "obx_x", concurrency: 2 });
worker.handle("k", async (intent: Intent, ctx: HandlerContext): Promise<void> => {
  const body = intent.json<{ n: number }>();
  if (body.n > 1) throw new Retry("later", 1000);
  await ctx.submitting(async () => intent.payload.byteLength);
});
const outbox = new Outbox({ endpoints: ["127.0.0.1:1"], apiKey: "obx_x" });
export const pending: Promise<unknown> = outbox.enqueueDirect({ kind: "k", json: { n: 1 } });
`,
  );
  execFileSync(
    join(PACKAGE, "node_modules", ".bin", "tsc"),
    ["--noEmit", "--strict", "--module", "nodenext", "--moduleResolution", "nodenext", "--target", "es2022", "--types", "node", "--typeRoots", join(PACKAGE, "node_modules", "@types"), "consumer.ts"],
    { cwd: project, stdio: "inherit" },
  );
});
