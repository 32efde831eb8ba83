#!/usr/bin/env bash
# Runs docker-compose.yml for real on this machine and checks every step (examples/multihost_demo.py): 3 etcd
# members, 2 coordinator replicas and 4 workers, each its own host on the compose network. All 4 workers must print
# the same topology; the leading replica is killed and the standby must take over with nothing lost; a worker is
# killed and the other 3 must receive ProcessFailed. Everything is torn down at exit, also on failure or Ctrl-C.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

usage() {
  cat <<EOF
usage: scripts/compose-demo.sh [options]

Brings up docker-compose.yml (etcd x3, coordinator x2, worker x4), checks that the workers hold one topology,
that a failover keeps it and that a killed worker is reported to the others, then tears everything down
(containers, network, volumes). Exits 0 only if every step happened.

Images: with a registry, python:3.11-slim and the official etcd image. Without one (or with --offline), a local
base image is built once with debootstrap (Debian bookworm minbase with python3 and etcd-server, from the
configured Debian mirror) and docker import, and cached as $BASE_TAG. The project's dependencies are
downloaded on this host into a cached wheelhouse, so the image build itself needs no network.

options:
  --offline            never try a registry: use (or build) the local base image
  --base-image IMAGE   build the ifrt image on IMAGE (with python3 >= 3.11); etcd still comes from the local base
                       image unless the official etcd image is present
  --rebuild-base       build the local base image again even if it is cached
  --mirror URL         Debian mirror for debootstrap (default: the first one configured for apt)
  --compose COMMAND    'docker compose' (v2) or 'docker-compose' (v1) (default: v2 if present, else v1)
  --project NAME       compose project name (default $PROJECT)
  --cache-dir DIR      where the wheelhouse (and the log of a dockerd started here) is kept (default $CACHE_DIR)
  --step-timeout S     seconds each step may take before the demo fails, naming what is missing (default 180)
  --keep-dockerd       leave a dockerd this script started running at exit (default: stop it)
  -h, --help           this help
EOF
}

BASE_TAG=ifrt-topology-base:bookworm
REGISTRY_BASE=python:3.11-slim
REGISTRY_ETCD=quay.io/coreos/etcd:v3.5.17
IMAGE=ifrt-topology:demo
PROJECT=ifrtdemo
CACHE_DIR=${IFRT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ifrt-topology}
offline=0 base_image="" rebuild_base=0 mirror="" compose="" step_timeout=180 keep_dockerd=0
while [ $# -gt 0 ]; do
  case "$1" in
    --offline) offline=1 ;;
    --base-image) base_image=${2:?--base-image needs an image}; shift ;;
    --rebuild-base) rebuild_base=1 ;;
    --mirror) mirror=${2:?--mirror needs a URL}; shift ;;
    --compose) compose=${2:?--compose needs a command}; shift ;;
    --project) PROJECT=${2:?--project needs a name}; shift ;;
    --cache-dir) CACHE_DIR=${2:?--cache-dir needs a folder}; shift ;;
    --step-timeout) step_timeout=${2:?--step-timeout needs seconds}; shift ;;
    --keep-dockerd) keep_dockerd=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "compose-demo: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { echo "compose: $*"; }
die() { echo "compose: error: $*" >&2; exit 2; }

