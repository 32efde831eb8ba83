"""A warm spare's wait (``ifrt run --spare N``): the program has started and imported, and blocks here, inside the
ifrt client and before any connection to the coordinator, until its agent hands it a process.

The agent starts a spare with its workers' command and environment, less the variables that make one worker a given
rank, plus ``IFRT_SPARE=1``. When the coordinator has decided to replace one of the agent's workers, the agent writes
one line on the spare's stdin: a JSON object of those variables (``HANDED``). The spare sets them, drops
``IFRT_SPARE``, and goes on as the replacement would have started: it registers as the next incarnation of the
process id. Until then it holds no session, registers nothing, and is no worker of the job anywhere.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import MutableMapping
from typing import TextIO

from ifrt.errors import InvalidArgument
from ifrt.settings import ATTEMPT_ENV, LOCAL_RANK_ENV, PROCESS_ID_ENV, TRANSFER_BIND_ENV

SPARE_ENV = "IFRT_SPARE"  # "1": this process is a warm spare of `ifrt run --spare`: it waits on stdin for a process
HANDED = (LOCAL_RANK_ENV, PROCESS_ID_ENV, TRANSFER_BIND_ENV, ATTEMPT_ENV)
"""What makes a worker one rank of one attempt: a spare is started without them and handed them."""
MAX_LINE_BYTES = 4096
"""The longest hand-off line a spare reads (four short variables)."""


def hand_off_line(variables: dict[str, str]) -> bytes:
    """The line the agent writes on a spare's stdin to make it the worker with ``variables`` (only ``HANDED``)."""
    unknown = sorted(variables.keys() - set(HANDED))
    if unknown:
        raise InvalidArgument(f"a spare is handed only {', '.join(HANDED)}; not {', '.join(unknown)}")
    return json.dumps(variables, separators=(",", ":")).encode() + b"\n"


def parse_hand_off(line: str) -> dict[str, str]:
    """The variables of a hand-off line; InvalidArgument saying what was wrong and what was expected."""
    try:
        variables = json.loads(line)
    except ValueError as e:
        raise InvalidArgument(f"a spare's hand-off line is not JSON ({e}): expected one JSON object of "
                              f"{', '.join(HANDED)} on stdin, from `ifrt run --spare`") from None
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise InvalidArgument("a spare's hand-off line is not a JSON object of strings: expected "
                              f"{{name: value}} for {', '.join(HANDED)}")
    unknown = sorted(variables.keys() - set(HANDED))
    if unknown:
        raise InvalidArgument(f"a spare's hand-off line sets {', '.join(unknown)}: expected only "
                              f"{', '.join(HANDED)}")
    return variables


def is_spare(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether this process is a warm spare waiting for its hand-off (``IFRT_SPARE`` set)."""
    return bool((os.environ if environ is None else environ).get(SPARE_ENV, "").strip())


def await_hand_off(environ: MutableMapping[str, str] | None = None, stdin: TextIO | None = None) -> bool:
    """In a spare (``IFRT_SPARE`` set), blocks until its agent hands it a process, then sets the handed variables
    in ``environ`` (default ``os.environ``) and drops ``IFRT_SPARE``; returns whether it waited. A spare whose agent
    closes its stdin without a hand-off is not needed: it exits with 0. Elsewhere, returns False at once."""
    env = os.environ if environ is None else environ
    if not is_spare(env):
        return False
    source = sys.stdin if stdin is None else stdin
    line = source.readline(MAX_LINE_BYTES)
    if not line:
        raise SystemExit(0)  # released by its agent: a spare that was never used ends quietly
    if not line.endswith("\n"):
        raise InvalidArgument(f"a spare's hand-off line is longer than {MAX_LINE_BYTES} bytes: expected one JSON "
                              f"object of {', '.join(HANDED)}")
    variables = parse_hand_off(line)
    for name in HANDED:
        env.pop(name, None)
    env.update(variables)
    env.pop(SPARE_ENV, None)
    return True
