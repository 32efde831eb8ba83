#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole suite (lint, then pytest). Extra
# arguments go to pytest, e.g. scripts/test.sh -k discover -x
source "$(dirname "$0")/venv.sh" test,jax,etcd
# Real parts the tests start: etcd servers, and network namespaces as several hosts (skipped, saying why,
# where they cannot be had).
command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || apt_install etcd-server || echo "no etcd-server: etcd tests skip" >&2
command -v ip >/dev/null || apt_install iproute2 || echo "no iproute2: multi-host tests skip" >&2
ruff check .
exec python -m pytest "$@"
