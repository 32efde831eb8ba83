"""A key-value get that waits is answered with the value only if its caller may still read it when the value comes:
a process declared failed while its get waited is told so, not handed the value."""

from __future__ import annotations

import ifrt
from ifrt.events import ProcessFailed
from tests.helpers import in_thread, next_event, watcher

HEARTBEAT_TIMEOUT = 2.0


def test_a_get_of_a_process_declared_failed_while_it_waited_fails_when_the_key_is_set(start_coordinator):
    coordinator = start_coordinator("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), num_processes=2)
    with ifrt.Client(coordinator.address, process_id=0, num_processes=2, transfer=False, timeout=60) as survivor, \
            ifrt.Client(coordinator.address, process_id=1, num_processes=2, transfer=False, timeout=60,
                        session=False) as silent:  # no session: nothing keeps it alive past the heartbeat timeout
        events = watcher(survivor)
        discovered = in_thread(survivor.discover)
        silent.discover()
        assert isinstance(discovered.get(timeout=60), ifrt.Topology)
        waiting = in_thread(lambda: silent.kv_get("ready", timeout=60))
        next_event(events, ProcessFailed, timeout=30, process_id=1)
        assert waiting.empty(), "the get should still wait: it was accepted before its process failed"
        survivor.kv_set("ready", b"go")
        error = waiting.get(timeout=30)
        assert isinstance(error, ifrt.ProcessDeclaredFailed), error
        assert "was declared failed" in str(error)
        assert survivor.kv_get("ready", timeout=10) == b"go"  # the set itself stands for every live process
