#!/usr/bin/env bash
# The TypeScript SDK's CI, from the repository root:
#
#   bash clients/typescript/check.sh
#
# npm ci; the generated code is what proto/ generates today; tsc (strict) for the package
# and the tests; no `any` in the published declarations; eslint; then the tests (node's
# runner) against real outboxd processes and a throwaway PostgreSQL cluster, including
# `npm pack` installed into an empty project whose README example runs. Exits non-zero
# on any failure.
#
# Needs Node 20+, npm (the npm registry), PostgreSQL server binaries (/usr/lib/postgresql)
# and an outboxd binary: OUTBOXD_BIN, else target/debug/outboxd, else `cargo build`.
set -euo pipefail
cd "$(dirname "$0")"
REPO=$(cd ../.. && pwd)

step() { printf '\n--> %s\n' "$*"; }
die() {
  printf 'FAIL  %s\n' "$*" >&2
  exit 1
}

step "node and npm"
node -e 'const [major] = process.versions.node.split(".").map(Number);
if (major < 20) { console.error(`Node ${process.versions.node}: 20 or newer is needed`); process.exit(1); }
console.log(`node ${process.versions.node}`)' || die "Node 20 or newer"
echo "npm $(npm --version)"

step "npm ci"
npm ci --no-audit --no-fund --loglevel=error || die "npm ci"

step "generated code is current (buf generate ../../proto)"
GEN=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-ts-gen.XXXXXX")
trap 'rm -rf "$GEN"' EXIT
npx --no-install buf generate ../../proto --template buf.gen.yaml --output "$GEN" || die "buf generate"
if ! diff -ru src/gen "$GEN/src/gen"; then
  die "src/gen differs from what proto/ generates: run 'npm run generate' in clients/typescript and commit"
fi
echo "src/gen matches proto/"

step "tsc --strict (package and tests)"
rm -rf dist build
npx --no-install tsc -p tsconfig.build.json || die "tsc (package)"
npx --no-install tsc -p tsconfig.json || die "tsc (tests)"
# No `any` in what users see: the declarations, comments stripped.
node -e '
const fs = require("node:fs"), path = require("node:path");
const files = fs.readdirSync("dist", { recursive: true }).filter((f) => f.endsWith(".d.ts"));
let bad = 0;
for (const f of files) {
  const text = fs.readFileSync(path.join("dist", f), "utf8").replace(/\/\*[\s\S]*?\*\//g, "").replace(/\/\/.*$/gm, "");
  for (const m of text.matchAll(/\bany\b/g)) { bad++; console.error(`dist/${f}: any at offset ${m.index}`); }
}
console.log(`${files.length} declaration files, ${bad} any`);
process.exit(bad ? 1 : 0);' || die "no any in the public API"

step "eslint"
npx --no-install eslint . || die "eslint"

step "outboxd binary"
if [ -n "${OUTBOXD_BIN:-}" ]; then
  [ -x "$OUTBOXD_BIN" ] || die "OUTBOXD_BIN=$OUTBOXD_BIN is not an executable"
elif [ -x "$REPO/target/debug/outboxd" ]; then
  export OUTBOXD_BIN=$REPO/target/debug/outboxd
elif command -v cargo >/dev/null; then
  (cd "$REPO" && cargo build --locked --quiet --bin outboxd) || die "cargo build outboxd"
  export OUTBOXD_BIN=$REPO/target/debug/outboxd
else
  die "no outboxd binary: set OUTBOXD_BIN or build target/debug/outboxd"
fi
echo "$OUTBOXD_BIN"
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null ||
  die "PostgreSQL server binaries (apt-get install postgresql)"

step "tests (node --test, real outboxd and PostgreSQL)"
node --test --test-concurrency=1 --test-reporter=spec build/test/*.test.js || die "tests"
