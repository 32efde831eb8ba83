"""One JAX process of a job whose coordination service is ifrt's stand-in: ``python tests/xla_standin_worker.py
SCENARIO``; prints JSON lines, one per phase ({"phase": NAME, "process_id": ID, ...}).

Every call under test goes through JAX's own distributed client (``jax._src.distributed.global_state.client``), which
dials the stand-in inside this process; the phases are kept apart with ifrt's own barriers, so that one phase's
failure does not hide the next one's result. A method this jaxlib's client lacks is reported as {"missing": true},
not called. Each call is reported as {"value": ...} or {"error": "<type>: <text>"}, with the seconds it took.

Scenarios:
  job        phases "basics", "kv", "barrier", "live", "late" (a barrier the last process reaches LATE_S seconds
             after the others, waited for on a thread of its own meanwhile), then "preemption": the worker prints
             {"phase": "preemption-loop"} and calls reached_preemption_sync_point(step) every STEP_S until it returns
             True (the test sends one process SIGTERM meanwhile)
  scope-set  phase "scope-set": sets keys through JAX (process 0 "scoped/shared", each process "scoped/<id>"), then
             ends: the job's first start
  scope-get  phase "scope-get": the job's next start against the same coordinator looks for those keys, then sets
             them itself

STANDIN_COORDINATION=jax starts JAX with ``coordination="jax"`` instead: XLA's own service in process 0, the reference
the stand-in's answers are to match (the suite does not use it; it is for checking what XLA itself answers).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

TIMEOUT = 60.0
SYNC_S = 60.0
SHORT_MS = 1500
"""The timeout of a call that is to fail: a barrier a process misses, a get of a key nobody sets."""
GONE_MS = 200
"""The timeout of a blocking get of a key that was deleted."""
STEP_S = 0.001
"""A training step, as short as a step may be: reached_preemption_sync_point is called about every millisecond."""
PREEMPTION_WAIT_S = 30.0
"""How long a process steps, at most, waiting for reached_preemption_sync_point to return True."""
LATE_MARGIN_S = 4.0
"""How much longer than the late process's delay the others wait at barrier "late"."""
SCOPED_KEYS = ("scoped/shared", "scoped/{pid}")

_say = threading.Lock()


def say(**fields: Any) -> None:
    """One JSON line, whole (the late barrier's thread reports too)."""
    with _say:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()


