"""ifrt.pushed.PushedKeys: keys under a prefix as a real coordinator pushes them to a client's live session."""

from __future__ import annotations

import signal
import threading

import ifrt
from ifrt.events import CoordinatorLost
from ifrt.pushed import PushedKeys


def test_a_view_reads_what_was_set_before_it_then_follows_pushes_and_ends_with_the_coordinator(start_coordinator):
    coordinator = start_coordinator(num_processes=1, log_level="WARNING")
    with ifrt.Client(coordinator.address, process_id=0, num_processes=1, transfer=False, timeout=30) as client:
        client.discover()
        client.kv_set("p/before", b"1")
        view = PushedKeys(client, "p/")
        assert view.watching.wait(30) and view.ready()
        assert view.values(["p/before", "p/later"]) == [b"1", None]
        client.kv_set("p/later", b"2")
        client.kv_set("other/key", b"3")  # not under the prefix: never pushed
        assert view.wait(["p/later"], 30) and view.values(["p/later", "other/key"]) == [b"2", None]
        assert view.covers("p/x") and not view.covers("other/key")

        lost = threading.Event()  # called after the view's own callback: callbacks run in order
        client.on_event(lambda e: lost.set() if isinstance(e, CoordinatorLost) else None)
        coordinator.stop(signal.SIGKILL)
        assert lost.wait(30)
        assert not view.ready()  # changes while the session reconnects are not replayed: it answers nothing more
        assert view.values(["p/before"]) == [None] and not view.wait(["p/before"], 30)
