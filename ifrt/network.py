"""Where a host sits in the network: a path from the root to the leaf of the fabric (spine, block, rack; the host
itself not included), compared level by level with names in natural order (``node2`` < ``node10``).

Ids assigned by the coordinator and meshes follow ``network_order``: processes that share the smallest domain are
neighbours. A process without a position has the empty path, which sorts first, as XLA sorts one.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from ifrt.errors import InvalidArgument

MAX_LEVELS = 8
"""Levels a path may have: Kueue's topologies have at most 8, real fabrics 2 to 4."""
MAX_NAME_BYTES = 255
"""A level's name at most: a DNS label or a Kubernetes label value (63) fits many times over."""
_DIGITS = re.compile(r"(\d+)")
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Characters a name may not hold: controls (a terminal escape), format characters (bidi marks and overrides,
zero-width ones), surrogates, line and paragraph separators: each makes a name print as another, or not at all."""


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key for a name with runs of digits compared as numbers: ``node2`` < ``node10`` < ``node10a``, ``rack9``
    < ``rack10``; ``n01`` and ``n1`` are ordered by the text where the numbers are equal."""
    parts: list[tuple[int, int | str]] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            parts.append((0, int(part)))
            parts.append((1, part))  # equal numbers: the text decides (n01 before n1), so the order is total
        elif part:
            parts.append((1, part))
    return tuple(parts)


def path_key(path: Sequence[str]) -> tuple[tuple[tuple[int, int | str], ...], ...]:
    """Sort key for a network path: level by level in natural order; a path that is a prefix of another sorts
    first (the empty path before every other)."""
    return tuple(natural_key(level) for level in path)


def check_path(path: Sequence[str], source: str) -> tuple[str, ...]:
    """``path`` as a tuple, or InvalidArgument naming ``source`` and what is wrong: more than MAX_LEVELS levels,
    an empty level, a level over MAX_NAME_BYTES, or a control or bidi character (``hidden_character``)."""
    levels = tuple(path)
    if len(levels) > MAX_LEVELS:
        raise InvalidArgument(f"{source}: a network path of {len(levels)} levels ({', '.join(levels)}): expected at "
                              f"most {MAX_LEVELS}, from the root (spine) to the rack")
    for i, level in enumerate(levels):
        if not isinstance(level, str) or not level.strip():
            raise InvalidArgument(f"{source}: level {i} of the network path {list(levels)} is empty: expected a "
                                  "switch, block or rack name at every level")
        size = len(level.encode(errors="surrogatepass"))
        if size > MAX_NAME_BYTES:
            raise InvalidArgument(f"{source}: level {i} of the network path is {size} bytes long: "
                                  f"expected at most {MAX_NAME_BYTES}")
        hidden = hidden_character(level.strip())
        if hidden:
            raise InvalidArgument(f"{source}: level {i} of the network path ({level.strip()!r}) holds {hidden}, a "
                                  "control, format or bidi character: expected a name that prints as it is")
    return tuple(level.strip() for level in levels)


def hidden_character(name: str) -> str:
    """The first character of ``name`` that no name may hold (``_REFUSED_CATEGORIES``), as ``U+202E RIGHT-TO-LEFT
    OVERRIDE``; "" where there is none."""
    for character in name:
        if unicodedata.category(character) in _REFUSED_CATEGORIES:
            what = unicodedata.name(character, "")
            return f"U+{ord(character):04X}" + (f" {what}" if what else "")
    return ""
