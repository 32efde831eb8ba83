#!/usr/bin/env bash
# Builds .venv-torchft, the healing benchmark's own environment for its torchft side: torchft 0.2.0 from the
# pip registry with the CPU torch the project's .venv has (2.13.0+cpu), so both sides of bench/healing.py run the
# same torch. Run once:  bash bench/healing_setup.sh   (TORCH=2.13.0 PYTHON=python3.11 to override)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${VENV:-$HERE/../.venv-torchft}"
PYTHON="${PYTHON:-python3.11}"
TORCH="${TORCH:-2.13.0}"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# The CPU wheel: where pip's configured sources have it (a wheel cache or find-links), from there; else from
# PyTorch's CPU index (the default index would bring a CUDA build and its libraries).
"$VENV/bin/pip" install --quiet "torch==$TORCH+cpu" 2>/dev/null ||
    "$VENV/bin/pip" install --quiet "torch==$TORCH+cpu" --index-url https://download.pytorch.org/whl/cpu
# torchft itself and its needs (opentelemetry's SDK and HTTP exporter), torch kept as installed.
"$VENV/bin/pip" install --quiet torchft==0.2.0 "opentelemetry-sdk>=1.39.0" \
    "opentelemetry-exporter-otlp-proto-http>=1.39.0" "opentelemetry-api>=1.39.0" numpy
"$VENV/bin/python" - <<'PY'
import torch, torchft
from torchft.coordination import LighthouseServer
print(f"ok: torch {torch.__version__}, torchft {getattr(torchft, '__version__', '0.2.0')}")
PY
