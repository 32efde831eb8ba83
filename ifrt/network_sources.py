"""Where a process's network position comes from: small pure parsers for each source, and the order they are tried.

Sources, the first that gives a position wins:

1. ``network=`` (``discover``/``Client``), else ``IFRT_NETWORK_NODES`` (comma-separated, root first);
2. XLA's ``XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES``, split as XLA splits it, so a job that already sets it needs
   nothing more;
3. Slurm's ``SLURM_TOPOLOGY_ADDR`` with ``SLURM_TOPOLOGY_ADDR_PATTERN`` (the switch levels; the node dropped);
4. the node's labels in the file ``IFRT_NODE_LABELS_FILE`` (``key=value`` a line), for the first label family of
   ``LABEL_FAMILIES`` the node has.

Later sources are read too: one that gives another path is a conflict, kept in ``Position.conflicts`` and warned
about once per process (``warn``). The labels also give the host's NVLink partition (``accelerator_domain``).
Everything here takes plain values (the environment as a mapping, the labels file's text); reading the file is the
caller's (``ifrt.settings``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ifrt.errors import InvalidArgument
from ifrt.network import MAX_LEVELS, check_path, hidden_character

log = logging.getLogger("ifrt.network")

NETWORK_NODES_ENV = "IFRT_NETWORK_NODES"
XLA_NETWORK_NODES_ENV = "XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES"
SLURM_ADDR_ENV = "SLURM_TOPOLOGY_ADDR"
SLURM_PATTERN_ENV = "SLURM_TOPOLOGY_ADDR_PATTERN"
NODE_LABELS_FILE_ENV = "IFRT_NODE_LABELS_FILE"

NVIDIA = "network.topology.nvidia.com/"
TIER_LABEL = re.compile(r"fabric\.topograph\.run/tier-(\d+)")
"""topograph 1.0's fabric tiers: tier 0 is the switch closest to the node, only the tiers present are written."""


@dataclass(frozen=True)
class Family:
    """A label family: its levels root first, each the keys that may name it (the first present is read), and the
    end of the path a node always has (``"root"``: levels may be missing under the last one present; ``"leaf"``:
    levels may be missing above the first one present). A level missing between two present ones is an error."""

    name: str
    levels: tuple[tuple[str, ...], ...]
    anchor: str


LABEL_FAMILIES: tuple[Family, ...] = (
    Family("nvidia-topograph", ((f"{NVIDIA}core", f"{NVIDIA}datacenter"), (f"{NVIDIA}spine",),
                                (f"{NVIDIA}leaf", f"{NVIDIA}block")), "leaf"),
    Family("aws", tuple((f"topology.k8s.aws/network-node-layer-{n}",) for n in range(1, 5)), "root"),
    Family("gce", (("cloud.google.com/gce-topology-block",), ("cloud.google.com/gce-topology-subblock",)), "root"),
    Family("oci", (("oci.oraclecloud.com/host.network_block_id",), ("oci.oraclecloud.com/host.rack_id",)), "root"),
)
"""Node label families with fixed levels, tried in this order after topograph 1.0's ``fabric.topograph.run/tier-N``
(``topograph_tiers``), each root to leaf. topograph comes first: where it runs it was installed on purpose and
describes the switches themselves, on any cloud. Its leaf/spine/core (before 1.0) and block/spine/datacenter (before
that) are one family: a two-tier fabric has no core, a missing level at the top is normal. AWS writes layer-1 (the
top) down to layer-3, or layer-4 on instance types with four layers. A family counts when the node has any of its
labels. GCE's ``-host`` is left out: it is the host itself."""

ACCELERATOR_LABELS = ("nvidia.com/gpu.clique", "accelerator.topograph.run/domain", f"{NVIDIA}accelerator")
"""Where a node's NVLink partition is named, the first present wins: the GPU operator's clique
(``<ClusterUUID>.<CliqueID>``, set once the fabric is up), topograph 1.0's accelerator domain, topograph's older
one (on AWS the capacity block: the whole NVL domain)."""


@dataclass(frozen=True)
class Position:
    """A network path (root to leaf, the host not included) and where it came from (``IFRT_NETWORK_NODES``, ...);
    ``conflicts``: each later source that gives another path (``s2/s1 from IFRT_NODE_LABELS_FILE=... (aws labels)``) or
    cannot be read; ``accelerator``: the NVLink partition
    the node's labels name ("" where none does) and ``accelerator_source`` the label it came from."""

    path: tuple[str, ...]
    source: str
    conflicts: tuple[str, ...] = ()
    accelerator: str = ""
    accelerator_source: str = ""


