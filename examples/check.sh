#!/usr/bin/env bash
# End-to-end check of the producer examples (examples/python, examples/node) against a real
# outboxd with its embedded PostgreSQL, as CI runs it (.ci/run):
#
#   bash examples/check.sh
#
# It installs each producer's dependencies in isolation (Python: the SDK in clients/python),
# starts outboxd on free ports in a fresh temporary directory, runs both producers
# (each commits one order and rolls back another), then acts as a worker with the outboxd
# CLI: every committed intent must become claimable (and is acked), every rolled-back one
# must end DISCARDED and never be claimed, and the business rows must match. Last, the Node
# worker example (clients/typescript's SDK) handles two more intents and drains. It ends with
# `examples: N passed, M failed` and exits non-zero on any failure.
#
# Environment: OUTBOXD_BIN uses that binary instead of `cargo build`; KEEP_WORK=1 keeps the
# temporary directory (it is always kept on failure, for the logs).
set -euo pipefail
cd "$(dirname "$0")/.."

passed=0
failed=0
pass() { passed=$((passed + 1)); printf 'PASS  %s\n' "$1"; }
fail() {
  failed=$((failed + 1))
  printf 'FAIL  %s\n' "$1"
  shift
  [ $# = 0 ] || printf '      %s\n' "$@"
}
summarized=
summary() {
  summarized=1
  if [ "$failed" != 0 ] || [ -n "${KEEP_WORK:-}" ]; then echo "work dir kept: $WORK"; fi
  printf '\nexamples: %d passed, %d failed\n' "$passed" "$failed"
}
# A setup step failed: nothing after it can be checked.
abort() { fail "$@"; summary; exit 1; }
step() { printf '\n--> %s\n' "$*"; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-examples.XXXXXX")
# When run as root, outboxd runs PostgreSQL as `postgres`, which must reach the data dir.
chmod 755 "$WORK"

SERVER_PID=
stop_server() {
  [ -n "$SERVER_PID" ] || return 0
  local pid=$SERVER_PID status=0
  SERVER_PID=
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "outboxd did not stop within 30 s of SIGTERM; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" || status=$?
  return "$status"
}
cleanup() {
  local rc=$?
  stop_server || true
  if [ "$rc" = 0 ] && [ -z "${KEEP_WORK:-}" ]; then
    rm -rf "$WORK"
  elif [ -z "$summarized" ]; then
    echo "work dir kept: $WORK" >&2
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step "Python producer: dependencies (the SDK in clients/python)"
if python3 -m venv "$WORK/venv" >"$WORK/venv.log" 2>&1; then
  PY=("$WORK/venv/bin/python")
else
  # Debian without python3-venv: install into a plain directory instead.
  echo "python3 -m venv unavailable ($(tail -n1 "$WORK/venv.log")); using pip --target"
  rm -rf "$WORK/venv"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --target "$WORK/pylib" -r examples/python/requirements.txt || abort "Python dependencies install"
  PY=(env "PYTHONPATH=$WORK/pylib" python3)
fi
if [ -x "$WORK/venv/bin/python" ]; then
  "${PY[@]}" -m pip install --quiet --disable-pip-version-check \
    -r examples/python/requirements.txt || abort "Python dependencies install"
fi

step "Node producer and worker: dependencies (the SDK in clients/typescript, built first)"
{ npm ci --prefix clients/typescript --no-audit --no-fund --loglevel=error &&
  npm run --prefix clients/typescript --silent build; } ||
  abort "TypeScript SDK build (npm ci, npm run build in clients/typescript)"
npm ci --prefix examples/node --no-audit --no-fund --loglevel=error ||
  abort "Node dependencies install (npm ci)"

step "outboxd"
if [ -n "${OUTBOXD_BIN:-}" ]; then
  OUTBOXD=$OUTBOXD_BIN
else
  cargo build --locked --quiet --bin outboxd || abort "cargo build outboxd"
  OUTBOXD=target/debug/outboxd
fi
# Two free ports: the embedded PostgreSQL and the gRPC listener.
read -r PG_PORT GRPC_PORT < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
SERVER=127.0.0.1:$GRPC_PORT
env -u OUTBOX_DATABASE__URL NO_COLOR=1 \
  OUTBOX_EMBEDDED__DATA_DIR="$WORK/pgdata" OUTBOX_EMBEDDED__PORT="$PG_PORT" \
  OUTBOX_LISTEN_ADDR="$SERVER" "$OUTBOXD" >"$WORK/outboxd.log" 2>&1 &
SERVER_PID=$!
deadline=$((SECONDS + 120))
until grep -q "outboxd serving gRPC" "$WORK/outboxd.log"; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
    tail -n 30 "$WORK/outboxd.log"
    abort "outboxd serves gRPC (embedded PostgreSQL on $PG_PORT, gRPC on $SERVER)"
  fi
  sleep 0.1
done
pass "outboxd serves gRPC on $SERVER (embedded PostgreSQL on port $PG_PORT)"

# Every call needs an API key: one for tenant "default" that produces, consumes and operates.
# `keys create` reaches the running server's embedded cluster through its data directory.
if ! OUTBOX_API_KEY=$(env -u OUTBOX_DATABASE__URL OUTBOX_EMBEDDED__DATA_DIR="$WORK/pgdata" \
  "$OUTBOXD" keys create --name examples --tenant default \
  --scope produce --scope consume --scope operate 2>>"$WORK/outboxd.log"); then
  abort "outboxd keys create"
fi
export OUTBOX_API_KEY
pass "API key created for tenant default"

# psql-free SQL: `sql URL QUERY [PARAM...]` prints the first column of the first row.
sql() {
  "${PY[@]}" -c 'import sys, psycopg
with psycopg.connect(sys.argv[1]) as conn:
    print(conn.execute(sys.argv[2], sys.argv[3:]).fetchone()[0])' "$@"
}
# outboxd CLI, as the worker and the operator.
cli() { "$OUTBOXD" "$@" --server "http://$SERVER" --json; }
# Reads JSON on stdin and prints the Python expression $1 evaluated on it (as `d`).
json() { python3 -c 'import json, sys; d = json.load(sys.stdin); print(eval(sys.argv[1]))' "$1"; }
# Claims as a worker, long-polling up to $1; appends intent id, lease id, payload to claimed.tsv.
claim() {
  cli claim --worker examples-check --max 10 --wait "$1" | json '"\n".join(
    "\t".join([l["intent"]["id"], l["lease_id"], l["intent"]["payload"]]) for l in d)' |
    sed '/^$/d' >>"$WORK/claimed.tsv" || echo "claim failed (see above)"
}
state_of() { cli intents get "$1" | json 'd["intent"]["state"]' || echo "unknown"; }

# Each producer prints, last, {"committed": [...], "rolled_back": [...]}; this keeps one
# row per order: producer, database URL, outcome, order id, intent id, state at enqueue.
: >"$WORK/orders.tsv"
run_producer() {
  local name=$1 url=$2
  shift 2
  step "$name producer ($url)"
  if ! OUTBOX_PRODUCER_DATABASE_URL=$url OUTBOX_SERVER=$SERVER "$@" >"$WORK/$name.out"; then
    cat "$WORK/$name.out"
    fail "$name: producer runs" "see above; outboxd log: $WORK/outboxd.log"
    return
  fi
  cat "$WORK/$name.out"
  local rows
  if rows=$(tail -n1 "$WORK/$name.out" | python3 -c '
import json, sys
name, url = sys.argv[1:]
result = json.load(sys.stdin)
assert len(result["committed"]) == 1 and len(result["rolled_back"]) == 1, result
for outcome in ("committed", "rolled_back"):
    for r in result[outcome]:
        print(name, url, outcome, r["order_id"], r["intent_id"], r["state"], sep="\t")
' "$name" "$url") && ! grep -qv 'INTENT_STATE_STAGED$' <<<"$rows"; then
    echo "$rows" >>"$WORK/orders.tsv"
    pass "$name: producer commits one order and rolls back one, intents STAGED at enqueue"
  else
    fail "$name: producer commits one order and rolls back one, intents STAGED at enqueue" \
      "unexpected output: $(tail -n1 "$WORK/$name.out")"
  fi
}
DB=postgres://postgres@127.0.0.1:$PG_PORT
# Python: orders in the outbox's own database, token from outbox.txn_token().
run_producer python "$DB/outbox" "${PY[@]}" examples/python/producer.py
# Node: orders in another database of the cluster, token from plain SQL.
run_producer node "$DB/shop" node examples/node/producer.js

step "worker: claim until every committed intent is leased (deadline 15 s)"
committed_ids=$(awk -F'\t' '$3 == "committed" { print $5 }' "$WORK/orders.tsv")
: >"$WORK/claimed.tsv" # intent id, lease id, payload
missing=$committed_ids
deadline=$((SECONDS + 15))
while [ -n "$missing" ] && [ "$SECONDS" -lt "$deadline" ]; do
  # Long-poll: returns as soon as a promoted intent is available.
  claim 2s
  missing=$(grep -vxFf <(cut -f1 "$WORK/claimed.tsv") <<<"$committed_ids" || true)
done
cut -f1,2 "$WORK/claimed.tsv" | sed 's/^/claimed /; s/\t/  lease /'

step "rolled-back intents: resolved to DISCARDED (deadline 10 s), then one more claim"
deadline=$((SECONDS + 10))
while read -r id; do
  until [ "$(state_of "$id")" = DISCARDED ] || [ "$SECONDS" -ge "$deadline" ]; do sleep 0.1; done
  echo "$id $(state_of "$id")"
done < <(awk -F'\t' '$3 == "rolled_back" { print $5 }' "$WORK/orders.tsv")
# Everything resolved by now: whatever is still claimable would show up here.
claim 1s

step "results"
while IFS=$'\t' read -r name url outcome order_id intent_id _ <&3; do
  rows=$(sql "$url" "SELECT count(*) FROM orders WHERE id = %s" "$order_id" || echo "unknown")
  claimed=$(grep -F "$intent_id" "$WORK/claimed.tsv" || true)
  state=$(state_of "$intent_id")
  if [ "$outcome" = committed ]; then
    payload_order=$(cut -f3 <<<"$claimed" | json 'd["order_id"]' 2>/dev/null || true)
    if [ -n "$claimed" ] && [ "$payload_order" = "$order_id" ]; then
      pass "$name: committed intent $intent_id claimed by a worker, payload names order $order_id"
    else
      fail "$name: committed intent $intent_id claimed by a worker, payload names order $order_id" \
        "claimed: ${claimed:-never}; state now: $state"
    fi
    ack=$(cli ack --intent "$intent_id" --lease "$(cut -f2 <<<"$claimed")" 2>&1 || true)
    if [ "$(json 'd[0]["state"]' <<<"$ack" 2>/dev/null)" = DELIVERED ] &&
      [ "$(state_of "$intent_id")" = DELIVERED ]; then
      pass "$name: worker acks it, intent DELIVERED"
    else
      fail "$name: worker acks it, intent DELIVERED" "ack answered: $ack"
    fi
    if [ "$rows" = 1 ]; then
      pass "$name: committed order $order_id exists"
    else
      fail "$name: committed order $order_id exists" "rows with id $order_id: $rows"
    fi
  else
    if [ "$state" = DISCARDED ]; then
      pass "$name: rolled-back intent $intent_id DISCARDED"
    else
      fail "$name: rolled-back intent $intent_id DISCARDED" "state: $state"
    fi
    if [ -z "$claimed" ]; then
      pass "$name: rolled-back intent $intent_id never claimed"
    else
      fail "$name: rolled-back intent $intent_id never claimed" "claimed: $claimed"
    fi
    if [ "$rows" = 0 ]; then
      pass "$name: rolled-back order $order_id does not exist"
    else
      fail "$name: rolled-back order $order_id does not exist" "rows with id $order_id: $rows"
    fi
  fi
done 3<"$WORK/orders.tsv"

step "Node worker (the SDK): handles two order.created intents, then drains and exits"
for n in 1 2; do
  cli enqueue --kind order.created --payload "{\"order_id\": $((900000 + n))}" >/dev/null ||
    fail "node worker: enqueue order.created $n"
done
if out=$(OUTBOX_SERVER=$SERVER OUTBOX_WORKER_STOP_AFTER=2 timeout 60 node examples/node/worker.js) &&
  echo "$out" && [ "$(grep -c ' handled ' <<<"$out")" = 2 ] &&
  [ "$(tail -n1 <<<"$out" | json 'd["acked"]')" = 2 ]; then
  pass "node worker: two intents handled and acknowledged, then a clean exit"
else
  fail "node worker: two intents handled and acknowledged, then a clean exit" "output: ${out:-none}"
fi

step "stop outboxd (SIGTERM), which stops its embedded PostgreSQL"
if stop_server && ! [ -e "$WORK/pgdata/postmaster.pid" ]; then
  pass "outboxd stops cleanly on SIGTERM, embedded PostgreSQL with it"
else
  tail -n 20 "$WORK/outboxd.log"
  fail "outboxd stops cleanly on SIGTERM, embedded PostgreSQL with it"
fi

summary
[ "$failed" = 0 ]
