"""``PushedKeys``: the keys under one prefix as the coordinator pushes their changes, so that a start-up waiting for
keys that other processes write once reads them with no call of its own.

The view is complete once the coordinator has acknowledged the watch and the keys set before that were read once
(one ``KeyValueDir``, after the acknowledgement: every later change arrives as a push). A pushed change always wins
over that read, which may be older. Once its watch lapses (the session lost the coordinator, or, through an ``ifrt
run`` agent, the agent's own session with it broke: changes meanwhile are not replayed) or the view is closed, it
answers nothing more and its callers ask the coordinator as before.

What a complete view answers is the key's value as the last push said it: exact for keys written once (a start-up's
addresses), which is what it is for; a key that another process overwrites or deletes may be read a push late.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from ifrt.client import Client
from ifrt.errors import IfrtError
from ifrt.events import CoordinatorLost, Event
from ifrt.session import Watch

ACK_WAIT_S = 0.5
"""How long the first read waits for the coordinator to acknowledge the watch (the session may still be opening)
before its caller asks the coordinator instead: a refused watch (over the coordinator's limits) is never
acknowledged, and costs this once per view."""


class PushedKeys:
    """Keys under ``prefix`` as pushed by the coordinator (see the module docstring)."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self._cond = threading.Condition()
        self._values: dict[str, bytes] = {}
        self._pushed: set[str] = set()  # keys a push set or deleted: the first read does not overwrite them
        self._complete = False
        self._ended = False  # lost or closed: answers nothing more
        self._ack_waited = False  # a read waited ACK_WAIT_S for the acknowledgement already: later ones do not
        client.on_event(self._on_event)
        self.watching = client.kv_follow(prefix, self._changed)
        """Set once the coordinator watches the prefix."""
        if isinstance(self.watching, Watch):
            self.watching.on_lapse(self._end)

    def ready(self) -> bool:
        """Whether the view answers reads now: on the first call after the watch is acknowledged (waiting up to
        ACK_WAIT_S for that), it reads the keys already set, in one call."""
        with self._cond:
            if self._complete or self._ended:
                return self._complete and not self._ended
        if not self.watching.wait(0.0 if self._ack_waited else ACK_WAIT_S):
            self._ack_waited = True
            return False
        try:
            found = self.client.kv_dir(self.prefix)  # after the acknowledgement: anything later is pushed
        except IfrtError:  # e.g. more than one answer may hold: the callers ask for each key instead
            self._end()
            return False
        with self._cond:
            for key, value in found.items():
                if key not in self._pushed:
                    self._values[key] = value
            self._complete = not self._ended
            return self._complete

    def values(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value as pushed (None: unset); only while ``ready()``."""
        with self._cond:
            return [self._values.get(k) for k in keys]

    def wait(self, keys: Sequence[str], timeout: float) -> bool:
        """Waits up to ``timeout`` seconds until every key is set; False when it is not, or the view ended."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._ended and any(k not in self._values for k in keys):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return not self._ended

    def covers(self, key: str) -> bool:
        """Whether ``key`` lies under the watched prefix."""
        return key.startswith(self.prefix)

    def close(self) -> None:
        """Ends the view: it answers nothing more and drops what it held (the coordinator's pushes, if any more
        come, are ignored)."""
        self._end()

    def _changed(self, key: str, value: bytes | None) -> None:
        with self._cond:
            if self._ended:
                return
            self._pushed.add(key)
            if value is None:
                self._values.pop(key, None)
            else:
                self._values[key] = value
            self._cond.notify_all()

    def _on_event(self, event: Event) -> None:
        if isinstance(event, CoordinatorLost):
            self._end()

    def _end(self) -> None:
        with self._cond:
            self._ended = True
            self._values.clear()
            self._pushed.clear()
            self._cond.notify_all()
