#!/usr/bin/env bash
# GPU check for pdproto.transfer: VRAM buffers on both sides, torch gather on the device,
# Mooncake's CUDA build and NIXL VRAM descriptors. Meant for a CUDA 12 machine; not run in CI.
#
#   bash scripts/gpu_check.sh            # build .venv-gpu (needs PyPI), then test and bench
#   PY=/path/to/python bash scripts/gpu_check.sh   # use an environment that already has
#                                        # CUDA torch, mooncake-transfer-engine and nixl-cu12
#   WHEELS=/path/to/wheelhouse bash scripts/gpu_check.sh   # offline machine: install the
#                                        # same packages from a directory of wheels
#   GPU_CHECK_QUICK=1 ...                # smaller bench payload (2 layers x 2048 rows)
#
# Prints one line per stage and exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -z "${PY:-}" ]; then
  VENV=.venv-gpu
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    pip_args=(-q)
    if [ -n "${WHEELS:-}" ]; then pip_args+=(--no-index --find-links "$WHEELS"); fi
    "$VENV/bin/pip" install "${pip_args[@]}" --upgrade pip || true
    # The CUDA builds: PyPI's default torch wheel (CUDA 12), Mooncake's CUDA wheel (needs
    # libcudart.so.12), NIXL for CUDA 12. Not the `engines` extra: it names the CPU-only Mooncake.
    "$VENV/bin/pip" install "${pip_args[@]}" torch mooncake-transfer-engine nixl-cu12 \
      nvidia-cuda-runtime-cu12
    "$VENV/bin/pip" install "${pip_args[@]}" -e '.[dev]'
  fi
  PY="$VENV/bin/python"
fi

# Mooncake's CUDA build dlopens libcudart.so.12; the pip runtime package ships it outside the
# loader's search path.
cudart=$("$PY" -c 'import os, nvidia.cuda_runtime as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
if [ -n "$cudart" ] && [ -d "$cudart" ]; then export LD_LIBRARY_PATH="$cudart:${LD_LIBRARY_PATH:-}"; fi

echo "== environment"
timeout 120 "$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), "torch has no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0))
import mooncake.engine as m
print("mooncake CUDA support:", getattr(m, "SUPPORT_CUDA", "unknown"))
from pdproto.transfer.engines.nixl import _import_api
print("nixl api:", _import_api().__name__)
EOF

echo "== packing on the device (torch index_select into VRAM staging)"
timeout 120 "$PY" - <<'EOF'
import numpy as np, torch
from pdproto.transfer.packing import Gatherer
src = torch.randint(0, 256, (4096, 1152), dtype=torch.uint8, device="cuda")
rows = np.arange(1, 4096, 4, dtype=np.int64)
out = torch.empty((rows.size, 1152), dtype=torch.uint8, device="cuda")
Gatherer().gather(src, rows, out)
assert torch.equal(out, src[torch.from_numpy(rows).cuda()])
print("gather ok")
EOF

echo "== packed fan-in reordered on the device (unpack_fan_in on a CUDA tensor)"
timeout 120 "$PY" - <<'EOF'
import torch
from pdproto.transfer.packing import unpack_fan_in
page, row, width, pages = 64, 1024, 512, [5, 2, 7]
want = torch.randint(0, 256, (8 * page, row), dtype=torch.uint8, device="cuda")
rows = torch.zeros_like(want)
for p in pages:  # two senders' 512-byte head slices of each page, each as one block (protocol.md section 3)
    block = want[p * page:(p + 1) * page]
    halves = [block[:, :width].reshape(-1), block[:, width:].reshape(-1)]
    rows[p * page:(p + 1) * page] = torch.cat(halves).view(page, row)
unpack_fan_in(rows, pages, page, [(0, width), (width, width)])
torch.cuda.synchronize()
assert all(torch.equal(rows[p * page:(p + 1) * page], want[p * page:(p + 1) * page]) for p in pages)
print("unpack ok")
EOF

echo "== transfer tests, VRAM on both sides"
PDPROTO_TEST_DEVICE=cuda timeout 600 "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_transfer.py tests/test_transfer_packing.py

echo "== transfer bench, VRAM on both sides"
if [ -n "${GPU_CHECK_QUICK:-}" ]; then
  export PDPROTO_BENCH_LAYERS=2 PDPROTO_BENCH_ROWS=2048
fi
PDPROTO_BENCH_DEVICE=cuda timeout 600 "$PY" -m bench bench_transfer
echo "== gpu_check: all stages passed"
