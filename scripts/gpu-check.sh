#!/usr/bin/env bash
# The GPU check: installs ifrt-topology into this host's Python without network, then checks what it does on the
# real GPUs (the cuda plugin through NVML, CUDA_VISIBLE_DEVICES, ifrt discover, ifrt.torch on NCCL, ifrt.jax on JAX's
# GPU backend), prints one JSON report and exits non-zero on any failure. What a run showed: docs/benchmarks.md.
#
#   scripts/gpu-check.sh [WHEELHOUSE]
#
# PYTHON: the interpreter that has torch, jax and nvidia-ml-py (default python3). WHEELHOUSE (default ./wheelhouse):
# wheels of what that Python lacks or has too old (grpcio, protobuf, grpcio-health-checking, setuptools, ...), made
# by scripts/gpu-wheels.sh on a machine with network; only those newer than what the Python has are used. Nothing is
# written into the interpreter's own environment: packages go to a temporary folder put first on PYTHONPATH.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
wheels=${1:-$root/wheelhouse}
site=$(mktemp -d "${TMPDIR:-/tmp}/ifrt-gpu-check.XXXXXX")
trap 'rm -rf "$site"' EXIT
export PYTHONPATH="$site" PATH="$site/bin:$PATH" PYTHONUNBUFFERED=1

pip_install() {
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$site" "$@" >&2
}
if compgen -G "$wheels/*.whl" >/dev/null; then
  # the wheels whose distribution this Python lacks, or has in an older version
  mapfile -t needed < <("$python" - "$wheels" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

def key(version):
    return tuple(int(p) if p.isdigit() else 0 for p in version.split(".")[:4])

for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        have = metadata.version(name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        have = None
    if have is None or key(have) < key(version):
        print(wheel)
PY
  )
  if [ ${#needed[@]} -gt 0 ]; then
    echo "gpu-check: installing from $wheels: ${needed[*]##*/}" >&2
    pip_install "${needed[@]}"
  fi
fi
echo "gpu-check: installing ifrt-topology from $root into $site" >&2
pip_install --no-build-isolation "$root"
cd "$site"  # import the installed copy, not the checkout
rc=0
"$python" "$root/scripts/gpu_check.py" || rc=$?
exit "$rc"
