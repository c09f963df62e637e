#!/usr/bin/env bash
# Schema and type gates; any failing gate fails the run (make test calls this).
set -euo pipefail
cd "$(dirname "$0")/.."
BUF=.venv/bin/buf
PY=.venv/bin/python
step() { printf '== gate: %s\n' "$1"; }

step "buf lint";   $BUF lint
step "buf format"; $BUF format --diff --exit-code
step "buf breaking (FILE) against compat/pdproto.v1.baseline.json"
$BUF breaking --against compat/pdproto.v1.baseline.json

step "generated code matches protos"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cp -r pdproto/v1 "$tmp/committed"
sh scripts/gen_protos.sh >/dev/null 2>&1
if ! diff -r -q "$tmp/committed" pdproto/v1 >/dev/null; then
  diff -r "$tmp/committed" pdproto/v1 | head -40 || true
  rm -rf pdproto/v1 && cp -r "$tmp/committed" pdproto/v1
  echo "gate failed: generated code is stale; run 'make gen' and commit pdproto/v1" >&2
  exit 1
fi

step "mypy --strict pdproto server"
$PY -m mypy --strict pdproto server
echo "== gates: all passed"
