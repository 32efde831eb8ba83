"""proto/ifrt/xla/v1/ against what each installed jaxlib embeds: the coordination service JAX's client calls, and the
topology records JAX writes, at the same field numbers and types (only these travel on the wire).

The stand-in (ifrt/jax/xla_standin/) decodes JAX's requests with our messages: a field jaxlib renumbered, retyped or
added to a request would be misread or lost without any error, and a method the stand-in lacks fails the job. These
tests read the jaxlib of this interpreter and the one of $IFRT_TEST_JAX04_PYTHON (jaxlib 0.4.30, made by
scripts/test.sh), and fail naming the drift and what to update.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

import pytest
from google.protobuf.descriptor_pb2 import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorProto,
)

from ifrt._generated import xla_coordination_pb2, xla_topology_pb2
from ifrt.jax.xla_standin.layouts import LAYOUTS, XLA, Layout
from tests.jaxlib_descriptors import Embedded, Jaxlib, locate_jaxlib, read_jaxlib
from tests.requirements import jax04_python, require

TOPOLOGY_NAMES = {"DeviceProto": "Device", "LocalTopologyProto": "LocalTopology",
                  "GlobalTopologyProto": "GlobalTopology"}
"""jaxlib's topology message names (xla/pjrt/distributed/protocol.proto) -> ours (xla_topology.proto)."""


@dataclass(frozen=True)
class Naming:
    """How a type name of jaxlib's file reads in ours: our package instead of jaxlib's, some messages renamed."""

    theirs: str
    ours: str
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, type_name: str) -> str:
        prefix = f".{self.theirs}."
        if not type_name.startswith(prefix):
            return type_name  # another file's type (google.protobuf.Any): the same name in both
        top, dot, rest = type_name[len(prefix):].partition(".")
        return f".{self.ours}.{self.renamed.get(top, top)}{dot}{rest}"


def ours_of(module: ModuleType) -> FileDescriptorProto:
    """The descriptor of one of our generated modules, as protoc serialized it (as jaxlib's are)."""
    return FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)


def types_of(file: FileDescriptorProto) -> dict[str, DescriptorProto | EnumDescriptorProto]:
    """Every message and enum ``file`` declares, nested ones too, by full name (".package.Outer.Inner")."""
    found: dict[str, DescriptorProto | EnumDescriptorProto] = {}

    def add(scope: str, messages: Iterable[DescriptorProto], enums: Iterable[EnumDescriptorProto]) -> None:
        found.update({f"{scope}.{e.name}": e for e in enums})
        for message in messages:
            found[f"{scope}.{message.name}"] = message
            add(f"{scope}.{message.name}", message.nested_type, message.enum_type)

    add(f".{file.package}", file.message_type, file.enum_type)
    return found


def kind(f: FieldDescriptorProto, naming: Naming | None = None) -> str:
    """A field as the wire sees it: repeated or not, and its scalar type or its message or enum (by ``naming``)."""
    label = "repeated " if f.label == FieldDescriptorProto.LABEL_REPEATED else ""
    if f.type in (FieldDescriptorProto.TYPE_MESSAGE, FieldDescriptorProto.TYPE_ENUM):
        return label + (naming(f.type_name) if naming else f.type_name)
    return label + FieldDescriptorProto.Type.Name(f.type).removeprefix("TYPE_").lower()


def type_drift(name: str, ours: DescriptorProto | EnumDescriptorProto, theirs: DescriptorProto | EnumDescriptorProto,
               naming: Naming, ours_a_subset: bool) -> list[str]:
    """How our message or enum differs from jaxlib's ``name``: each of jaxlib's fields (each of ours where
    ``ours_a_subset``) must be in the other at its number, with the same type and label; enum values alike."""
    if isinstance(theirs, EnumDescriptorProto) or isinstance(ours, EnumDescriptorProto):
        if type(ours) is not type(theirs):
            return [f"{name}: ours is a {type(ours).__name__}, jaxlib's a {type(theirs).__name__}"]
        values = {v.name: v.number for v in ours.value}
        return [f"enum {name}: value {v.name} is {values.get(v.name, 'missing')} in ours, {v.number} in jaxlib's"
                for v in theirs.value if values.get(v.name) != v.number]
    mine, jaxlibs = {f.number: f for f in ours.field}, {f.number: f for f in theirs.field}
    drift = []
    for number in sorted(mine if ours_a_subset else jaxlibs):
        our_field, their_field = mine.get(number), jaxlibs.get(number)
        if our_field is None:
            drift.append(f"message {name}: jaxlib's field {number} ({kind(their_field)} {their_field.name}) is "
                         f"missing from ours (ours would be {kind(their_field, naming)})")
        elif their_field is None:
            drift.append(f"message {name}: our field {number} ({kind(our_field)} {our_field.name}) is not in "
                         "jaxlib's")
        elif kind(our_field) != kind(their_field, naming):
            drift.append(f"message {name} field {number}: ours is {kind(our_field)} {our_field.name}, jaxlib's "
                         f"{kind(their_field)} {their_field.name} (ours should be {kind(their_field, naming)})")
    return drift


