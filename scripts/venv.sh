# Sourced by the other scripts: makes .venv with the project installed (extras in $1, e.g. "test"),
# on a fresh Debian machine too. Re-installs only when pyproject.toml changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

apt_lock_timeout=${IFRT_APT_LOCK_TIMEOUT:-600}
# How long (seconds) apt-get waits where another apt-get or dpkg holds the apt or dpkg lock, instead of failing at once.

apt_get() {
  # apt-get "$@", waiting up to $apt_lock_timeout s for a lock another apt-get or dpkg holds: apt-get itself waits
  # for the dpkg lock (DPkg::Lock::Timeout), but not for the package lists' lock (apt-get update), retried here.
  local deadline=$((SECONDS + apt_lock_timeout)) out said=""
  while :; do
    if out=$(DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$apt_lock_timeout" "$@" 2>&1); then
      [ -z "$out" ] || printf '%s\n' "$out" >&2
      return 0
    fi
    if [ "$SECONDS" -lt "$deadline" ] && grep -q "Could not get lock" <<<"$out"; then
      [ -n "$said" ] || echo "apt-get $1: waiting up to ${apt_lock_timeout}s for another apt-get or dpkg to release" \
        "its lock ($(grep -m1 "Could not get lock" <<<"$out" | sed 's/^E: //'))" >&2
      said=1
      sleep 2
      continue
    fi
    printf '%s\n' "$out" >&2
    if grep -q -i "lock" <<<"$out"; then
      echo "apt-get $1: another apt-get or dpkg still held the apt or dpkg lock after ${apt_lock_timeout}s" \
        "(IFRT_APT_LOCK_TIMEOUT sets how long to wait)" >&2
    fi
    return 1
  done
}

apt_install() {
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing Debian packages: $* (waiting up to ${apt_lock_timeout}s for the apt and dpkg locks if another" \
      "apt-get or dpkg holds them)" >&2
    apt_get update -qq
    apt_get install -y -qq "$@"
  else
    echo "missing Debian packages: $* (install them, e.g. sudo apt-get install $*)" >&2
    return 1
  fi
}

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
  echo "ifrt-topology needs Python 3.11 or newer as '$python' (set PYTHON=...)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$python" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    apt_install python3-venv
    "$python" -m venv .venv
  fi
fi

extras=${1:-}
spec=.
[ -n "$extras" ] && spec=".[$extras]"
stamp=".venv/.installed-$(cat pyproject.toml | sha256sum | cut -c1-16)-${extras:-base}"
if [ ! -f "$stamp" ]; then
  echo "installing ifrt-topology${extras:+ with [$extras]} into .venv" >&2
  log=.venv/pip-install.log
  if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e "$spec"; } >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "pip install failed; the whole log is in $log" >&2
    exit 1
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
