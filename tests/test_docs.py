"""The documentation as users read it: every relative link resolves, the README stays a short front door, and every
Python block in README.md and docs/*.md either runs as written against a real coordinator or says it is an
illustration.

A Python block is preceded by a marker, an HTML comment that does not render:
``<!-- snippet: run processes=N id=IFRT_PROCESS_ID env=K=V -->`` runs the block in N processes (``id`` names the
variable that gets 0..N-1: ``IFRT_PROCESS_ID`` or ``IFRT_LOCAL_RANK``; ``env`` may repeat, and each ``K=V`` must be
said in the text just above); ``<!-- snippet: continues -->`` appends the block to the page's previous run block;
``<!-- snippet: illustration (why) -->`` is not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import finish
from tests.requirements import require

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 300
ID_VARIABLES = ("IFRT_PROCESS_ID", "IFRT_LOCAL_RANK")
STATED_WITHIN_LINES = 8  # how far above a run marker its environment must be said

FENCE = re.compile(r"^\s*(```|~~~)")
MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def shown(path: Path) -> str:
    """``path`` relative to the checkout where it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation other than '-' and '_' dropped,
    spaces made '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page (a repeated slug gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file or #anchor does not exist, with its line and why."""
    problems = []
    text = page.read_text()
    for number, line in prose_lines(text):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = f"{shown(page)}:{number}: ({target})"
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                problems.append(f"{where} no such file {shown(resolved)}")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
                problems.append(f"{where} no heading with anchor #{anchor} in {shown(resolved)}")
    return problems


@dataclass
class Snippet:
    """A runnable block, with the blocks marked as continuing it."""

    where: str
    processes: int
    id_variable: str
    env: dict[str, str]
    code: str
    parts: list[str] = field(default_factory=list)


def snippets(page: Path) -> tuple[list[Snippet], list[str]]:
    """The runnable snippets of ``page``, and every problem with its Python blocks' markers."""
    lines = page.read_text().splitlines()
    found: list[Snippet] = []
    problems: list[str] = []
    fenced = False
    for i, line in enumerate(lines):
        if FENCE.match(line):
            opening = not fenced
            fenced = not fenced
            if not (opening and line.strip().lower() in ("```python", "```py")):
                continue
        else:
            continue
        where = f"{shown(page)}:{i + 1}"
        body = []
        for code_line in lines[i + 1:]:
            if FENCE.match(code_line):
                break
            body.append(code_line)
        code = "\n".join(body) + "\n"
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        if marker is None:
            problems.append(f"{where}: a python block without a marker on the line before it "
                            "(<!-- snippet: run ... -->, continues, or illustration (why))")
            continue
        words = marker.group(1).split()
        kind = words[0] if words else ""
        if kind == "illustration":
            if len(words) < 2:
                problems.append(f"{where}: an illustration marker must say why it is not run")
        elif kind == "continues":
            if not found:
                problems.append(f"{where}: 'continues' without a run block before it on the page")
            else:
                found[-1].code += code
                found[-1].parts.append(where)
        elif kind == "run":
            options: dict[str, str] = {}
            env: dict[str, str] = {}
            for word in words[1:]:
                key, _, value = word.partition("=")
                if key == "env":
                    name, _, setting = value.partition("=")
                    env[name] = setting
                else:
                    options[key] = value
            if not options.get("processes", "").isdigit() or options.get("id", ID_VARIABLES[0]) not in ID_VARIABLES:
                problems.append(f"{where}: a run marker needs processes=N and id= one of {ID_VARIABLES}; "
                                f"got {marker.group(1)!r}")
                continue
            above = "\n".join(lines[max(0, i - 1 - STATED_WITHIN_LINES):i - 1])
            for name, setting in env.items():
                if f"{name}={setting}" not in above:
                    problems.append(f"{where}: the text above the block must say {name}={setting} (the environment "
                                    "the snippet runs with)")
            found.append(Snippet(where, int(options["processes"]), options.get("id", ID_VARIABLES[0]), env, code,
                                 [where]))
        else:
            problems.append(f"{where}: unknown snippet marker {marker.group(1)!r}: expected run, continues or "
                            "illustration")
    return found, problems


def all_snippets() -> list[Snippet]:
    return [s for page in PAGES for s in snippets(page)[0]]


def test_every_relative_link_resolves():
    problems = [p for page in PAGES for p in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_is_a_short_front_door():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, (f"README.md has {lines} lines: expected under {README_MAX_LINES}; "
                                      "move detail to a page in docs/")


def test_the_readme_gives_the_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/test.sh" in readme and "./scripts/demo.sh" in readme


def test_every_python_block_is_run_or_marked_an_illustration():
    problems = [p for page in PAGES for p in snippets(page)[1]]
    assert not problems, "\n".join(problems)
    assert all_snippets(), "no runnable snippet found: the markers are not being read"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A broken link, a missing anchor, an unmarked block and an unstated environment are each reported."""
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n## Some `code` here\n\n[ok](#some-code-here) [gone](nothing.md) [bad](#nowhere)\n\n"
                    "```python\nprint(1)\n```\n\nwith nothing said\n<!-- snippet: run processes=2 env=A=1 -->\n"
                    "```python\nprint(2)\n```\n")
    links = broken_links(page)
    found, problems = snippets(page)
    assert [p.split(": ", 1)[1] for p in links] == [
        f"(nothing.md) no such file {tmp_path / 'nothing.md'}", f"(#nowhere) no heading with anchor #nowhere in {page}"]
    assert len(problems) == 2 and "without a marker" in problems[0] and "must say A=1" in problems[1]
    assert [(s.processes, s.env) for s in found] == [(2, {"A": "1"})]


@pytest.mark.parametrize("snippet", all_snippets(), ids=lambda s: s.where)
def test_snippet_runs_as_written(snippet: Snippet, start_coordinator):
    for module in ("jax", "torch"):
        imports = re.search(rf"^\s*import (ifrt\.)?{module}\b", snippet.code, re.M)
        if imports and importlib.util.find_spec(module) is None:
            require(module, f"pip install 'ifrt-topology[{module}]' (scripts/test.sh installs it)")
    coordinator = start_coordinator(num_processes=snippet.processes)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("IFRT_", "JAX_", "XLA_"))}
    base.update(IFRT_COORDINATOR=coordinator.address, OMP_NUM_THREADS="1", **snippet.env)
    children = [subprocess.Popen([sys.executable, "-c", snippet.code], cwd=ROOT,
                                 env={**base, snippet.id_variable: str(i)},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(snippet.processes)]
    results = [finish(child, timeout=120) for child in children]
    failed = [f"process {i} exited {code}:\n{err[-3000:]}" for i, (code, _, err) in enumerate(results) if code != 0]
    assert not failed, f"{' + '.join(snippet.parts)} does not run as written:\n" + "\n".join(failed)