def service_drift(ours: FileDescriptorProto, theirs: FileDescriptorProto, naming: Naming) -> list[str]:
    """How our service differs from jaxlib's: each of jaxlib's methods must be ours, with the same request and
    response, and every message or enum they use, transitively, must have each of jaxlib's fields and values.
    Ours may have more (the tensorflow file serves jaxlib 0.4.30's subset and 0.4.38's whole)."""
    (service,) = theirs.service
    our_service = next((s for s in ours.service if s.name == service.name), None)
    if our_service is None:
        return [f"service {service.name} is missing from ours"]
    our_methods = {m.name: m for m in our_service.method}
    drift, used = [], []
    for method in service.method:
        used += [method.input_type, method.output_type]
        mine = our_methods.get(method.name)
        if mine is None:
            drift.append(f"method {method.name}({method.input_type}) returns ({method.output_type}) is missing "
                         "from ours")
            continue
        for what, our_type, their_type in (("request", mine.input_type, method.input_type),
                                           ("response", mine.output_type, method.output_type)):
            if our_type != naming(their_type):
                drift.append(f"method {method.name}: our {what} is {our_type}, jaxlib's {their_type} (ours should "
                             f"be {naming(their_type)})")
        if (mine.client_streaming, mine.server_streaming) != (method.client_streaming, method.server_streaming):
            drift.append(f"method {method.name}: streaming differs (ours client/server "
                         f"{mine.client_streaming}/{mine.server_streaming}, jaxlib's "
                         f"{method.client_streaming}/{method.server_streaming})")
    our_types, their_types = types_of(ours), types_of(theirs)
    seen: set[str] = set()
    while used:
        name = used.pop()
        if name in seen or name not in their_types:
            continue  # checked already, or another file's type (named alike, compared with the field using it)
        seen.add(name)
        mine = our_types.get(naming(name))
        if mine is None:
            drift.append(f"{name} is missing from ours (as {naming(name)})")
            continue
        drift += type_drift(name, mine, their_types[name], naming, ours_a_subset=False)
        used += [f.type_name for f in getattr(their_types[name], "field", ()) if f.type_name]
    return drift


def subset_drift(ours: FileDescriptorProto, theirs: FileDescriptorProto, naming: Naming) -> list[str]:
    """How our messages differ from jaxlib's, checking only what ours declares (we keep the fields we read):
    each of our messages must be jaxlib's, each of our fields jaxlib's at the same number, type and label."""
    their_types = {naming(name): (name, t) for name, t in types_of(theirs).items()}
    drift = []
    for our_name, mine in types_of(ours).items():
        if our_name not in their_types:
            drift.append(f"our {our_name} is not in jaxlib's file")
            continue
        name, jaxlibs = their_types[our_name]
        drift += type_drift(name, mine, jaxlibs, naming, ours_a_subset=True)
    return drift


def layout_for(file: FileDescriptorProto) -> Layout:
    """The stand-in's layout for the service jaxlib's ``file`` declares (by its wire name, "package.Service")."""
    wire = f"{file.package}.{file.service[0].name}"
    found = [layout for layout in LAYOUTS if layout.service == wire]
    assert found, (f"JAX's client calls /{wire}/* ({file.name}) and no layout in ifrt/jax/xla_standin/layouts.py "
                   f"serves it (they serve {[layout.service for layout in LAYOUTS]})")
    return found[0]


def coordination_naming(file: FileDescriptorProto, layout: Layout) -> Naming:
    """jaxlib's coordination names in ours: the same messages, in the layout's package."""
    return Naming(file.package, layout.messages.DESCRIPTOR.package)


