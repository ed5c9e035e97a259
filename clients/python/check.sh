#!/usr/bin/env bash
# The Python SDK's CI: bash clients/python/check.sh (from anywhere; runs as root or not).
#
# In a fresh venv under a temporary directory it installs the package with its dev extra,
# checks that the generated stubs match proto/ (scripts/gen_stubs.py --check), then runs
# ruff (lint and format), mypy --strict and pytest. The tests start their own PostgreSQL
# cluster (as the postgres user when root) and two outboxd replicas from OUTBOXD_BIN
# (default target/debug/outboxd, built with cargo if missing). Every step runs even if
# one before it failed; the exit status is non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")"
PKG=$PWD
REPO=$(cd ../.. && pwd)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/outboxd-python.XXXXXX")
chmod 755 "$WORK"
trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PYTHONDONTWRITEBYTECODE=1
export MYPY_CACHE_DIR=$WORK/mypy-cache RUFF_CACHE_DIR=$WORK/ruff-cache

failed=()
step() { printf '\n--> %s\n' "$1"; }
run() {
  local name=$1
  shift
  step "$name"
  "$@" || failed+=("$name")
}

step "venv and install (.[dev])"
if python3 -m venv "$WORK/venv" >"$WORK/venv.log" 2>&1; then
  PIP=("$WORK/venv/bin/python" -m pip)
else
  # Debian without python3-venv (no ensurepip): a bare venv, filled by the system pip.
  echo "python3 -m venv failed ($(tail -n1 "$WORK/venv.log")); trying --without-pip"
  rm -rf "$WORK/venv"
  python3 -m venv --without-pip "$WORK/venv" || { echo "FAIL: no venv"; exit 1; }
  PIP=(python3 -m pip --python "$WORK/venv/bin/python")
fi
PY=$WORK/venv/bin/python
# Built from a copy, so the source tree gets no build/ or egg-info.
cp -r "$PKG" "$WORK/src" && rm -rf "$WORK/src/build" "$WORK/src"/src/*.egg-info
if ! "${PIP[@]}" install --quiet "$WORK/src[dev]"; then
  echo "FAIL: pip install"
  exit 1
fi

run "stubs current (scripts/gen_stubs.py --check)" "$PY" scripts/gen_stubs.py --check
run "ruff check" "$WORK/venv/bin/ruff" check .
run "ruff format --check" "$WORK/venv/bin/ruff" format --check .
run "mypy --strict" "$WORK/venv/bin/mypy"

step "outboxd binary"
if [ -z "${OUTBOXD_BIN:-}" ]; then
  OUTBOXD_BIN=$REPO/target/debug/outboxd
  if [ ! -x "$OUTBOXD_BIN" ]; then
    (cd "$REPO" && cargo build --locked --quiet --bin outboxd) || failed+=("cargo build outboxd")
  fi
fi
export OUTBOXD_BIN
echo "$OUTBOXD_BIN"

# The installed package is what the tests import (not src/), so packaging is tested too.
run "pytest" env -C "$WORK" "$PY" -m pytest -p no:cacheprovider -q -ra --rootdir "$PKG" -c "$PKG/pyproject.toml" "$PKG/tests"

if [ ${#failed[@]} -ne 0 ]; then
  printf '\nclients/python: FAILED: %s\n' "${failed[*]}"
  exit 1
fi
printf '\nclients/python: all checks passed\n'
