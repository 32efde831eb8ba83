#!/usr/bin/env bash
# Sets up .venv and runs a local cluster: a coordinator and 4 processes of 2 CPU devices each, on loopback.
source "$(dirname "$0")/venv.sh"
exec python examples/local_cluster.py "$@"
