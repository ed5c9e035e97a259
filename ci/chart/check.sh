#!/usr/bin/env bash
# Chart checks, offline: lint, render every value set, validate the manifests against the
# Kubernetes schemas, reject bad values, then run the rendered pod for real (the binary
# with the pod's args, env and user) against a throwaway PostgreSQL and probe it where the
# chart points; finally the image check. Ends with `chart: N passed, M failed`.
#
#   bash ci/chart/check.sh          (OUTBOXD_BIN=path skips `cargo build`)
set -euo pipefail
cd "$(dirname "$0")/../.."

TMP_BASE="${TMPDIR:-/tmp}"
WORK="$(mktemp -d "$TMP_BASE/outboxd-chart.XXXXXX")"
# The pod's user (65532) and postgres must reach their files under it.
chmod 755 "$WORK"
PGDATA_DIR="$WORK/pgdata"
PG_CTL=""

as_postgres() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

cleanup() {
  if [ -n "$PG_CTL" ] && [ -f "$PGDATA_DIR/postmaster.pid" ]; then
    as_postgres "$PG_CTL" -D "$PGDATA_DIR" -m immediate stop >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# 1. Python tools in a venv of their own, cached per requirements file.
REQ=ci/chart/requirements.txt
VENV="$TMP_BASE/outboxd-ci-chart-venv-$(sha256sum "$REQ" | cut -c1-16)"
if [ ! -f "$VENV/.complete" ]; then
  echo "installing $(grep -v '^#' "$REQ" | tr '\n' ' ')into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ"
  touch "$VENV/.complete"
fi

# 2. The binary of this tree.
if [ -n "${OUTBOXD_BIN:-}" ]; then
  BIN="$OUTBOXD_BIN"
else
  cargo build --locked --quiet --bin outboxd
  BIN="$(realpath "${CARGO_TARGET_DIR:-target}")/debug/outboxd"
fi
"$BIN" --version

# 3. A throwaway PostgreSQL cluster (trust auth, loopback TCP only).
PG_BINDIR=""
for d in /usr/lib/postgresql/*/bin; do
  if [ -x "$d/initdb" ]; then PG_BINDIR="$d"; fi
done
if [ -z "$PG_BINDIR" ] && command -v pg_config >/dev/null && [ -x "$(pg_config --bindir)/initdb" ]; then
  PG_BINDIR="$(pg_config --bindir)"
fi
if [ -z "$PG_BINDIR" ]; then echo "no PostgreSQL server binaries (initdb) found" >&2; exit 1; fi
PG_CTL="$PG_BINDIR/pg_ctl"
PGPORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
mkdir -p "$PGDATA_DIR"
if [ "$(id -u)" = 0 ]; then chown postgres: "$PGDATA_DIR"; fi
as_postgres "$PG_BINDIR/initdb" -D "$PGDATA_DIR" -U postgres -A trust -E UTF8 --no-sync >/dev/null
as_postgres "$PG_CTL" -D "$PGDATA_DIR" -l "$PGDATA_DIR/server.log" -w \
  -o "-p $PGPORT -c listen_addresses=127.0.0.1 -c unix_socket_directories= -c fsync=off" start >/dev/null
echo "PostgreSQL $("$PG_BINDIR/postgres" --version | awk '{print $3}') on 127.0.0.1:$PGPORT"

# 4. The checks.
"$VENV/bin/python" ci/chart/check.py \
  --binary "$BIN" \
  --pg-url "postgres://postgres@127.0.0.1:$PGPORT/postgres" \
  --pg-bindir "$PG_BINDIR" \
  --work "$WORK" \
  --image-check ci/chart/image-check.sh
