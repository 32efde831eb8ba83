#!/usr/bin/env bash
# Regenerates the Python stubs in ifrt/_generated/ from proto/ (or into the folder given as $1).
# Uses the grpcio-tools pinned in pyproject.toml's test extra; tests/test_generated_stubs.py fails when
# the committed stubs differ from what this script produces.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/ifrt/_generated}
python=${PYTHON:-$root/.venv/bin/python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$python" -m grpc_tools.protoc -I "$root/proto" \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  "$root/proto/ifrt/topology/v1/coordinator.proto"
# XLA's coordination protocol and JAX's topology records, for ifrt's stand-in: messages only (its server routes by name).
"$python" -m grpc_tools.protoc -I "$root/proto" --python_out="$tmp" --pyi_out="$tmp" \
  "$root/proto/ifrt/xla/v1/tensorflow_coordination.proto" "$root/proto/ifrt/xla/v1/xla_coordination.proto" \
  "$root/proto/ifrt/xla/v1/xla_topology.proto"
# protoc writes absolute imports from the proto package path, which is not a Python package here.
sed -i 's/^from ifrt\.topology\.v1 import coordinator_pb2/from . import coordinator_pb2/' \
  "$tmp/ifrt/topology/v1/coordinator_pb2_grpc.py"
mkdir -p "$out"
cp "$tmp"/ifrt/topology/v1/coordinator_pb2.py "$tmp"/ifrt/topology/v1/coordinator_pb2.pyi \
  "$tmp"/ifrt/topology/v1/coordinator_pb2_grpc.py "$tmp"/ifrt/xla/v1/*_pb2.py "$tmp"/ifrt/xla/v1/*_pb2.pyi "$out"/
