"""A worker that looks for its agent's secrets as an attacker would, for tests/test_agent_credentials_reach.py.

    python -I credential_walk_worker.py

It walks up its ancestors (parent, grandparent, ... up to pid 1) and reads, where it may, each one's cmdline,
environ, fd/ (the targets, and each descriptor opened again without blocking), maps and mem, and every file a path in
any of them names (``--flag=/path`` too). Every 64-character hex string it finds is hashed; a hash listed in
``WALK_LOOK_FOR`` (``name=sha256hex,...``) is a find. Prints one line: ``walk {json}``, with ``found`` (name -> where)
and ``denied`` (what it could not read). Standard library only: it may run as an unprivileged user under any Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat

HEX64 = re.compile(rb"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
MAX_FILE_BYTES = 1 << 20
MAX_REGION_BYTES = 256 << 20


def main() -> None:
    wanted = dict(item.split("=", 1)[::-1] for item in os.environ.get("WALK_LOOK_FOR", "").split(",") if item)
    found: dict[str, list[str]] = {}
    denied: list[str] = []
    seen_files: set[str] = set()

    def scan(data: bytes, where: str) -> None:
        for match in HEX64.findall(data):
            name = wanted.get(hashlib.sha256(match).hexdigest())
            if name is not None and where not in found.setdefault(name, []):
                found[name].append(where)

    def read(path: str, where: str, limit: int = MAX_FILE_BYTES) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            denied.append(f"{where}: {e.strerror}")
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode) and not path.startswith("/proc/"):
                return None  # a device or socket named somewhere: not a secret's file
            return os.read(fd, limit)
        except OSError as e:
            denied.append(f"{where}: {e.strerror}")
            return None
        finally:
            os.close(fd)

    def files_in(data: bytes, where: str) -> None:
        for token in re.split(rb"[\x00\n=:, ]", data):
            path = token.decode(errors="replace")
            if path.startswith("/") and path not in seen_files and len(seen_files) < 2000:
                seen_files.add(path)
                if (content := read(path, f"file {path} (named in {where})")) is not None:
                    scan(content, f"file {path} (named in {where})")

    pid = os.getppid()
    while pid > 1:
        base = f"/proc/{pid}"
        for name in ("cmdline", "environ"):
            if (data := read(f"{base}/{name}", f"{name} of {pid}")) is not None:
                scan(data, f"{name} of {pid}")
                files_in(data, f"{name} of {pid}")
        try:
            fds = os.listdir(f"{base}/fd")
        except OSError as e:
            denied.append(f"fd/ of {pid}: {e.strerror}")
            fds = []
        for fd in fds:
            try:
                target = os.readlink(f"{base}/fd/{fd}")
            except OSError:
                continue
            files_in(target.encode(), f"fd {fd} of {pid}")
            if (data := read(f"{base}/fd/{fd}", f"fd {fd} of {pid} opened again", 64 << 10)) is not None:
                scan(data, f"fd {fd} of {pid}")
        memory(pid, scan, denied)
        pid = parent_of(pid)
    print("walk " + json.dumps({"found": found, "denied": denied[:200]}), flush=True)


def memory(pid: int, scan, denied: list[str]) -> None:
    """Scans every readable region of ``pid``'s memory."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            regions = [line.split() for line in f]
        mem = open(f"/proc/{pid}/mem", "rb", buffering=0)  # noqa: SIM115 - closed below
    except OSError as e:
        denied.append(f"memory of {pid}: {e.strerror}")
        return
    with mem:
        for region in regions:
            start, end = (int(x, 16) for x in region[0].split("-"))
            if not region[1].startswith("r") or end - start > MAX_REGION_BYTES or region[-1] in ("[vvar]",
                                                                                                "[vsyscall]"):
                continue
            try:
                mem.seek(start)
                scan(mem.read(end - start), f"memory of {pid}")
            except (OSError, ValueError, OverflowError):
                continue


def parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


if __name__ == "__main__":
    main()
