#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole suite (lint, then pytest in two phases, below). Extra
# arguments go to pytest, e.g. scripts/test.sh -k discover -x; IFRT_TEST_WORKERS sets how many run side by side.
source "$(dirname "$0")/venv.sh" test,jax,etcd
# Real parts the tests start: etcd servers, network namespaces as several hosts (iptables for a firewall in one),
# a real JAX runtime, and a Docker engine for docker-compose.yml (Compose v1, debootstrap for a local base image).
command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || apt_install etcd-server || true
command -v ip >/dev/null || apt_install iproute2 || true
command -v iptables >/dev/null || apt_install iptables || true
command -v openssl >/dev/null || apt_install openssl || true  # the TLS tests make their certificates with it
command -v chromium >/dev/null || apt_install chromium || true  # a real browser opens the status page
docker_packages=()
command -v dockerd >/dev/null || docker_packages+=(docker.io)
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || docker_packages+=(docker-compose)
command -v debootstrap >/dev/null || docker_packages+=(debootstrap)
[ ${#docker_packages[@]} -eq 0 ] || apt_install "${docker_packages[@]}" || true

# What is still missing. Under CI (CI=true) that is a failure here, before any test runs: a suite that skips
# what it cannot run would pass without testing it. Elsewhere the tests that need it skip, each saying why
# (tests/requirements.py applies the same rule inside the suite).
missing=()
command -v openssl >/dev/null || missing+=("openssl: the TLS tests make certificates with it (apt-get install -y openssl)")
command -v chromium >/dev/null || missing+=("chromium: the status page is tested in a headless browser (apt-get install -y chromium)")
if ! command -v etcd >/dev/null && [ ! -x /usr/bin/etcd ]; then
  missing+=("etcd: no etcd server; install Debian's etcd-server (as root: apt-get install -y etcd-server)")
fi
if ! command -v ip >/dev/null; then
  missing+=("network namespaces: no 'ip'; install iproute2 (as root: apt-get install -y iproute2)")
elif [ "$(id -u)" != 0 ]; then
  missing+=("network namespaces: they need root; run scripts/test.sh as root")
else
  probe="itopo-probe-$$"
  if ip netns add "$probe" 2>/dev/null; then
    ip netns del "$probe"
  else
    missing+=("network namespaces: 'ip netns add' is not permitted here (a container needs CAP_SYS_ADMIN)")
  fi
fi
if ! command -v iptables >/dev/null; then
  missing+=("iptables: a firewall inside a test host; install it (as root: apt-get install -y iptables)")
fi
if ! command -v docker >/dev/null || ! command -v dockerd >/dev/null; then
  missing+=("docker: no Docker engine for docker-compose.yml; install Debian's docker.io (as root: apt-get install -y docker.io)")
fi
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  missing+=("docker compose: neither v2 nor v1; install Debian's docker-compose (as root: apt-get install -y docker-compose)")
fi
if ! command -v debootstrap >/dev/null; then
  missing+=("debootstrap: builds the compose demo's local base image; install it (as root: apt-get install -y debootstrap)")
fi
# nvidia-ml-py as each version the cuda plugin supports declares NVML's structures: tests/test_cuda_plugin.py drives
# the plugin's fabric reader with every one of them (their own pynvml module, from .venv/nvml/<version>). Pure Python,
# under 1 MB each; the project itself never imports these. Keep the list as the test's NVML_VERSIONS.
nvml_versions=(12.535.77 12.550.52 12.560.30 12.570.86 12.575.51 13.580.65 13.615.71)
for version in "${nvml_versions[@]}"; do
  if [ ! -f ".venv/nvml/$version/pynvml.py" ]; then
    echo "installing nvidia-ml-py $version into .venv/nvml/$version (for the cuda plugin's tests)" >&2
    python -m pip install -q --no-deps --target ".venv/nvml/$version" "nvidia-ml-py==$version" \
      >>.venv/pip-nvml.log 2>&1 || rm -rf ".venv/nvml/$version"
  fi
  [ -f ".venv/nvml/$version/pynvml.py" ] \
    || missing+=("nvidia-ml-py $version: could not be installed into .venv/nvml/$version (see .venv/pip-nvml.log)")
done
# A second interpreter with JAX 0.4.30, which numbers CPU devices as ifrt does: tests/test_jax.py checks that the
# ids then coincide. The project itself comes from the checkout (PYTHONPATH); this venv holds only the runtime.
if [ -z "${IFRT_TEST_JAX04_PYTHON:-}" ]; then
  if [ ! -x .venv-jax04/bin/python ]; then
    echo "installing jax 0.4.30 into .venv-jax04 (for the JAX device-id comparison)" >&2
    { "$python" -m venv .venv-jax04 && .venv-jax04/bin/python -m pip install -q 'jax==0.4.30' 'jaxlib==0.4.30' \
        numpy 'grpcio>=1.85.1' 'protobuf>=7.35.1'; } >.venv-jax04.log 2>&1 || rm -rf .venv-jax04
  fi
  [ -x .venv-jax04/bin/python ] && export IFRT_TEST_JAX04_PYTHON="$root/.venv-jax04/bin/python"
fi
[ -n "${IFRT_TEST_JAX04_PYTHON:-}" ] || missing+=("jax 0.4.30: .venv-jax04 could not be made (see .venv-jax04.log)")
# PyTorch for tests/test_torch*.py: not an extra of `test` (pip would pull the 5.5 GB CUDA build); a CPU build where
# pip finds one (this machine's wheel cache has torch 2.13.0 for CPU).
if ! python -c 'import torch' >/dev/null 2>&1; then
  echo "installing torch 2.13.0 into .venv (for the ifrt.torch tests)" >&2
  python -m pip install -q 'torch==2.13.0' >.venv/pip-torch.log 2>&1 || true
fi
if ! torch_error=$(python -c 'import torch.distributed' 2>&1); then
  missing+=("torch: 'import torch.distributed' fails ($(printf '%s' "$torch_error" | tail -n 1)); see .venv/pip-torch.log, or run: .venv/bin/python -m pip install 'torch==2.13.0'")
fi
if ! jax_error=$(python -c 'import jax' 2>&1); then
  missing+=("jax: 'import jax' fails ($(printf '%s' "$jax_error" | tail -n 1)); the jax extra is installed by this script: see .venv/pip-install.log, or run: .venv/bin/python -m pip install -e '.[jax]'")
fi
if [ ${#missing[@]} -gt 0 ]; then
  case "$(printf '%s' "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
    true | 1 | yes)
      echo "scripts/test.sh: CI=true and the suite cannot run everything it tests:" >&2
      printf '  - %s\n' "${missing[@]}" >&2
      exit 1
      ;;
    *)
      echo "scripts/test.sh: warning: the tests that need these skip (under CI=true they fail):" >&2
      printf '  - %s\n' "${missing[@]}" >&2
      ;;
  esac
fi

ruff check .
# The tests run side by side on $IFRT_TEST_WORKERS processes (pytest-xdist; each takes its loopback ports from a range
# of its own, tests/helpers.py), then those marked `serial` one at a time on an otherwise idle machine: they judge CPU
# progress or timing that a loaded machine would distort, or use machine-wide resources (Docker). Each phase ends
# with the time per test file. A phase with no test selected by "$@" is not a failure.
workers=${IFRT_TEST_WORKERS:-4}
side_by_side=0
python -m pytest -n "$workers" -m "not serial" "$@" || side_by_side=$?
alone=0
python -m pytest -p no:xdist -m serial "$@" || alone=$?
if [ "$side_by_side" = 5 ] && [ "$alone" = 5 ]; then
  exit 5
fi
for status in "$side_by_side" "$alone"; do
  [ "$status" = 0 ] || [ "$status" = 5 ] || exit "$status"
done
