"""Where a process's network position comes from: small pure parsers for each source, and the order they are tried.

Sources, the first that gives a position wins:

1. ``network=`` (``discover``/``Client``), else ``IFRT_NETWORK_NODES`` (comma-separated, root first);
2. XLA's ``XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES`` (same form), so a job that already sets it needs nothing more;
3. Slurm's ``SLURM_TOPOLOGY_ADDR`` with ``SLURM_TOPOLOGY_ADDR_PATTERN`` (the switch levels; the node dropped);
4. the node's labels in the file ``IFRT_NODE_LABELS_FILE`` (``key=value`` a line), for the first label family of
   ``LABEL_FAMILIES`` the node has.

Everything here takes plain values (the environment as a mapping, the labels file's text); reading the file is
the caller's (``ifrt.settings``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ifrt.errors import InvalidArgument
from ifrt.network import check_path

NETWORK_NODES_ENV = "IFRT_NETWORK_NODES"
XLA_NETWORK_NODES_ENV = "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES"
SLURM_ADDR_ENV = "SLURM_TOPOLOGY_ADDR"
SLURM_PATTERN_ENV = "SLURM_TOPOLOGY_ADDR_PATTERN"
NODE_LABELS_FILE_ENV = "IFRT_NODE_LABELS_FILE"

LABEL_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nvidia-topograph", ("network.topology.nvidia.com/core", "network.topology.nvidia.com/spine",
                          "network.topology.nvidia.com/leaf")),
    ("aws", ("topology.k8s.aws/network-node-layer-1", "topology.k8s.aws/network-node-layer-2",
             "topology.k8s.aws/network-node-layer-3")),
    ("gce", ("cloud.google.com/gce-topology-block", "cloud.google.com/gce-topology-subblock")),
    ("oci", ("oci.oraclecloud.com/host.network_block_id", "oci.oraclecloud.com/host.rack_id")),
)
"""Node label families, tried in this order, each root (spine) to leaf (rack). NVIDIA's topograph comes first: where
it runs it was installed on purpose and describes the switches themselves, on any cloud. ``accelerator`` (an NVLink
domain) and GCE's ``-host`` are left out: the first is the slice (the ``cuda`` plugin's fabric info), the second the
host itself. A family counts when the node has any of its labels; the levels it has are taken root first, and a
missing level in between is an error (the path would silently skip a switch)."""


@dataclass(frozen=True)
class Position:
    """A network path (root to leaf, the host not included) and where it came from (``IFRT_NETWORK_NODES``, ...)."""

    path: tuple[str, ...]
    source: str


def parse_nodes(value: str, source: str) -> tuple[str, ...]:
    """``"spine1, block2,rack7"`` -> ``("spine1", "block2", "rack7")``; InvalidArgument naming ``source`` for an empty
    level (``"spine1,,rack7"``), too many levels or too long a name."""
    if not value.strip():
        return ()
    return check_path(value.split(","), source)


def parse_slurm(address: str, pattern: str) -> tuple[str, ...]:
    """The switch levels of Slurm's topology address: ``root.sw1.rack3.node7`` with pattern
    ``switch.switch.switch.node`` -> ``("root", "sw1", "rack3")``. InvalidArgument naming both variables if
    their lengths differ."""
    names, kinds = address.strip().split("."), pattern.strip().split(".")
    if len(names) != len(kinds):
        raise InvalidArgument(f"{SLURM_ADDR_ENV}={address!r} has {len(names)} levels but {SLURM_PATTERN_ENV}="
                              f"{pattern!r} has {len(kinds)}: expected one pattern entry (switch or node) per level")
    levels = [name for name, kind in zip(names, kinds, strict=True) if kind.strip().lower() != "node"]
    return check_path(levels, f"{SLURM_ADDR_ENV}={address!r}")


def parse_labels(text: str, origin: str) -> dict[str, str]:
    """``key=value`` lines -> a dict; blank lines and ``#`` comments skipped, values may be quoted (as
    ``kubectl``'s jsonpath or a shell writes them). InvalidArgument naming ``origin`` and the line otherwise."""
    labels = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(f"{origin} line {number} is {line[:80]!r}: expected key=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        labels[key.strip()] = value
    return labels


def from_labels(labels: Mapping[str, str], origin: str) -> tuple[tuple[str, ...], str] | None:
    """(path, family) of the first of LABEL_FAMILIES ``labels`` has, or None; InvalidArgument naming the label for a
    family with a level missing between two it has."""
    for family, keys in LABEL_FAMILIES:
        present = [key for key in keys if labels.get(key, "").strip()]
        if not present:
            continue
        last = keys.index(present[-1])
        missing = [key for key in keys[:last] if not labels.get(key, "").strip()]
        if missing:
            raise InvalidArgument(f"{origin}: the node has {present[-1]} but not {missing[0]}: expected every level "
                                  f"of the {family} labels from the root ({keys[0]}) down")
        return check_path([labels[key] for key in keys[:last + 1]], f"{origin} ({family} labels)"), family
    return None


def choose(given: Sequence[str] | str | None, env: Mapping[str, str], labels_text: str | None = None) -> Position:
    """The position from the first source that gives one (see the module's docstring); ``labels_text``: the content
    of the file ``IFRT_NODE_LABELS_FILE`` names, read by the caller. ``Position((), "")`` where none does."""
    if given is not None:
        path = parse_nodes(given, "network=") if isinstance(given, str) else check_path(given, "network=")
        if path:
            return Position(path, "network=")
    for var in (NETWORK_NODES_ENV, XLA_NETWORK_NODES_ENV):
        path = parse_nodes(env.get(var, ""), var)
        if path:
            return Position(path, var)
    address, pattern = env.get(SLURM_ADDR_ENV, "").strip(), env.get(SLURM_PATTERN_ENV, "").strip()
    if address and pattern:
        path = parse_slurm(address, pattern)
        if path:
            return Position(path, f"{SLURM_ADDR_ENV} with {SLURM_PATTERN_ENV}")
    if labels_text is not None:
        origin = f"{NODE_LABELS_FILE_ENV}={env.get(NODE_LABELS_FILE_ENV, '').strip()!r}"
        found = from_labels(parse_labels(labels_text, origin), origin)
        if found:
            return Position(found[0], f"{origin} ({found[1]} labels)")
    return Position((), "")
