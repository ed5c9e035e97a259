#!/usr/bin/env bash
# The ecosystem's own tools against a live server, unmodified: promtool and
# prometheus_client's parsers read /metrics in both formats, the HTTP health endpoints
# answer, and buf curl decodes an error's google.rpc.BadRequest with nothing but the
# schema server reflection serves. Ends with `ecosystem: N passed, M failed`.
#
#   bash ci/ecosystem.sh        (OUTBOXD_BIN=path skips `cargo build`; BUF=path to buf;
#                                needs promtool: `apt-get install prometheus`)
set -euo pipefail
cd "$(dirname "$0")/.."

TMP_BASE="${TMPDIR:-/tmp}"
WORK="$(mktemp -d "$TMP_BASE/outboxd-ecosystem.XXXXXX")"
# The embedded cluster runs as postgres when we are root: it must reach its directory.
chmod 755 "$WORK"
SERVER_PID=""
cleanup() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok: $*"; }
bad() { failed=$((failed + 1)); echo "FAILED: $*"; }

command -v promtool >/dev/null || { echo "promtool not found (apt-get install prometheus)" >&2; exit 1; }
BUF="${BUF:-$TMP_BASE/outboxd-ci-buf/node_modules/.bin/buf}"
[ -x "$BUF" ] || BUF="$(command -v buf)" || { echo "buf not found (set BUF)" >&2; exit 1; }

# prometheus_client (the reference Python parsers, text and OpenMetrics) in a venv of its
# own, cached like the chart check's.
VENV="$TMP_BASE/outboxd-ci-prometheus-client-0.26.0"
if [ ! -f "$VENV/.complete" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check 'prometheus-client==0.26.0'
  touch "$VENV/.complete"
fi

if [ -n "${OUTBOXD_BIN:-}" ]; then
  BIN="$OUTBOXD_BIN"
else
  cargo build --locked --quiet --bin outboxd
  BIN="$(realpath "${CARGO_TARGET_DIR:-target}")/debug/outboxd"
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GRPC_PORT="$(free_port)"
ADMIN_PORT="$(free_port)"
ADMIN="http://127.0.0.1:$ADMIN_PORT"
export OUTBOX_EMBEDDED__DATA_DIR="$WORK/pgdata"
export OUTBOX_LISTEN_ADDR="127.0.0.1:$GRPC_PORT"
export OUTBOX_METRICS__LISTEN_ADDR="127.0.0.1:$ADMIN_PORT"
export OUTBOX_METRICS__KINDS="job"
"$BIN" serve >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 600); do
  if curl -fsS "$ADMIN/readyz" >/dev/null 2>&1; then break; fi
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log"; echo "server exited" >&2; exit 1; }
  sleep 0.1
done
curl -fsS "$ADMIN/readyz" >/dev/null || { cat "$WORK/server.log"; echo "server never ready" >&2; exit 1; }
echo "outboxd $("$BIN" --version | awk '{print $2}') on :$GRPC_PORT, admin on :$ADMIN_PORT"

# Some traffic, so that the counters and histograms have samples: an Enqueue, and the
# invalid request whose error buf curl decodes below.
KEY="$("$BIN" keys create --name ecosystem --tenant acme --scope produce --scope operate --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["api_key"])')"
call() { "$BUF" curl --protocol grpc --http2-prior-knowledge -H "authorization: Bearer $KEY" "$@"; }
call -d '{"intents":[{"kind":"job","payload":"e30="}]}' \
  "http://127.0.0.1:$GRPC_PORT/outbox.v1.OutboxService/Enqueue" >/dev/null

# 1. /metrics in both formats.
curl -fsS "$ADMIN/metrics" -D "$WORK/text.headers" -o "$WORK/metrics.txt"
curl -fsS -H 'Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5' \
  "$ADMIN/metrics" -D "$WORK/om.headers" -o "$WORK/metrics.om"
if grep -qi '^content-type: text/plain; version=0.0.4' "$WORK/text.headers" \
  && grep -qi '^content-type: application/openmetrics-text; version=1.0.0' "$WORK/om.headers"; then
  ok "Content-Type follows Accept (text 0.0.4 by default, OpenMetrics when asked)"
else
  bad "Content-Type: $(grep -i content-type "$WORK/text.headers" "$WORK/om.headers")"
fi
# promtool check metrics parses the text format 0.0.4 (it has no OpenMetrics parser):
# exit 0 and nothing to say, not even a lint hint.
if promtool check metrics <"$WORK/metrics.txt" >"$WORK/promtool.out" 2>&1 && [ ! -s "$WORK/promtool.out" ]; then
  ok "promtool check metrics: the text format passes with no findings"
else
  bad "promtool check metrics: $(cat "$WORK/promtool.out")"
fi
# prometheus_client's parsers, each on its format: every counter a counter (the text
# parser misread OpenMetrics counters as untyped families), the OpenMetrics one strict.
if "$VENV/bin/python" - "$WORK/metrics.txt" "$WORK/metrics.om" <<'EOF'
import sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families as text_families

