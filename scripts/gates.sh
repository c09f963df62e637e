#!/usr/bin/env bash
# Schema and type gates, cheapest first. The first failing gate stops the run with a
# non-zero status and says which gate failed (make test calls this; tests/test_gates.py
# proves each gate bites). --no-mypy skips the slowest gate (the gate tests use it in
# scratch copies, where mypy has no cache).
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=.venv/bin/buf
PY=.venv/bin/python
run_mypy=1
for arg in "$@"; do
  case "$arg" in
    --no-mypy) run_mypy=0 ;;
    *) echo "usage: $0 [--no-mypy]" >&2; exit 2 ;;
  esac
done
step() { printf '== gate: %s\n' "$1"; }
fail() { echo "gate failed: $1" >&2; exit 1; }

step "buf lint"
$BUF lint || fail "buf lint (STANDARD + COMMENTS); fix the findings above"

step "buf format"
$BUF format --diff --exit-code || fail "buf format; run '.venv/bin/buf format -w'"

step "buf breaking (FILE) against compat/pdproto.v1.baseline.json"
$BUF breaking --against compat/pdproto.v1.baseline.json \
  || fail "buf breaking; schema changes must be additive (see docs/protocol.md)"

step "generated code matches protos"
# Regenerate in a scratch copy, never in place: a failed or interrupted run must
# not leave the working tree without its generated modules.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The copy holds no pdproto/v1: the script must write all of it, __init__.py included,
# so a hand edit to any file there (or a file the script no longer writes) shows up.
mkdir -p "$tmp/scripts"
cp -r protos "$tmp/protos"
cp scripts/gen_protos.py "$tmp/scripts/"
"$PY" "$tmp/scripts/gen_protos.py" >"$tmp/gen.log" 2>&1 \
  || { cat "$tmp/gen.log" >&2; fail "code generation (scripts/gen_protos.py)"; }
if ! diff -r -x __pycache__ pdproto/v1 "$tmp/pdproto/v1" >"$tmp/gen.diff"; then
  head -40 "$tmp/gen.diff"
  fail "generated code is stale; run 'make gen' and commit pdproto/v1"
fi

if [ "$run_mypy" -eq 1 ]; then
  step "mypy --strict pdproto pdproto_server pdproto_demo"
  $PY -m mypy --strict -p pdproto -p pdproto_server -p pdproto_demo || fail "mypy --strict"
fi
echo "== gates: all passed"