def report(jaxlib: Jaxlib, embedded: Embedded, ours: FileDescriptorProto, drift: list[str], then: str) -> str:
    """The failure message for ``drift``: which jaxlib and file, what differs, and what to update."""
    return (f"jaxlib {jaxlib.version}'s {embedded.file.name} (embedded in {embedded.library}) differs from "
            f"proto/{ours.name}:\n" + "".join(f"  - {d}\n" for d in drift)
            + f"Update proto/{ours.name} to jaxlib's numbers and types, run scripts/gen-proto.sh, and {then}.")


@pytest.fixture(scope="module", params=["venv", "jax04"])
def jaxlib(request: pytest.FixtureRequest) -> Jaxlib:
    """An installed jaxlib: this interpreter's, or the one of $IFRT_TEST_JAX04_PYTHON."""
    if request.param == "venv":
        if importlib.util.find_spec("jaxlib") is None:
            require("jaxlib", "pip install 'ifrt-topology[jax]' (scripts/test.sh installs it)")
        python = sys.executable
    else:
        python = jax04_python()
    return read_jaxlib(*locate_jaxlib(python))


def test_our_coordination_service_matches_the_one_jax_calls(jaxlib: Jaxlib):
    embedded = jaxlib.coordination()
    layout = layout_for(embedded.file)
    ours = ours_of(layout.messages)
    drift = service_drift(ours, embedded.file, coordination_naming(embedded.file, layout))
    assert not drift, report(jaxlib, embedded, ours, drift, "update ifrt/jax/xla_standin/layouts.py (its method "
                             f"table {layout.name.upper()} and the versions it supports)")


def test_our_topology_records_match_jaxs(jaxlib: Jaxlib):
    embedded = jaxlib.protocol()
    ours = ours_of(xla_topology_pb2)
    drift = subset_drift(ours, embedded.file, Naming(embedded.file.package, ours.package, TOPOLOGY_NAMES))
    assert not drift, report(jaxlib, embedded, ours, drift, "update ifrt/jax/xla_standin/topology_check.py")


def test_the_stand_in_serves_every_method_jax_calls_with_our_request(jaxlib: Jaxlib):
    embedded = jaxlib.coordination()
    layout = layout_for(embedded.file)
    methods = {m.name: m for m in embedded.file.service[0].method}
    where = f"jaxlib {jaxlib.version}'s {embedded.file.name} vs ifrt/jax/xla_standin/layouts.py's {layout.name.upper()}"
    missing = sorted(set(methods) - set(layout.methods))
    # a method JAX calls that the stand-in does not serve fails the job (UNIMPLEMENTED)
    assert not missing, f"{where}: the stand-in does not serve {missing}"
    if layout is XLA:  # the one layout for jaxlib 0.10: no method it serves that JAX does not have
        assert set(layout.methods) == set(methods), f"{where}: serves {sorted(set(layout.methods) - set(methods))}, " \
                                                    "which jaxlib's service lacks"
    naming = coordination_naming(embedded.file, layout)
    wrong = {name: layout.methods[name][0].DESCRIPTOR.full_name for name, m in methods.items()
             if f".{layout.methods[name][0].DESCRIPTOR.full_name}" != naming(m.input_type)}
    assert not wrong, f"{where}: these methods decode their request as another message than jaxlib's: {wrong}"


# The comparison itself can fail: jaxlib's file as a copy of ours, in jaxlib's spelling, then altered.

def spelled_as_jaxlib(ours: FileDescriptorProto, package: str,
                      renamed: Mapping[str, str] | None = None) -> FileDescriptorProto:
    """A copy of ``ours`` as jaxlib would spell it: its ``package``, and ``renamed`` messages (ours -> jaxlib's)."""
    renamed = renamed or {}
    theirs = FileDescriptorProto()
    theirs.CopyFrom(ours)
    theirs.package = package
    back = Naming(ours.package, package, renamed)

    def respell(messages: Iterable[DescriptorProto]) -> None:
        for message in messages:
            message.name = renamed.get(message.name, message.name)
            for f in message.field:
                f.type_name = back(f.type_name) if f.type_name else ""
            respell(message.nested_type)

    respell(theirs.message_type)
    for method in (m for s in theirs.service for m in s.method):
        method.input_type, method.output_type = back(method.input_type), back(method.output_type)
    return theirs


