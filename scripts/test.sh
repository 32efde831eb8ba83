#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole suite (lint, then pytest). Extra
# arguments go to pytest, e.g. scripts/test.sh -k discover -x
source "$(dirname "$0")/venv.sh" test,jax,etcd
command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || apt_install etcd-server
ruff check .
exec python -m pytest "$@"
