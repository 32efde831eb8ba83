# Sourced by the other scripts: makes .venv with the project installed (extras in $1, e.g. "test"),
# on a fresh Debian machine too. Re-installs only when pyproject.toml changed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

apt_install() {
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing Debian packages: $*" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
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