text, om = (open(p).read() for p in sys.argv[1:3])
for name, families in (("text", text_families(text)), ("openmetrics", om_families(om))):
    types = {f.name: f.type for f in families}
    for counter in ("outbox_intents_enqueued", "outbox_rpc_requests", "process_cpu_seconds"):
        assert types.get(counter) == "counter", f"{name}: {counter} is {types.get(counter)}"
    assert types.get("outbox_intents") == "gauge", f"{name}: {types}"
    assert types.get("outbox_rpc_duration_seconds") == "histogram", f"{name}: {types}"
    untyped = sorted(n for n, t in types.items() if t in ("unknown", "untyped"))
    assert not untyped, f"{name}: untyped families {untyped}"
    print(f"{name}: {len(types)} families parsed")
EOF
then
  ok "prometheus_client parses the text format and OpenMetrics (every counter a counter)"
else
  bad "prometheus_client's parsers"
fi
if grep -q '^outbox_intents_enqueued_total{kind="job"} 1$' "$WORK/metrics.txt" \
  && grep -q '^outbox_intents{state="dead_lettered",region=""} 0$' "$WORK/metrics.txt" \
  && grep -q '^outbox_build_info{version=' "$WORK/metrics.txt" \
  && grep -q '^process_resident_memory_bytes ' "$WORK/metrics.txt" \
  && grep -q '^outbox_db_pool_connections{pool="tenant"} ' "$WORK/metrics.txt"; then
  ok "kind, zero-valued state, build, process and pool series are there"
else
  bad "expected series missing from $(wc -l <"$WORK/metrics.txt") lines"
fi

# 2. Health over plain HTTP.
if [ "$(curl -s -o /dev/null -w '%{http_code}' "$ADMIN/livez")" = 200 ] \
  && [ "$(curl -s -o /dev/null -w '%{http_code}' "$ADMIN/readyz")" = 200 ]; then
  ok "/livez and /readyz answer 200"
else
  bad "/livez or /readyz"
fi

# 3. buf curl: an invalid request's error, its BadRequest decoded with the schema that
# server reflection alone serves (buf curl prints details as type and base64 value).
set +e
call -d '{"id":"not-a-uuid"}' "http://127.0.0.1:$GRPC_PORT/outbox.v1.OutboxService/GetIntent" \
  >"$WORK/error.json" 2>&1
set -e
for symbol in outbox.v1.OutboxService google.rpc.BadRequest; do
  printf '{"fileContainingSymbol":"%s"}\n' "$symbol"
done | "$BUF" curl --protocol grpc --http2-prior-knowledge -d @- \
  "http://127.0.0.1:$GRPC_PORT/grpc.reflection.v1.ServerReflection/ServerReflectionInfo" \
  >"$WORK/reflection.json"
# The reflected files as one FileDescriptorSet (an image buf reads), and the detail's bytes.
python3 - "$WORK" <<'EOF'
import base64, json, sys
work = sys.argv[1]

def b64(s):
    return base64.b64decode(s + "=" * (-len(s) % 4), altchars=b"-_" if "-" in s or "_" in s else None)

def varint(n):
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out

decoder, text, files = json.JSONDecoder(), open(f"{work}/reflection.json").read(), {}
i = 0
while i < len(text):
    if text[i].isspace():
        i += 1
        continue
    reply, i = decoder.raw_decode(text, i)
    for f in reply["fileDescriptorResponse"]["fileDescriptorProto"]:
        files[f] = b64(f)
with open(f"{work}/schema.binpb", "wb") as out:
    for proto in files.values():
        out.write(b"\x0a" + varint(len(proto)) + proto)
error = json.loads(open(f"{work}/error.json").read())
detail = next(d for d in error["details"] if d["type"] == "google.rpc.BadRequest")
open(f"{work}/detail.binpb", "wb").write(b64(detail["value"]))
print(f"reflection served {len(files)} files; error {error['code']}: {error['message']}")
EOF
"$BUF" convert "$WORK/schema.binpb" --type google.rpc.BadRequest \
  --from "$WORK/detail.binpb#format=binpb" --to "$WORK/detail.json#format=json"
echo "decoded google.rpc.BadRequest: $(cat "$WORK/detail.json")"
if grep -q '"field": *"id"' "$WORK/detail.json"; then
  ok "buf curl + reflection: the BadRequest of an invalid GetIntent decodes to its field violation"
else
  bad "the BadRequest did not decode: $(cat "$WORK/detail.json")"
fi

# 4. Stops on SIGTERM, readiness first.
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" && ok "server stopped on SIGTERM" || bad "server exit on SIGTERM"
SERVER_PID=""
if grep -q 'ERROR' "$WORK/server.log"; then
  bad "the server logged errors (an invalid request is no error of the server's):"
  grep 'ERROR' "$WORK/server.log" | head -5
else
  ok "no ERROR in the server log (the invalid request was logged below it)"
fi
if grep -q 'Some(\|already exists' "$WORK/server.log"; then
  bad "start lines: $(grep 'Some(\|already exists' "$WORK/server.log")"
else
  ok "start lines without Some(..) nor sqlx's 'already exists' notice"
fi

echo "ecosystem: $passed passed, $failed failed"
[ "$failed" = 0 ]
