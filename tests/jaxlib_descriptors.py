"""The .proto descriptors a jaxlib embeds in its shared library, read without importing it (for any interpreter's).

protoc's C++ output keeps each file's serialized ``FileDescriptorProto`` in the library, beginning with its name
field (``0x0a``, the name's length, the name). tests/test_xla_layouts.py compares XLA's coordination protocol and
JAX's topology records, as each installed jaxlib declares them, with the copies in proto/ifrt/xla/v1/.
"""

from __future__ import annotations

import functools
import mmap
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.message import DecodeError

WANTED = re.compile(rb"\n([\x01-\x7f])([\w/]*(?:coordination_service|distributed/protocol)\.proto)")
"""An embedded descriptor's opening (its name field) for the files compared: every coordination_service.proto
(tsl's, package tensorflow; XLA's own since jaxlib 0.5, package xla.coordination) and JAX's protocol.proto."""
MARKERS = (b"coordination_service.proto", b"distributed/protocol.proto")
"""Literals a library holding a wanted descriptor contains: a cheap test before the pattern's scan."""
FILE_FIELDS = {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2, 9: 2, 10: 0, 11: 0, 12: 2, 14: 0, 15: 2}
"""FileDescriptorProto's field numbers and wire types: the serialized descriptor ends at the first tag outside."""


@dataclass(frozen=True)
class Embedded:
    """One descriptor a jaxlib embeds, and the library it was read from."""

    library: Path
    file: descriptor_pb2.FileDescriptorProto


@dataclass(frozen=True)
class Jaxlib:
    """An installed jaxlib: its version, its package folder, and the descriptors compared, by .proto file name."""

    version: str
    folder: Path
    descriptors: dict[str, Embedded]

    def coordination(self) -> Embedded:
        """The coordination service JAX's client speaks: XLA's own where this jaxlib has it (0.5 on), else tsl's
        (the jaxlib may embed both: 0.10's libjax_common.so keeps tsl's for TensorFlow, unused by JAX)."""
        for package in ("xla.coordination", "tensorflow"):
            found = [e for name, e in self.descriptors.items()
                     if name.endswith("coordination_service.proto") and e.file.package == package]
            if len(found) > 1:
                raise LookupError(f"jaxlib {self.version} embeds several {package} coordination services: "
                                  f"{sorted(e.file.name for e in found)}")
            if found:
                return found[0]
        raise LookupError(f"jaxlib {self.version} ({self.folder}) embeds no coordination_service.proto: "
                          f"found only {sorted(self.descriptors)}")

    def protocol(self) -> Embedded:
        """JAX's topology records (LocalTopologyProto, GlobalTopologyProto, DeviceProto)."""
        found = [e for name, e in self.descriptors.items() if name.endswith("distributed/protocol.proto")]
        if len(found) != 1:
            raise LookupError(f"jaxlib {self.version} ({self.folder}) embeds {len(found)} "
                              "xla/pjrt/distributed/protocol.proto descriptors, not one")
        return found[0]


def _varint(data: mmap.mmap, at: int) -> tuple[int, int]:
    """The varint at ``at`` and the offset after it; IndexError past the end."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _descriptor_end(data: mmap.mmap, start: int) -> int:
    """Where the FileDescriptorProto serialized at ``start`` ends: at the first tag that is not one of its fields
    (the array's closing NUL, in practice), or at a field that would run past the end."""
    at = start
    try:
        while at < len(data):
            tag, after = _varint(data, at)
            wire_type = FILE_FIELDS.get(tag >> 3)
            if wire_type != tag & 7:
                break
            length, after = _varint(data, after)
            after += length if wire_type == 2 else 0
            if after > len(data):
                break
            at = after
    except IndexError:
        pass
    return at


def _read_library(library: Path) -> dict[str, bytes]:
    """The wanted descriptors ``library`` embeds, serialized, by file name (empty when it has none)."""
    found: dict[str, bytes] = {}
    with library.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if not any(data.find(marker) >= 0 for marker in MARKERS):
            return found
        for match in WANTED.finditer(data):  # type: ignore[call-overload]  # re reads an mmap as a buffer
            name = match.group(2)
            if match.group(1)[0] != len(name):
                continue
            serialized = data[match.start():_descriptor_end(data, match.start())]
            try:
                file = descriptor_pb2.FileDescriptorProto.FromString(serialized)
            except DecodeError:  # the bytes only looked like a descriptor's opening
                continue
            # a real descriptor: its name is the one matched (a second file run into would rename it) and it
            # declares something; a bare string that happens to look like a name field does not
            if file.name.encode() == name and file.package and (file.message_type or file.service):
                if found.get(file.name, serialized) != serialized:
                    raise LookupError(f"{library} embeds two different descriptors named {file.name}")
                found[file.name] = serialized
    return found


def locate_jaxlib(python: str) -> tuple[str, Path]:
    """The version and package folder of the jaxlib ``python`` imports, asked of that interpreter (which imports
    only jaxlib's light package, not its libraries)."""
    answer = subprocess.run(
        [python, "-c", "import os, jaxlib, jaxlib.version; print(jaxlib.version.__version__); "
                       "print(os.path.dirname(jaxlib.__file__))"],
        capture_output=True, text=True, timeout=60)
    if answer.returncode != 0:
        raise RuntimeError(f"{python} cannot import jaxlib: {answer.stderr.strip()[-500:]}")
    version, folder = answer.stdout.split()[-2:]
    return version, Path(folder)


@functools.cache
def read_jaxlib(version: str, folder: Path) -> Jaxlib:
    """The wanted descriptors of every shared library in jaxlib's ``folder``. Cached: the libraries are hundreds
    of MB (mmapped and scanned, well under a second each)."""
    descriptors: dict[str, Embedded] = {}
    for library in sorted(folder.rglob("*.so")):
        for name, serialized in _read_library(library).items():
            file = descriptor_pb2.FileDescriptorProto.FromString(serialized)
            if name in descriptors and descriptors[name].file != file:
                raise LookupError(f"jaxlib {version}: {descriptors[name].library} and {library} embed different "
                                  f"descriptors named {name}: cannot tell which JAX uses")
            descriptors.setdefault(name, Embedded(library, file))
    if not descriptors:
        raise LookupError(f"jaxlib {version}: no shared library under {folder} embeds a coordination_service.proto "
                          "or distributed/protocol.proto descriptor")
    return Jaxlib(version, folder, descriptors)
