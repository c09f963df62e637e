#!/usr/bin/env bash
# Idempotent set-up: Debian packages the engines need, then .venv with every Python package.
# Fast when already done (a stamp file keyed on the dependency files skips pip).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
for pkg in libibverbs1 git; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
SGLANG_VERSION=0.5.23  # the SGLang release pdproto.integrations.sglang targets
stamp=.venv/.pdproto-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing Python packages into .venv (first run takes a few minutes)"
  # Some machines list local wheel folders that do not exist; pip warns once per package.
  # Once SGLang is in (without its GPU requirements, below), every later pip run reports
  # those requirements as conflicts; they are expected, so they are dropped too.
  quiet() {
    "$@" 2>&1 | { grep -v -e "WARNING: Location" -e "^ *!!" \
      -e "^ERROR: pip's dependency resolver does not currently take into account" \
      -e "^sglang [0-9.]* requires " || true; }
  }
  # pip byte-compiles what it installs on one core (85 of 155 s here); compileall below uses every core.
  pip_install() { quiet .venv/bin/python -m pip install -q --no-compile "$@"; }
  pip_install --upgrade pip
  # torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
  pip_install "torch==2.13.0"
  pip_install -e ".[dev,engines,sglang]"
  # .venv-vllm builds meanwhile (about 100 s of mostly downloads and unpacking): after pdproto's own
  # editable build above, which both would otherwise write in this checkout at once.
  bash scripts/setup_vllm.sh &
  vllm_setup=$!
  # SGLang for the integration tests, without its requirements (a CUDA torch, GPU
  # kernels): the "sglang" extra above holds the ones its disaggregation modules import.
  pip_install --no-deps "sglang==$SGLANG_VERSION"
  # Compiled once here, as pip would have: with PYTHONDONTWRITEBYTECODE set (it is on these machines)
  # every process would otherwise compile each module it imports. Its errors are files written for
  # newer Pythons that nothing imports (pip skips them the same way); the log keeps them.
  purelib=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  .venv/bin/python -m compileall -q -j 0 "$purelib" >.venv/compileall.log 2>&1 || true
  echo "$want" > "$stamp"
fi
# vLLM 0.33.0 in a virtualenv of its own, for pdproto.integrations.vllm and tests/vllm.
# PDPROTO_VLLM_LATER=1 (`make test`): leave it building while the gates and the main tests run;
# scripts/run_tests.sh waits for it (setup_vllm.sh holds a lock) before tests/vllm.
if [ "${PDPROTO_VLLM_LATER:-}" = 1 ]; then
  [ -n "${vllm_setup:-}" ] || { bash scripts/setup_vllm.sh & }
elif [ -n "${vllm_setup:-}" ]; then
  wait "$vllm_setup"
else
  bash scripts/setup_vllm.sh
fi
