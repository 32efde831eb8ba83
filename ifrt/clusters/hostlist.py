"""SLURM's compressed host lists, expanded: "node[001-003,007],gpu5" -> node001 node002 node003 node007 gpu5.

The syntax, as SLURM writes it in SLURM_JOB_NODELIST / SLURM_STEP_NODELIST:

- hosts are separated by commas outside brackets: "login1,gpu5"
- a bracket holds comma-separated numbers and ranges: "node[1,3-4]" -> node1 node3 node4
- a range is padded to the width of its low end: "node[08-10]" -> node08 node09 node10, "node[8-10]" -> node8
  node9 node10
- text may follow a bracket, and a host may have several brackets, the last varying fastest:
  "rack[1-2]-n[01-02]" -> rack1-n01 rack1-n02 rack2-n01 rack2-n02
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")

# One host pattern: literal text and bracket groups; a group is a list of (low, high, width) ranges.
_Part = str | list[tuple[int, int, int]]


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    items.append(text[start:])
    return items


def _parse_group(body: str) -> list[tuple[int, int, int]]:
    ranges = []
    for r in body.split(","):
        m = _RANGE.fullmatch(r.strip())
        if m is None:
            raise ValueError(f"[{body}] holds {r!r}, not a number or a range like '001-003'")
        low, high = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if high < low:
            raise ValueError(f"range {r!r} runs backwards")
        ranges.append((low, high, len(m[1])))
    return ranges


def _parse_item(item: str) -> list[_Part]:
    if not item.strip():
        raise ValueError("an empty host name (two commas in a row, or a leading or trailing comma)")
    parts: list[_Part] = []
    for piece in re.split(r"(\[[^\]]*\])", item.strip()):
        if piece.startswith("["):
            parts.append(_parse_group(piece[1:-1]))
        elif piece:
            parts.append(piece)
    return parts


def _expand_item(parts: list[_Part]) -> Iterator[str]:
    # Lazily, last group varying fastest (itertools.product would materialize every group before the first host).
    def walk(i: int, prefix: str) -> Iterator[str]:
        if i == len(parts):
            yield prefix
            return
        part = parts[i]
        if isinstance(part, str):
            yield from walk(i + 1, prefix + part)
            return
        for low, high, width in part:
            for n in range(low, high + 1):
                yield from walk(i + 1, prefix + str(n).zfill(width))

    return walk(0, "")


def iter_hostlist(value: str) -> Iterator[str]:
    """The hosts of a SLURM host list, lazily (the whole list is checked first); ValueError if malformed."""
    items = [_parse_item(item) for item in _split_outside_brackets(value)]
    return itertools.chain.from_iterable(_expand_item(parts) for parts in items)


def expand_hostlist(value: str) -> list[str]:
    """"node[001-003,007],gpu5" -> ["node001", "node002", "node003", "node007", "gpu5"]; ValueError if malformed."""
    return list(iter_hostlist(value))
