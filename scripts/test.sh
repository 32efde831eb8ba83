#!/usr/bin/env bash
# Sets up .venv with the test dependencies and runs the whole suite (lint, then pytest). Extra
# arguments go to pytest, e.g. scripts/test.sh -k discover -x
source "$(dirname "$0")/venv.sh" test,jax
ruff check .
exec python -m pytest "$@"
