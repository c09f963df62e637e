#!/usr/bin/env bash
# Idempotent set-up of .venv-vllm: vLLM 0.33.0 for pdproto.integrations.vllm and tests/vllm.
# A virtualenv of its own: vLLM's pins conflict with SGLang's (openai, xgrammar, torch, ...;
# ../shared/reference/vllm-kv-connector.md section 7). vLLM goes in with --no-deps (its own
# requirements pull a CUDA torch and GPU kernels); the "vllm" extra of pyproject.toml holds the
# pure-Python packages its connector, config and scheduler modules import. torch is the CPU
# build .venv pins. scripts/setup.sh calls this; a stamp file keyed on the inputs skips pip.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.33.0  # the vLLM release pdproto.integrations.vllm targets
PY=${PYTHON:-python3}
VENV=.venv-vllm
stamp=$VENV/.pdproto-installed
# One build at a time: a second caller (scripts/run_tests.sh, while setup.sh's background build
# runs) waits here for the first, then finds its stamp.
exec 9>"$VENV.lock"
flock 9
want=$(cat pyproject.toml scripts/setup_vllm.sh | sha256sum | cut -d' ' -f1)
[ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && exit 0
start=$(date +%s)
echo "setup: installing vLLM $VLLM_VERSION and its test packages into $VENV (first run takes a few minutes)"
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
quiet() {
  "$@" 2>&1 | { grep -v -e "WARNING: Location" -e "^ *!!" \
    -e "^ERROR: pip's dependency resolver does not currently take into account" \
    -e "^vllm [0-9.]* requires " || true; }
}
pip_install() { quiet $VENV/bin/python -m pip install -q --no-compile "$@"; }
pip_install "torch==2.13.0"  # first and pinned: an unpinned resolve pulls a multi-GB CUDA build
pip_install -e ".[engines,vllm]"
# xgrammar without its triton (1 GB; vLLM imports xgrammar, nothing here runs a kernel).
pip_install --no-deps "vllm==$VLLM_VERSION" "xgrammar==0.2.8"
# Byte-compiled on every core, once (PYTHONDONTWRITEBYTECODE is set on these machines).
purelib=$($VENV/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$VENV/bin/python -m compileall -q -j 0 "$purelib" >$VENV/compileall.log 2>&1 || true
echo "$want" > "$stamp"
echo "setup: $VENV ready in $(( $(date +%s) - start )) s, $(du -sm $VENV | cut -f1) MB"
