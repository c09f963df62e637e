#!/usr/bin/env bash
# Runs the whole test suite (tests/vllm in .venv-vllm); pytest's "no tests collected" (rc 5) is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
# The tests start hundreds of interpreters (servers, decodes, engine rigs), each of which would
# otherwise compile the project's modules again: PYTHONDONTWRITEBYTECODE=1 (set on these machines)
# keeps Python from caching them, but it still reads the bytecode compileall writes here.
.venv/bin/python -m compileall -q -j 0 pdproto pdproto_server pdproto_demo tests bench >/dev/null
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "run_tests: no tests were collected" >&2; rc=1; fi
# tests/vllm in vLLM's own virtualenv (scripts/setup_vllm.sh; the main one leaves them out), with
# the same options: vLLM 0.33.0's pins conflict with SGLang's.
bash scripts/setup_vllm.sh  # waits for a build setup.sh left running (PDPROTO_VLLM_LATER)
.venv-vllm/bin/python -m pytest -q tests/vllm "$@"
vrc=$?
if [ "$vrc" -eq 5 ]; then echo "run_tests: no vLLM tests were collected" >&2; vrc=1; fi
[ "$rc" -ne 0 ] && exit "$rc"
exit "$vrc"
