"""Text from the wire made safe to show: every character that could move a terminal's cursor, start an escape
sequence, end a log line, or reorder what a person reads (bidi controls) is written out as a visible escape.

Used at the edges only (log formatters, terminal tables, the status page): values are stored and compared as they
came; only what is shown is escaped. Pure, no imports beyond the standard library."""

from __future__ import annotations

import logging
import unicodedata

ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
"""Controls (C0, DEL, C1 incl. ESC and CSI), format characters (bidi embeddings, overrides and isolates, the
left-to-right and right-to-left marks, the Arabic letter mark, zero-width joiners, BOM), lone surrogates (which
no UTF-8 stream can carry), and the Unicode line and paragraph separators."""
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def safe(text: object) -> str:
    r"""``text`` (``str()`` of it) with each character of ``ESCAPED_CATEGORIES`` written as a visible escape, as
    Python writes it in a string: a newline as ``\n``, ESC as ``\x1b``, RIGHT-TO-LEFT OVERRIDE as ``\u202e``.
    Printable text, every letter of every script included, is unchanged; so is text already made safe."""
    text = str(text)
    if text.isprintable():  # the common case: no character to look at one by one
        return text
    return "".join(_escaped(c) if unicodedata.category(c) in ESCAPED_CATEGORIES else c for c in text)


def safe_lines(text: str) -> str:
    """Multi-line text (a report, a traceback) with each line made ``safe`` and its line breaks kept: for text whose
    lines are its writer's own; a newline inside a caller's string in it is not told apart (``safe`` that string)."""
    return "\n".join(safe(line) for line in text.split("\n"))


def _escaped(c: str) -> str:
    code = ord(c)
    if c in _SHORT:
        return _SHORT[c]
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


class SafeFormatter(logging.Formatter):
    """A log formatter whose message is ``safe``: one record is one line, whatever its arguments carry (hostnames,
    failure reasons, key names from callers). A traceback keeps its own lines; each of them is made safe."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = safe(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return safe_lines(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return safe_lines(super().formatStack(stack_info))