def outcome(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call`` did: {"value": ...} or {"error": the exception's type and text}, with the seconds it took."""
    started = time.monotonic()
    try:
        value = call()
    except Exception as e:  # JAX raises its runtime error (XlaRuntimeError, JaxRuntimeError) with XLA's status
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}
    return {"value": _plain(value), "seconds": time.monotonic() - started}


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("latin-1")
    if isinstance(value, (list, tuple)) and all(isinstance(v, (list, tuple)) and len(v) == 2 for v in value):
        return sorted([k, _plain(v)] for k, v in value)  # a directory's (key, value) pairs
    if isinstance(value, dict):
        return {str(k): v for k, v in sorted(value.items())}
    return value


class Job:
    """This process after ``ifrt.jax.initialize()``, and JAX's client in it."""

    def __init__(self) -> None:
        import jax
        from jax._src import distributed

        import ifrt.jax

        coordination = os.environ.get("STANDIN_COORDINATION", "ifrt")
        self.topology = ifrt.jax.initialize(timeout=TIMEOUT, coordination=coordination)  # type: ignore[arg-type]
        self.ifrt = ifrt.jax.client()
        state = distributed.global_state
        self.client = state.client
        self.pid, self.n = self.topology.process_id, self.topology.num_processes
        self.last = self.n - 1
        self.methods = sorted(m for m in dir(self.client) if not m.startswith("_"))
        self.basics = {
            "jax_process_index": jax.process_index(),
            "jax_process_count": jax.process_count(),
            "jax_version": jax.__version__,
            "methods": self.methods,
            "service_is_none": state.service is None,
            "client_is_set": state.client is not None,
            "preemption_manager_is_set": getattr(state, "preemption_sync_manager", None) is not None,
            "generation": self.topology.generation,
            "run": self.ifrt.topology_run,
        }

    def say(self, phase: str, **fields: Any) -> None:
        say(phase=phase, process_id=self.pid, **fields)

    def call(self, method: str, *args: Any) -> dict[str, Any]:
        """JAX's ``client.method(*args)`` as ``outcome`` reports it; {"missing": True} where this jaxlib lacks it."""
        if method not in self.methods:
            return {"missing": True}
        return outcome(lambda: getattr(self.client, method)(*args))

    def sync(self, name: str) -> None:
        """Every process of the job meets here: ifrt's own barrier (not the stand-in's), between phases."""
        self.ifrt.barrier(f"xla-standin-test/{name}", SYNC_S)

    # Phases of "job".
    def key_values(self) -> dict[str, Any]:
        pid, c = self.pid, self.call
        found: dict[str, Any] = {}
        self.sync("kv-begin")
        if pid == 0:
            found["set_shared"] = c("key_value_set", "shared/greeting", "hello from 0")
            found["set_bytes"] = c("key_value_set_bytes", "shared/bytes", b"\x00\xff\x01")
            for key, value in (("dir/x", "1"), ("dir/y", "2"), ("dir/sub/z", "3"), ("dir", "the key itself"),
                               ("dirx", "beside"), ("other/dir/w", "elsewhere")):
                found[f"set {key}"] = c("key_value_set", key, value)
        else:  # whether process 0 has set it yet or not: the get waits
            found["blocking_get"] = c("blocking_key_value_get", "shared/greeting", 20_000)
            found["blocking_get_bytes"] = c("blocking_key_value_get_bytes", "shared/bytes", 20_000)
        own = f"own/{pid}"
        found["set_own"] = c("key_value_set", own, "first")
        found["set_own_other_value"] = c("key_value_set", own, "second")  # no overwrite: refused
        found["set_own_same_value"] = c("key_value_set", own, "first")  # no overwrite: refused, whatever the value
        found["own_after_refusals"] = c("blocking_key_value_get", own, 5_000)
        found["overwrite_own"] = c("key_value_set", own, "third", True)
        found["own_after_overwrite"] = c("blocking_key_value_get", own, 5_000)
        found["try_get_own"] = c("key_value_try_get", own)
        found["try_get_unset"] = c("key_value_try_get", "never/set")
        found["blocking_get_unset"] = c("blocking_key_value_get", "never/set", SHORT_MS)
        found["increment"] = c("key_value_increment", "counter", pid + 1)
        self.sync("kv-set")
        found["dir_get"] = c("key_value_dir_get", "dir")
        found["dir_get_slash"] = c("key_value_dir_get", "dir/")
        found["dir_get_bytes"] = c("key_value_dir_get_bytes", "dir")
        found["everyones_own"] = {str(p): c("blocking_key_value_get", f"own/{p}", 5_000) for p in range(self.n)}
        found["counter_total"] = c("key_value_increment", "counter", 0)
        self.sync("kv-read")
        if pid == 0:
            found["delete_dir"] = c("key_value_delete", "dir")
            found["delete_own"] = c("key_value_delete", own)
        self.sync("kv-deleted")
        found["after_delete"] = {
            "dir_get": c("key_value_dir_get", "dir"),
            "try_get dir": c("key_value_try_get", "dir"),
            "try_get dir/x": c("key_value_try_get", "dir/x"),
            "get dir": c("blocking_key_value_get", "dir", GONE_MS),
            "get dir/sub/z": c("blocking_key_value_get", "dir/sub/z", GONE_MS),
            "get own/0": c("blocking_key_value_get", "own/0", GONE_MS),
            "get dirx": c("blocking_key_value_get", "dirx", 5_000),
            "get other/dir/w": c("blocking_key_value_get", "other/dir/w", 5_000),
        }
        return found

    def barriers(self) -> dict[str, Any]:
        pid, c = self.pid, self.call
        found: dict[str, Any] = {}
        self.sync("barrier-begin")
        found["together"] = [c("wait_at_barrier", "together", 20_000) for _ in range(3)]  # one id, used 3 times
        if pid in (0, 1):  # a barrier of some processes only
            found["pair"] = c("wait_at_barrier", "pair", 20_000, [0, 1])
        self.sync("barrier-missing")
        if pid != self.last:  # the last process never arrives
            found["missing"] = c("wait_at_barrier", "missing", SHORT_MS)
        self.sync("barrier-after-missing")
        found["after_missing"] = c("wait_at_barrier", "after-missing", 20_000)  # a failed barrier harms no other
        return found

    def late_barrier(self, late_s: float) -> dict[str, Any]:
        """Barrier "late": the last process arrives ``late_s`` after the others, which wait LATE_MARGIN_S longer."""
        if self.pid == self.last:
            time.sleep(late_s)
            return {"late_by_s": late_s, **self.call("wait_at_barrier", "late", int(LATE_MARGIN_S * 1000))}
        return {"late_by_s": 0.0, **self.call("wait_at_barrier", "late", int((late_s + LATE_MARGIN_S) * 1000))}

    def live(self) -> dict[str, Any]:
        self.sync("live-begin")
        return {"live": self.call("get_live_nodes", list(range(self.n)))}

    def preemption(self) -> dict[str, Any]:
        from jax.experimental import multihost_utils

        self.sync("preemption-begin")
        self.say("preemption-loop")
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < PREEMPTION_WAIT_S:
            if multihost_utils.reached_preemption_sync_point(step):
                return {"sync_step": step, "seconds": time.monotonic() - started}
            time.sleep(STEP_S)
            step += 1
        return {"sync_step": None, "last_step": step, "seconds": time.monotonic() - started}


def job() -> None:
    j = Job()
    j.say("basics", **j.basics)
    late_s = float(os.environ.get("LATE_S", "0"))
    late = threading.Thread(target=lambda: j.say("late", **j.late_barrier(late_s)), daemon=True)
    late.start()
    j.say("kv", **j.key_values())
    j.say("barrier", **j.barriers())
    j.say("live", **j.live())
    late.join()
    j.say("preemption", **j.preemption())
    j.sync("end")


def scoped_keys(j: Job) -> tuple[list[str], list[str]]:
    """The keys of the scope scenarios this process sets (process 0 the shared one too), and those it reads."""
    shared, own = SCOPED_KEYS[0], SCOPED_KEYS[1].format(pid=j.pid)
    return ([shared, own] if j.pid == 0 else [own]), [shared, own]


def scope_set() -> None:
    j = Job()
    sets, reads = scoped_keys(j)
    found: dict[str, Any] = {"set": {key: j.call("key_value_set", key, "first start") for key in sets}}
    j.sync("scope-set")
    found["seen"] = {key: j.call("blocking_key_value_get", key, 5_000) for key in reads}
    j.sync("scope-seen")
    j.say("scope-set", **j.basics, **found)


def scope_get() -> None:
    j = Job()
    sets, reads = scoped_keys(j)
    found: dict[str, Any] = {
        "blocking_get": {key: j.call("blocking_key_value_get", key, SHORT_MS) for key in reads},
        "try_get": {key: j.call("key_value_try_get", key) for key in reads},
        "dir_get": j.call("key_value_dir_get", "scoped"),
    }
    j.sync("scope-looked")
    found["set"] = {key: j.call("key_value_set", key, "second start") for key in sets}  # no overwrite
    j.sync("scope-set-again")
    found["seen"] = {key: j.call("blocking_key_value_get", key, 5_000) for key in reads}
    j.sync("scope-seen-again")
    j.say("scope-get", **j.basics, **found)


SCENARIOS: dict[str, Callable[[], None]] = {"job": job, "scope-set": scope_set, "scope-get": scope_get}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
