#!/usr/bin/env bash
# CI smoke run of the benchmarks (issue 7): `outboxd-bench all --smoke` — outboxd, the
# raw-SQL ceiling (pgbench), graphile-worker and pg-boss with small N on a private
# embedded PostgreSQL, and outboxd's console pages over a small seeded outbox (20,000
# intents, 5 requests a page: `--console-intents`, `--console-requests`) — printing the
# table. Figures only, no thresholds: a slow or shared CI machine must not fail the build.
# Exits non-zero only when the harness itself fails (a scenario errors, a server does not
# start); a peer that cannot run (no pgbench, no Node, npm unreachable) is reported as
# "not run: reason" in the table instead.
#
# Debug profile on purpose: CI already builds it for the tests, and a release build of the
# whole dependency tree costs minutes more (the smoke N is small enough either way).
# Extra arguments go to `outboxd-bench all`, e.g. `bash ci/bench-smoke.sh --no-peers`.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "build outboxd-bench (debug)"
cargo build --locked -p outboxd-bench

step "npm peers (bench/package.json, pinned; skipped when npm is missing or fails)"
if [ -d bench/node_modules/graphile-worker ] && [ -d bench/node_modules/pg-boss ]; then
  echo "already installed"
elif command -v npm >/dev/null; then
  npm ci --prefix bench --no-audit --no-fund --silent \
    || echo "npm ci failed: the table will say the npm peers did not run"
else
  echo "no npm: the table will say the npm peers did not run"
fi

step "outboxd-bench all --smoke"
./target/debug/outboxd-bench all --smoke "$@"
