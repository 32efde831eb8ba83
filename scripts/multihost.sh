#!/usr/bin/env bash
# The deployment of docker-compose.yml without Docker: 3 etcd members, 2 coordinator replicas and 4 workers, each
# on a host of its own made with Linux network namespaces (one address each on a private bridge, no route out), and
# the same checks as scripts/compose-demo.sh (examples/multihost_demo.py). Everything it creates (namespaces,
# processes, files) is removed at exit, also on failure or Ctrl-C.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: scripts/multihost.sh [options]

Starts 3 etcd members, 2 coordinator replicas (journal in etcd) and 4 workers, each in its own network namespace,
then checks that the workers hold one topology, that killing the leading replica keeps it, and that a killed
worker is reported to the other 3. Traffic stays between the namespaces it creates. Exits 0 only if every step
happened. Needs root, iproute2 and Debian's etcd-server; the project runs from .venv (made by scripts/venv.sh).

options:
  --step-timeout S   seconds each step may take before the demo fails, naming what is missing (default 60)
  -h, --help         this help
EOF
}

step_timeout=60
while [ $# -gt 0 ]; do
  case "$1" in
    --step-timeout) step_timeout=${2:?--step-timeout needs seconds}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "multihost: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

die() { echo "multihost: error: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "network namespaces need root: run it as root (e.g. sudo scripts/multihost.sh)"
command -v ip >/dev/null || die "no 'ip'; on Debian: apt-get install -y iproute2"
command -v unshare >/dev/null || die "no 'unshare'; on Debian: apt-get install -y util-linux"
command -v etcd >/dev/null || [ -x /usr/bin/etcd ] || die "no etcd server; on Debian: apt-get install -y etcd-server"

root=$(cd "$(dirname "$0")/.." && pwd)
# .venv with the etcd extra (the coordinators' --store etcd), installed as scripts/demo.sh installs its own.
source "$root/scripts/venv.sh" etcd
python=$root/.venv/bin/python

# In the background, so that a signal reaches this script at once; it is passed on as TERM (a background job
# ignores SIGINT), and the demo tears everything down itself before it exits.
"$python" "$root/examples/multihost_demo.py" --step-timeout "$step_timeout" netns &
demo=$!
trap 'kill -TERM "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null; exit 143' TERM
trap 'kill -TERM "$demo" 2>/dev/null || true; wait "$demo" 2>/dev/null; exit 130' INT
status=0
wait "$demo" || status=$?
exit "$status"