work=$(mktemp -d /tmp/ifrt-compose-demo.XXXXXX)
dockerd_pid="" demo_pid="" compose_ready=0
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  if [ -n "$demo_pid" ] && kill -0 "$demo_pid" 2>/dev/null; then
    kill -TERM "$demo_pid" 2>/dev/null || true  # the demo tears its deployment down itself
    wait "$demo_pid" 2>/dev/null || true
  fi
  if [ "$compose_ready" = 1 ]; then  # a backstop: nothing of the project is left, whatever happened before
    $compose -p "$PROJECT" -f docker-compose.yml down -v --remove-orphans -t 5 >/dev/null 2>&1 || true
  fi
  if [ -n "$dockerd_pid" ] && [ "$keep_dockerd" = 0 ]; then
    say "stopping the dockerd this script started (pid $dockerd_pid)" >&2  # stdout ends with the closing line
    kill -TERM "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.1; done
  fi
  rm -rf "$work"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The host side: a Python with pip (the project's .venv, made by scripts/venv.sh if there is none).
if [ ! -x .venv/bin/python ]; then
  source scripts/venv.sh
fi
python=$root/.venv/bin/python

# Docker: the client, a running engine (started here when installed but not running), and Compose.
command -v docker >/dev/null || die "Docker is not installed; on Debian: apt-get install -y docker.io docker-compose"
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || die "the docker client cannot reach an engine and there is no dockerd here; on Debian: apt-get install -y docker.io"
  [ "$(id -u)" = 0 ] || die "the Docker engine is not running; start it (e.g. sudo systemctl start docker) or run this script as root"
  if [ -S /var/run/docker.sock ]; then  # an engine that answers nothing, or the socket of one that is gone
    engine_pid=$(cat /var/run/docker.pid 2>/dev/null || true)
    if [ -n "$engine_pid" ] && kill -0 "$engine_pid" 2>/dev/null; then
      die "the Docker engine (pid $engine_pid) runs but does not answer on /var/run/docker.sock; see its log (journalctl -u docker)"
    fi
    say "/var/run/docker.sock is left by an engine that is gone (no live pid in /var/run/docker.pid); dockerd replaces it"
  fi
  mkdir -p "$CACHE_DIR"
  dockerd >"$CACHE_DIR/dockerd.log" 2>&1 &
  dockerd_pid=$!
  say "the Docker engine was not running: started dockerd (pid $dockerd_pid, log $CACHE_DIR/dockerd.log)"
  for _ in $(seq 300); do docker info >/dev/null 2>&1 && break; sleep 0.1; done  # waits for the engine, 30 s at most
  if ! docker info >/dev/null 2>&1; then
    tail -n 20 "$CACHE_DIR/dockerd.log" >&2
    die "dockerd did not answer within 30s (its log is above)"
  fi
fi
if [ -z "$compose" ]; then
  if docker compose version >/dev/null 2>&1; then
    compose="docker compose"
  elif command -v docker-compose >/dev/null; then
    compose=docker-compose
  else
    die "no Docker Compose; on Debian: apt-get install -y docker-compose (v1), or install the compose plugin (v2)"
  fi
fi
$compose version >/dev/null 2>&1 || die "'$compose version' fails: is it Docker Compose?"
say "using $($compose version 2>/dev/null | head -n 1)"

image_present() { docker image inspect "$1" >/dev/null 2>&1; }
pull() {  # quietly, and never for long: no answer within 60 s counts as no registry
  [ "$offline" = 0 ] && timeout 60 docker pull -q "$1" >/dev/null 2>&1
}

debian_mirror() {
  [ -n "$mirror" ] && { echo "$mirror"; return; }
  local found
  found=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n 1 || true)
  [ -n "$found" ] || found=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    | awk '{print $2}' | grep -v security | head -n 1 || true)
  echo "${found:-http://deb.debian.org/debian}"
}

build_local_base() {
  command -v debootstrap >/dev/null || die "no registry image, and debootstrap (to build a local base image) is missing; on Debian: apt-get install -y debootstrap"
  [ "$(id -u)" = 0 ] || die "building the local base image with debootstrap needs root"
  local rootfs="$work/rootfs" url started
  url=$(debian_mirror)
  started=$(date +%s)
  say "building the local base image $BASE_TAG: debootstrap --variant=minbase bookworm from $url (about a minute, once)"
  if ! debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,etcd-server \
      bookworm "$rootfs" "$url" >"$work/debootstrap.log" 2>&1; then
    tail -n 20 "$work/debootstrap.log" >&2
    die "debootstrap failed (its log is above); a mirror can be given with --mirror URL"
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase bookworm (python3, etcd-server)" - "$BASE_TAG" >/dev/null
  rm -rf "$rootfs"
  say "built $BASE_TAG in $(($(date +%s) - started))s"
}

# The base images: a registry's when it can be had, else the local one (built once, then cached by its tag).
etcd_image=""
if [ -z "$base_image" ]; then
  if image_present "$REGISTRY_BASE" || pull "$REGISTRY_BASE"; then
    base_image=$REGISTRY_BASE
  fi
