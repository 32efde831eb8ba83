"""Every ``IFRT_*`` variable some part of ifrt reads, so that a misspelt one is named instead of silently ignored."""

from __future__ import annotations

import difflib
import logging
import threading
from collections.abc import Mapping

from ifrt import settings
from ifrt.agent_credential import AGENT_ENV
from ifrt.clusters.base import PORT_ENV
from ifrt.spare import SPARE_ENV

PREFIX = "IFRT_"
READ = frozenset({
    *(value for name, value in vars(settings).items() if name.endswith("_ENV") and isinstance(value, str)),
    PORT_ENV,
    SPARE_ENV,  # a warm spare of `ifrt run --spare`
    *AGENT_ENV,  # `ifrt run`'s host credential, and the coordinator's agent key
    "IFRT_CPU_DEVICE_COUNT", "IFRT_SIM_SPEC",  # the cpu and sim plugins
    "IFRT_ETCD_CA", "IFRT_ETCD_CERT", "IFRT_ETCD_KEY", "IFRT_ETCD_USER", "IFRT_ETCD_PASSWORD_FILE",  # the coordinator
    "IFRT_STORE", "IFRT_IMAGE", "IFRT_ETCD_IMAGE", "IFRT_BASE_IMAGE", "IFRT_BUILD_CONTEXT", "IFRT_CACHE_DIR",  # compose
    "IFRT_APT_LOCK_TIMEOUT",  # scripts/venv.sh: how long apt-get waits for another apt's lock
})
"""The variables read by the library, its plugins, the coordinator, the scripts and the docker-compose deployment."""
OWN_PREFIXES = ("IFRT_TEST_", "IFRT_BENCH_")
"""Families of variables read by the project's tests and benchmarks."""

log = logging.getLogger("ifrt.settings")
_warned: set[str] = set()
_lock = threading.Lock()


def unknown(environ: Mapping[str, str]) -> list[str]:
    """One line for each ``IFRT_*`` variable in ``environ`` that nothing in ifrt reads, with the closest name it
    does read: ``IFRT_PROCES_ID is set but ifrt reads no such variable: did you mean IFRT_PROCESS_ID?``."""
    lines = []
    for name in sorted(environ):
        if not name.startswith(PREFIX) or name in READ or name.startswith(OWN_PREFIXES):
            continue
        close = difflib.get_close_matches(name, READ, n=1, cutoff=0.75)
        hint = f": did you mean {close[0]}?" if close else " (`ifrt env` shows what it reads)"
        lines.append(f"{name} is set but ifrt reads no such variable{hint}")
    return lines


def warn_unknown(environ: Mapping[str, str]) -> None:
    """Warns of each unknown ``IFRT_*`` variable, once per process."""
    for line in unknown(environ):
        with _lock:
            if line in _warned:
                continue
            _warned.add(line)
        log.warning("%s", line)