def test_service_drift_names_a_renumbered_retyped_or_missing_field_method_or_value():
    ours = ours_of(xla_coordination_pb2)
    naming = Naming("xla.coordination", ours.package)
    theirs = spelled_as_jaxlib(ours, "xla.coordination")
    assert service_drift(ours, theirs, naming) == []

    messages = types_of(theirs)
    messages[".xla.coordination.Incarnations"].field[2].number = 4  # service_incarnation: 3 -> 4
    messages[".xla.coordination.BarrierRequest"].field[3].label = FieldDescriptorProto.LABEL_OPTIONAL  # task_ids
    messages[".xla.coordination.TaskInfo"].field.add(name="new_field", number=9, type=FieldDescriptorProto.TYPE_BOOL)
    messages[".xla.coordination.TaskState"].value[4].number = 5  # ERROR: 4 -> 5
    theirs.service[0].method.add(name="NewMethod", input_type=".xla.coordination.PollForErrorRequest",
                                 output_type=".xla.coordination.PollForErrorResponse")
    theirs.service[0].method[0].output_type = ".xla.coordination.HeartbeatResponse"
    assert sorted(service_drift(ours, theirs, naming)) == sorted([
        "message .xla.coordination.Incarnations: jaxlib's field 4 (fixed64 service_incarnation) is missing from "
        "ours (ours would be fixed64)",
        "message .xla.coordination.BarrierRequest field 4: ours is repeated int32 task_ids, jaxlib's int32 task_ids "
        "(ours should be int32)",
        "message .xla.coordination.TaskInfo: jaxlib's field 9 (bool new_field) is missing from ours (ours would be "
        "bool)",
        "enum .xla.coordination.TaskState: value ERROR is 4 in ours, 5 in jaxlib's",
        "method NewMethod(.xla.coordination.PollForErrorRequest) returns (.xla.coordination.PollForErrorResponse) "
        "is missing from ours",
        "method RegisterTask: our response is .ifrt.xla.coordination.RegisterTaskResponse, jaxlib's "
        ".xla.coordination.HeartbeatResponse (ours should be .ifrt.xla.coordination.HeartbeatResponse)",
    ])


def test_subset_drift_names_a_field_of_ours_jaxlib_renumbered_or_retyped_and_ignores_jaxlibs_extra_fields():
    ours = ours_of(xla_topology_pb2)
    naming = Naming("xla", ours.package, TOPOLOGY_NAMES)
    theirs = spelled_as_jaxlib(ours, "xla", {ours_name: name for name, ours_name in TOPOLOGY_NAMES.items()})
    messages = types_of(theirs)
    messages[".xla.DeviceProto"].field.add(name="fabric_uuid", number=12, type=FieldDescriptorProto.TYPE_STRING)
    assert subset_drift(ours, theirs, naming) == []

    messages[".xla.DeviceProto"].field[3].number = 6  # global_device_id: 4 -> 6
    messages[".xla.LocalTopologyProto"].field[0].type = FieldDescriptorProto.TYPE_INT64  # process_id
    messages[".xla.GlobalTopologyProto"].field[0].type_name = ".xla.DeviceProto"  # processes
    assert subset_drift(ours, theirs, naming) == [
        "message .xla.DeviceProto: our field 4 (int32 global_device_id) is not in jaxlib's",
        "message .xla.LocalTopologyProto field 1: ours is int32 process_id, jaxlib's int64 process_id (ours should "
        "be int64)",
        "message .xla.GlobalTopologyProto field 1: ours is repeated .ifrt.xla.topology.LocalTopology processes, "
        "jaxlib's repeated .xla.DeviceProto processes (ours should be repeated .ifrt.xla.topology.Device)",
    ]


def test_report_says_which_jaxlib_and_file_differ_and_what_to_update(tmp_path):
    ours = ours_of(xla_coordination_pb2)
    embedded = Embedded(tmp_path / "libjax_common.so", spelled_as_jaxlib(ours, "xla.coordination"))
    embedded.file.name = "xla/pjrt/distributed/coordination/coordination_service.proto"
    text = report(Jaxlib("0.10.9", tmp_path, {}), embedded, ours, ["method X is missing from ours"],
                  "update ifrt/jax/xla_standin/layouts.py")
    assert text == (f"jaxlib 0.10.9's xla/pjrt/distributed/coordination/coordination_service.proto (embedded in "
                    f"{tmp_path}/libjax_common.so) differs from proto/ifrt/xla/v1/xla_coordination.proto:\n"
                    "  - method X is missing from ours\n"
                    "Update proto/ifrt/xla/v1/xla_coordination.proto to jaxlib's numbers and types, run "
                    "scripts/gen-proto.sh, and update ifrt/jax/xla_standin/layouts.py.")
