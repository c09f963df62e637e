#!/bin/sh
# Regenerates pdproto/v1 from protos/ with the pinned generators
# (grpcio-tools==1.85.1, mypy-protobuf==5.1.0); CI reruns this and diffs.
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PATH="$(dirname "$PY"):$PATH"
find pdproto/v1 -name '*_pb2*.py*' -delete
"$PY" -m grpc_tools.protoc -Iprotos \
  --python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. \
  $(cd protos && find . -name '*.proto' | sed 's|^\./||' | sort)
