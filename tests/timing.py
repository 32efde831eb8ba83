"""Where the suite's time goes: after the run, each test file's wall-clock seconds (setup, call and teardown of its
tests) and CPU seconds (the test process's own and that of the processes it started and waited for), largest first.
On two cores the CPU column is what bounds the suite; the wall column is what a file costs when run alone."""

from __future__ import annotations

import resource
import time
from collections import defaultdict

import pytest

SHOWN = 30
"""How many files the summary lists (the rest are summed in one line)."""


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


_started = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    item.stash[_started] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" and _started in item.stash:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_started]))


class _Files:
    """The controller's tally (with pytest-xdist, the workers' reports arrive here)."""

    def __init__(self) -> None:
        self.wall: defaultdict[str, float] = defaultdict(float)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.tests: defaultdict[str, int] = defaultdict(int)
        self.started = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.partition("::")[0]
        self.wall[path] += report.duration
        if report.when == "call":
            self.tests[path] += 1
        self.cpu[path] += sum(value for name, value in report.user_properties if name == "cpu_s")

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.wall:
            return
        write = terminalreporter.write_line
        ranked = sorted(self.wall, key=self.wall.get, reverse=True)
        terminalreporter.section("time per test file (seconds, largest first)")
        write(f"{'wall':>8} {'cpu':>8} {'tests':>6}  file")
        for path in ranked[:SHOWN]:
            write(f"{self.wall[path]:8.1f} {self.cpu[path]:8.1f} {self.tests[path]:6d}  {path}")
        rest = ranked[SHOWN:]
        if rest:
            write(f"{sum(self.wall[p] for p in rest):8.1f} {sum(self.cpu[p] for p in rest):8.1f} "
                  f"{sum(self.tests[p] for p in rest):6d}  the other {len(rest)} files")
        write(f"{sum(self.wall.values()):8.1f} {sum(self.cpu.values()):8.1f} {sum(self.tests.values()):6d}  all, "
              f"in {time.monotonic() - self.started:.0f} s of wall-clock time")


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without workers
        config.pluginmanager.register(_Files(), "ifrt-timing-files")