fi
if image_present "$REGISTRY_ETCD" || { [ "$base_image" = "$REGISTRY_BASE" ] && pull "$REGISTRY_ETCD"; }; then
  etcd_image=$REGISTRY_ETCD
fi
if [ -z "$base_image" ] || [ -z "$etcd_image" ]; then
  if [ "$rebuild_base" = 1 ] || ! image_present "$BASE_TAG"; then
    build_local_base
  else
    say "using the cached local base image $BASE_TAG (--rebuild-base builds it again)"
  fi
  base_image=${base_image:-$BASE_TAG}
  etcd_image=${etcd_image:-$BASE_TAG}
fi
say "images: ifrt on $base_image, etcd from $etcd_image"

# The wheelhouse: the dependencies' wheels for the image's Python and machine, downloaded here once per
# dependency list (the image build then installs from it, without any network).
py_tag=$(docker run --rm "$base_image" python3 -c 'import sys; print("%d%d" % sys.version_info[:2])') \
  || die "cannot run python3 in $base_image"
[ "$py_tag" -ge 311 ] || die "$base_image has Python ${py_tag:0:1}.${py_tag:1}; ifrt-topology needs 3.11 or newer"
arch=$(docker version --format '{{.Server.Arch}}')
case "$arch" in amd64) machine=x86_64 ;; arm64) machine=aarch64 ;; *) machine=$arch ;; esac
mapfile -t requirements < <("$python" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
for r in project["build-system"]["requires"] + project["project"]["dependencies"] \
        + project["project"]["optional-dependencies"]["etcd"]:
    print(r)
EOF
)
key=$(printf '%s\n' "${requirements[@]}" "cp$py_tag" "$machine" | sha256sum | cut -c1-16)
wheelhouse=$CACHE_DIR/wheelhouse-$key
if [ ! -d "$wheelhouse" ]; then
  say "downloading the dependencies' wheels for CPython ${py_tag:0:1}.${py_tag:1} on $machine into $wheelhouse"
  platforms=(--platform "manylinux2014_$machine")
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_$machine"); done
  mkdir -p "$CACHE_DIR"
  rm -rf "$wheelhouse.partial"
  if ! "$python" -m pip download --disable-pip-version-check --dest "$wheelhouse.partial" --only-binary=:all: \
      --python-version "$py_tag" --implementation cp --abi "cp$py_tag" "${platforms[@]}" "${requirements[@]}" \
      >"$work/pip-download.log" 2>&1; then
    tail -n 20 "$work/pip-download.log" >&2
    die "could not download the dependencies' wheels (the log is above)"
  fi
  mv "$wheelhouse.partial" "$wheelhouse"
else
  say "using the cached wheelhouse $wheelhouse"
fi

# The build context: only what the Dockerfile copies, plus the wheelhouse (not .venv or .git).
context=$work/context
mkdir -p "$context"
tar -c --exclude=__pycache__ Dockerfile pyproject.toml README.md proto ifrt coordinator plugins examples \
  | tar -x -C "$context"
cp -r "$wheelhouse" "$context/wheelhouse"

export IFRT_BASE_IMAGE=$base_image IFRT_ETCD_IMAGE=$etcd_image IFRT_IMAGE=$IMAGE IFRT_BUILD_CONTEXT=$context
compose_ready=1
$compose -p "$PROJECT" -f docker-compose.yml down -v --remove-orphans -t 5 >/dev/null 2>&1 || true  # an earlier run's
started=$(date +%s)
if ! $compose -p "$PROJECT" -f docker-compose.yml build coordinator1 >"$work/build.log" 2>&1; then
  tail -n 30 "$work/build.log" >&2
  die "building the ifrt image failed (the log is above)"
fi
say "built $IMAGE in $(($(date +%s) - started))s"
# The images of earlier builds that this one replaced (untagged now): gone, so repeated runs do not pile up.
docker image prune -f --filter label=org.opencontainers.image.title=ifrt-topology >/dev/null 2>&1 || true

# The demo itself, in the background so that a TERM or Ctrl-C reaches this script at once and is passed on.
"$python" examples/multihost_demo.py --step-timeout "$step_timeout" compose --compose "$compose" --project "$PROJECT" &
demo_pid=$!
status=0
wait "$demo_pid" || status=$?
demo_pid=""
exit "$status"
