"""Signals that announce this process's preemption (``IFRT_PREEMPTION_SIGNALS``): reported, not fatal."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ifrt.errors import IfrtError

log = logging.getLogger("ifrt.client")


class PreemptionSignals:
    """Turns each of ``signals`` into a call of ``report`` (on a thread of its own) instead of an exit, unless
    ``settled()`` says the preemption is known and agreed already."""

    def __init__(self, signals: Sequence[signal.Signals], report: Callable[[], None],
                 settled: Callable[[], bool]) -> None:
        self._signals = tuple(signals)
        self._report = report
        self._settled = settled
        self._received: queue.SimpleQueue = queue.SimpleQueue()  # from the handler to the reporting thread
        self._previous: dict[signal.Signals, Any] = {}
        self._closed = False

    def install(self) -> None:
        """Starts the reporting thread and installs the handlers; RuntimeError when not on the main thread."""
        threading.Thread(target=self._report_received, name="ifrt-preemption", daemon=True).start()
        for sig in self._signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError as e:  # not the main thread
                raise RuntimeError(f"cannot handle {sig.name} for preemption notices: {e}; call discover() from the "
                                   "main thread, or leave IFRT_PREEMPTION_SIGNALS unset") from None

    def close(self) -> None:
        """Stops reporting and puts the previous handlers back (where this thread may: see ``_on_signal``)."""
        self._closed = True
        self._received.put(None)
        for sig, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._closed:  # nobody reports any more: the signal does what it would have done without ifrt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        else:
            self._received.put(signum)  # SimpleQueue.put is safe in a signal handler; the thread does the rest

    def _report_received(self) -> None:
        while (signum := self._received.get()) is not None:
            if self._settled():
                continue
            log.warning("received %s: reporting a preemption notice; this process runs on until the preemption "
                        "sync point", signal.Signals(signum).name)
            try:
                self._report()
            except IfrtError as e:
                log.error("could not report the preemption notice: %s", e)
