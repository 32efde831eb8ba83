"""What every cluster detector answers, and the readers they share to turn variables into checked values.

A detector reads one launcher's environment (a plain ``Mapping[str, str]``, never ``os.environ`` itself, so
tests are pure) and answers: is my launcher present, and what are the coordinator, this process's id, the
process count, the local rank and the local world size. Values a launcher does not give are ``None``.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ifrt.errors import InvalidArgument
from ifrt.hostport import join_host_port, split_host_port

DEFAULT_PORT = 8476
"""The coordinator's port when the launcher's environment does not name one (the launchers' own ports are theirs)."""
PORT_ENV = "IFRT_COORDINATOR_PORT"  # "9000": the coordinator's port on the host a detector found

_DIGITS = re.compile(r"[0-9]+")
# A host name (RFC 1123 labels, plus "_" which some clusters use) or an IPv4 address: "node001", "10.0.0.2".
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")


@dataclass(frozen=True)
class Detected:
    """One launcher's answer; a field the launcher does not give is None."""

    source: str
    """The detector's name, e.g. "slurm"."""
    coordinator: str | None
    """"host:port" ("[v6]:port" for an IPv6 literal) where the ifrt coordinator is expected."""
    process_id: int | None
    num_processes: int | None
    local_rank: int | None
    local_world_size: int | None
    variables: tuple[str, ...]
    """The variables read, in the order read, for messages."""
    origins: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """(field, "VARIABLE='raw value'") for each value found, so a message can say where a value came from."""
    attempt: int | None = None
    """How often the launcher restarted the job (its restart counter): the job attempt."""
    slice_index: int | None = None
    """The slice this process's host belongs to, where the launcher groups hosts in slices (TPU multislice)."""

    def __post_init__(self) -> None:
        for index, count in (("process_id", "num_processes"), ("local_rank", "local_world_size")):
            i, n = getattr(self, index), getattr(self, count)
            if i is not None and n is not None and i >= n:
                raise InvalidArgument(
                    f"{self.source} environment: {self.origin(index)} is out of range: expected it below "
                    f"{self.origin(count)}"
                )

    def origin(self, name: str) -> str:
        """Where the value of field ``name`` came from, e.g. "SLURM_PROCID='3'" (the bare value if unknown)."""
        return dict(self.origins).get(name, repr(getattr(self, name)))

    @property
    def coordinator_host(self) -> str | None:
        """The coordinator without its port (and without IPv6 brackets)."""
        if self.coordinator is None:
            return None
        return split_host_port(self.coordinator)[0]


class ClusterEnvironment:
    """One launcher: a name, a priority (higher wins when several are present) and two questions about an env."""

    name: ClassVar[str]
    priority: ClassVar[int]

    @classmethod
    def is_present(cls, env: Mapping[str, str]) -> bool:
        """Whether this launcher started the process (its marker variables are set)."""
        raise NotImplementedError

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> Detected:
        """This launcher's values; InvalidArgument naming the variable, its value and the expected form."""
        raise NotImplementedError


class EnvReader:
    """Reads one launcher's variables, remembering which it read and where each value came from."""

    def __init__(self, env: Mapping[str, str], source: str) -> None:
        self.env = env
        self.source = source
        self.read: list[str] = []
        self.origins: dict[str, str] = {}

    def get(self, var: str) -> str | None:
        """The raw value of ``var`` (None if unset), recorded as read when set."""
        value = self.env.get(var)
        if value is not None and var not in self.read:
            self.read.append(var)
        return value

    def first(self, *variables: str) -> tuple[str, str] | tuple[None, None]:
        """(name, value) of the first of ``variables`` that is set: a preference order between equivalents."""
        for var in variables:
            value = self.get(var)
            if value is not None:
                return var, value
        return None, None

    def error(self, var: str, value: str, expected: str) -> InvalidArgument:
        """The error for a malformed variable: "slurm environment: SLURM_PROCID='x' is malformed: expected ..."."""
        return InvalidArgument(f"{self.source} environment: {var}={value!r} is malformed: expected {expected}")

    def require(self, var: str, expected: str) -> str:
        """The value of ``var``; InvalidArgument if this (present) environment lacks it."""
        value = self.get(var)
        if value is None:
            raise InvalidArgument(f"{self.source} environment: {var} is not set: expected {expected}")
        return value

    def integer(self, var: str, *, field: str | None = None, minimum: int = 0, required: bool = False) -> int | None:
        """``var`` as a decimal integer >= ``minimum`` ("3", not "-1", "3.0" or "three"); None if unset."""
        expected = "a non-negative integer such as '3'" if minimum == 0 else f"an integer >= {minimum}"
        raw = self.require(var, expected) if required else self.get(var)
        if raw is None:
            return None
        text = raw.strip()
        if not _DIGITS.fullmatch(text) or int(text) < minimum:
            raise self.error(var, raw, expected)
        if field is not None:
            self.note(field, f"{var}={raw!r}")
        return int(text)

    def host(self, var: str, *, field: str = "coordinator") -> str:
        """``var`` as a bare host ("node001", "10.0.0.2", "fe80::1"), without a port."""
        raw = self.require(var, "a host name or IP address")
        text = raw.strip()
        if not is_host(text):
            raise self.error(var, raw, "a host name or IP address without a port, such as 'node001' or '10.0.0.2'")
        self.note(field, f"{var}={raw!r}")
        return text.strip("[]")

    def address(self, var: str, *, field: str = "coordinator") -> str:
        """``var`` as a host, with or without a port ("node001", "node001:8476", "[fe80::1]:8476"): the host."""
        raw = self.require(var, "a host name or IP address")
        host = host_of(raw)
        if host is None:
            raise self.error(var, raw, "a host name or IP address, optionally with a port, such as 'node001' or "
                                       "'10.0.0.2:8476'")
        self.note(field, f"{var}={raw!r}")
        return host

    def note(self, field: str, origin: str) -> None:
        """Record where ``field``'s value came from, for messages."""
        self.origins[field] = origin

    def coordinator(self, host: str) -> str:
        """``host`` joined with the ifrt coordinator port: IFRT_COORDINATOR_PORT, else DEFAULT_PORT."""
        raw = self.get(PORT_ENV)
        port = DEFAULT_PORT
        if raw is not None:
            text = raw.strip()
            if not _DIGITS.fullmatch(text) or not 0 < int(text) < 65536:
                raise self.error(PORT_ENV, raw, "a port from 1 to 65535")
            port = int(text)
        return join_host_port(host, port)

    def detected(
        self,
        *,
        coordinator: str | None = None,
        process_id: int | None = None,
        num_processes: int | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        attempt: int | None = None,
        slice_index: int | None = None,
    ) -> Detected:
        """The Detected for this launcher, with the variables read and the origin of each value found."""
        values = {"coordinator": coordinator, "process_id": process_id, "num_processes": num_processes,
                  "local_rank": local_rank, "local_world_size": local_world_size, "attempt": attempt,
                  "slice_index": slice_index}
        return Detected(
            source=self.source,
            coordinator=coordinator,
            process_id=process_id,
            num_processes=num_processes,
            local_rank=local_rank,
            local_world_size=local_world_size,
            variables=tuple(self.read),
            origins=tuple((f, o) for f, o in self.origins.items() if values.get(f) is not None),
            attempt=attempt,
            slice_index=slice_index,
        )


def is_host(text: str) -> bool:
    """Whether ``text`` is a host name, an IPv4 address or an IPv6 literal (bare or in brackets)."""
    if ":" in text:
        try:
            ipaddress.IPv6Address(text.strip("[]").split("%")[0])
        except ValueError:
            return False
        return True
    return bool(_HOSTNAME.fullmatch(text))


def host_of(address: str) -> str | None:
    """The host of "host", "host:port", "v6" or "[v6]:port"; None if it is none of these.

    "node001" -> "node001"; "10.0.0.2:8471" -> "10.0.0.2"; "[fd00::2]:8476" -> "fd00::2"; "a:b:c" -> None
    """
    text = address.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]")
        port_ok = not port or (port.startswith(":") and _DIGITS.fullmatch(port[1:]) is not None)
        if sep and port_ok and ":" in host and is_host(host):
            return host
        return None
    if text.count(":") == 1:
        text, _, port = text.partition(":")
        if not _DIGITS.fullmatch(port):
            return None
    return text.strip("[]") if text and is_host(text) else None
