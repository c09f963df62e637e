#!/usr/bin/env bash
# Runs the whole test suite; pytest's "no tests collected" (rc 5) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "run_tests: no tests were collected" >&2; exit 1; fi
exit "$rc"
