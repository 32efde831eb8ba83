#!/usr/bin/env bash
# Makes the wheelhouse scripts/gpu-check.sh installs from, on a machine with network: the runtime dependencies that a
# GPU host's image may lack or have too old, as wheels for that host's Python (x86_64 Linux).
#
#   scripts/gpu-wheels.sh [PYTHON_VERSION] [DIR]      # default 3.12 and ./wheelhouse
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=${1:-3.12}
dir=${2:-$root/wheelhouse}
grpc=$(sed -n 's/.*"grpcio-tools==\([0-9.]*\)".*/\1/p' "$root/pyproject.toml")  # the version the stubs were made with
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
  "grpcio==$grpc" "grpcio-health-checking==$grpc" 'protobuf>=7.35.1,<8' 'prometheus-client>=0.20' \
  'setuptools>=77' 'nvidia-ml-py>=12' 'typing-extensions>=4.12'
ls "$dir"