def parse_nodes(value: str, source: str) -> tuple[str, ...]:
    """``"spine1, block2,rack7"`` -> ``("spine1", "block2", "rack7")``; InvalidArgument naming ``source`` for an empty
    level (``"spine1,,rack7"``), too many levels, too long a name or a control character."""
    if not value.strip():
        return ()
    return check_path(value.split(","), source)


_ASCII_SPACE = " \t\n\v\f\r"


def parse_xla_nodes(value: str) -> tuple[str, ...]:
    """``XLA_DISTRIBUTED_TOPOLOGY_NETWORK_NODES`` as XLA reads it (``absl::StrSplit(env, ',',
    absl::SkipWhitespace())`` in xla/pjrt/distributed/topology_util.cc): pieces that are empty or only ASCII
    whitespace are dropped, so ``"s1,rack3,"`` is ``("s1", "rack3")``; the names kept are checked as every path."""
    return check_path([piece for piece in value.split(",") if piece.strip(_ASCII_SPACE)], XLA_NETWORK_NODES_ENV)


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


def _present(labels: Mapping[str, str], keys: Sequence[str]) -> str | None:
    """The first of ``keys`` with a non-blank value in ``labels``."""
    return next((key for key in keys if labels.get(key, "").strip()), None)


def _levels(family: str, levels: Sequence[Sequence[str]], anchor: str, labels: Mapping[str, str],
            origin: str) -> tuple[str, ...] | None:
    """The path ``labels`` give for one family's ``levels`` (root first), or None where it has none of them;
    InvalidArgument naming the missing label for a level missing between two present ones, or at the anchored end."""
    found = [_present(labels, keys) for keys in levels]
    have = [i for i, key in enumerate(found) if key]
    if not have:
        return None
    first, last = (0, have[-1]) if anchor == "root" else (have[0], len(levels) - 1)
    for i in range(first, last + 1):
        if not found[i]:  # name the present level on the far side of the gap from the anchored end
            present = found[max(j for j in have if j < i)] if anchor == "leaf" else found[min(j for j in have if j > i)]
            span = ("from the leaf (the level nearest the node) up to the highest one present" if anchor == "leaf" else
                    f"from the root ({levels[0][0]}) down to the lowest one present")
            raise InvalidArgument(f"{origin}: the node has {present} but not {levels[i][0]}: expected every level of "
                                  f"the {family} labels {span} (the path would silently skip a switch)")
    keys = [key for key in found[first:last + 1] if key]
    return check_path([labels[key] for key in keys], f"{origin} ({family} labels)")


def topograph_tiers(labels: Mapping[str, str], origin: str) -> tuple[str, ...] | None:
    """The path topograph 1.0's ``fabric.topograph.run/tier-N`` labels give, the highest tier first (tier 0 is the
    leaf), or None where the node has none; InvalidArgument naming a missing tier under a present one."""
    tiers = {int(m.group(1)): key for key in labels if (m := TIER_LABEL.fullmatch(key)) and labels[key].strip()}
    if not tiers:
        return None
    top = max(tiers)
    if top >= MAX_LEVELS:
        raise InvalidArgument(f"{origin}: the node has {tiers[top]}: expected at most {MAX_LEVELS} fabric tiers "
                              f"(tier-0 to tier-{MAX_LEVELS - 1})")
    levels = [(f"fabric.topograph.run/tier-{n}",) for n in range(top, -1, -1)]
    return _levels("topograph", levels, "leaf", labels, origin)


_Reader = Callable[[Mapping[str, str], str], "tuple[str, ...] | None"]


def _family_readers() -> list[tuple[str, _Reader]]:
    """(name, reader) of every label family, in the order they are tried."""
    readers: list[tuple[str, _Reader]] = [("topograph", topograph_tiers)]
    for family in LABEL_FAMILIES:
        readers.append((family.name, lambda labels, origin, f=family: _levels(f.name, f.levels, f.anchor, labels,
                                                                             origin)))
    return readers


def from_labels(labels: Mapping[str, str], origin: str) -> tuple[tuple[str, ...], str] | None:
    """(path, family) of the first label family ``labels`` has, or None; InvalidArgument naming the label for a
    family with a level missing between two it has."""
    for name, read in _family_readers():
        path = read(labels, origin)
        if path:
            return path, name
    return None


