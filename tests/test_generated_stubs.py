import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ROOT / "ifrt" / "_generated"


def test_committed_stubs_match_the_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True,
                   env=dict(os.environ, PYTHON=sys.executable), capture_output=True)
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(p.name for p in GENERATED.iterdir() if p.name != "__init__.py" and p.is_file()
                           and not p.name.endswith(".pyc"))
    stale = [name for name in fresh if (tmp_path / name).read_bytes() != (GENERATED / name).read_bytes()]
    assert not stale, f"stubs out of date with proto/: {stale}; run scripts/gen-proto.sh"


def test_proto_file_has_a_unique_name_in_the_descriptor_pool():
    from ifrt._generated import coordinator_pb2

    assert coordinator_pb2.DESCRIPTOR.name == "ifrt/topology/v1/coordinator.proto"
