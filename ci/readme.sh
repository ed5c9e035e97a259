#!/usr/bin/env bash
# Runs the README's commands as a reader would, taken from README.md itself (no copy is
# kept here): the two commands of "The two commands" (the test command, then the server
# in the background), then every block of "Five-minute walkthrough", in order, in one bash
# session. Fails on a non-zero exit, on a command that prints nothing, and on a variable
# a line sets to nothing (`export X=$(…)` hides its command's exit status).
set -euo pipefail
cd "$(dirname "$0")/.."

# The ```sh blocks of the README section titled $1, each followed by a line "@@END@@".
blocks() {
  awk -v title="## $1" '
    /^## / { inside = ($0 == title) }
    inside && /^```sh$/ { code = 1; next }
    inside && code && /^```$/ { code = 0; print "@@END@@"; next }
    inside && code { print }
  ' README.md
}

two_commands=$(blocks "The two commands")
serve=$(awk 'BEGIN { RS = "@@END@@\n" } NR == 1' <<<"$two_commands")
test_command=$(awk 'BEGIN { RS = "@@END@@\n" } NR == 2' <<<"$two_commands")
walkthrough=$(blocks "Five-minute walkthrough" | grep -v '^@@END@@$')
[ -n "$serve" ] && [ -n "$test_command" ] && [ -n "$walkthrough" ] || {
  echo "README.md: the two commands or the walkthrough were not found" >&2
  exit 2
}

# README_SKIP_TEST=1 (a developer's quick check) leaves the test command out.
if [ "${README_SKIP_TEST:-0}" != 1 ]; then
  echo "==> the README's test command: $test_command"
  bash -euo pipefail -c "$test_command"
fi

# The walkthrough, each line checked. Lines are simple commands or assignments.
script=$(mktemp)
trap 'rm -f "$script"' EXIT
{
  echo 'set -uo pipefail'
  echo 'die() { echo "walkthrough line $1 failed: $2" >&2; exit 1; }'
  n=0
  while IFS= read -r line; do
    n=$((n + 1))
    case "$line" in '' | '#'*) continue ;; esac
    printf 'echo %q\n' "\$ $line"
    if [[ $line =~ ^(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)= ]]; then
      var=${BASH_REMATCH[2]}
      printf '%s || die %d "it failed"\n' "$line" "$n"
      printf '[ -n "${%s:-}" ] && [ "$%s" != null ] || die %d %q\n' "$var" "$var" "$n" "$var is empty"
    else
      printf 'out=$(\n%s\n) || die %d "it failed"\n' "$line" "$n"
      printf '[ -n "$out" ] || die %d "it printed nothing"\n' "$n"
      echo 'printf "%s\n" "$out"'
    fi
  done <<<"$walkthrough"
} >"$script"

echo "==> the README's server command, in the background: $serve"
log=$(mktemp)
setsid bash -c "$serve" >"$log" 2>&1 &
server=$!
stop_server() {
  kill -TERM -- "-$server" 2>/dev/null || true
  for _ in $(seq 600); do kill -0 "$server" 2>/dev/null || return 0; sleep 0.1; done
  echo "the server did not stop within 60 s of SIGTERM" >&2
  kill -KILL -- "-$server" 2>/dev/null || true
  return 1
}
trap 'stop_server || true; rm -f "$script" "$log"' EXIT
ready=0
for _ in $(seq 1800); do
  if ! kill -0 "$server" 2>/dev/null; then break; fi
  if (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null; then ready=1; break; fi
  sleep 0.2
done
if [ "$ready" != 1 ]; then
  echo "the server never listened on 127.0.0.1:50051; its output:" >&2
  cat "$log" >&2
  exit 1
fi

echo "==> the walkthrough"
if ! bash "$script"; then
  echo "the server's output:" >&2
  tail -n 50 "$log" >&2
  exit 1
fi
stop_server
trap 'rm -f "$script" "$log"' EXIT
echo "README commands: ok"