def accelerator_domain(labels: Mapping[str, str], origin: str) -> tuple[str, str]:
    """(NVLink partition, the label it came from) from the first of ACCELERATOR_LABELS the node has, else ("", "");
    InvalidArgument naming the label for a control or bidi character."""
    key = _present(labels, ACCELERATOR_LABELS)
    if key is None:
        return "", ""
    value = labels[key].strip()
    hidden = hidden_character(value)
    if hidden:
        raise InvalidArgument(f"{origin}: {key}={value!r} holds {hidden}, a control, format or bidi character: "
                              "expected an NVLink partition name that prints as it is")
    return value, key


def _sources(given: Sequence[str] | str | None, env: Mapping[str, str],
             labels_text: str | None) -> list[tuple[str, Callable[[], tuple[str, ...] | None]]]:
    """(source, reader) of every source, in the order they are tried; a reader gives () or None where its source is
    unset, and raises InvalidArgument where it cannot be read."""
    sources: list[tuple[str, Callable[[], tuple[str, ...] | None]]] = []
    if given is not None:
        sources.append(("network=", lambda: parse_nodes(given, "network=") if isinstance(given, str) else
                        check_path(given, "network=")))
    sources.append((NETWORK_NODES_ENV, lambda: parse_nodes(env.get(NETWORK_NODES_ENV, ""), NETWORK_NODES_ENV)))
    sources.append((XLA_NETWORK_NODES_ENV, lambda: parse_xla_nodes(env.get(XLA_NETWORK_NODES_ENV, ""))))
    address, pattern = env.get(SLURM_ADDR_ENV, "").strip(), env.get(SLURM_PATTERN_ENV, "").strip()
    if address and pattern:
        sources.append((f"{SLURM_ADDR_ENV} with {SLURM_PATTERN_ENV}", lambda: parse_slurm(address, pattern)))
    if labels_text is not None:
        origin = labels_origin(env)
        labels = parse_labels(labels_text, origin)
        for name, read in _family_readers():
            sources.append((f"{origin} ({name} labels)", lambda read=read: read(labels, origin)))
    return sources


def labels_origin(env: Mapping[str, str]) -> str:
    """How errors and sources name the labels file: ``IFRT_NODE_LABELS_FILE='/etc/ifrt/node/labels'``."""
    return f"{NODE_LABELS_FILE_ENV}={env.get(NODE_LABELS_FILE_ENV, '').strip()!r}"


def choose(given: Sequence[str] | str | None, env: Mapping[str, str], labels_text: str | None = None) -> Position:
    """The position from the first source that gives one (see the module's docstring); ``labels_text``: the content
    of the file ``IFRT_NODE_LABELS_FILE`` names, read by the caller. ``Position((), "")`` where none gives one.

    Up to the one chosen, a source that cannot be read is an error; after it, such a source and every one that gives
    another path are kept in ``conflicts`` (so a position set on purpose overrides a broken label, and says so)."""
    chosen: tuple[tuple[str, ...], str] | None = None
    conflicts: list[str] = []
    for source, read in _sources(given, env, labels_text):
        if chosen is None:
            path = read()
            if path:
                chosen = path, source
            continue
        try:
            path = read()
        except InvalidArgument as e:
            conflicts.append(f"{source} is not used: {e}")
            continue
        if path and path != chosen[0]:
            conflicts.append(f"{'/'.join(path)} from {source}")
    accelerator, label = ("", "") if labels_text is None else accelerator_domain(
        parse_labels(labels_text, labels_origin(env)), labels_origin(env))
    where = f"{labels_origin(env)} ({label})" if label else ""
    path, source = chosen or ((), "")
    return Position(path, source, tuple(conflicts), accelerator, where)


_warned: set[tuple] = set()


def warn(position: Position) -> None:
    """Logs, once per process, that sources disagree (naming each and the path it gives) and, at info level, that
    no source gave a position (the host then takes the lowest ids among hosts that have one)."""
    key = (position.path, position.source, position.conflicts)
    if key in _warned:
        return
    _warned.add(key)
    if position.conflicts:
        log.warning("network position sources disagree: %s from %s is used; also set: %s (unset them, or "
                    "make them agree, so every host of the job reads the same source)", "/".join(position.path),
                    position.source, "; ".join(position.conflicts))
    elif not position.path:
        log.info("this host has no network position (none of network=, %s, %s, %s, %s gives one): where other hosts "
                 "of the job have one, it sorts before them and takes the lowest ids", NETWORK_NODES_ENV,
                 XLA_NETWORK_NODES_ENV, SLURM_ADDR_ENV, NODE_LABELS_FILE_ENV)
