"""The committed gRPC stubs match the protos: regenerate into a temp dir and compare bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generated_stubs() -> list[Path]:
    """Every stub gen_protos writes, relative to the output root (beside its proto's path)."""
    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    return [
        proto.relative_to(PROTO_ROOT).with_name(proto.stem + suffix)
        for proto in protos
        for suffix in SUFFIXES
    ]


def test_committed_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        timeout=120,
    )
    stale = [
        str(stub)
        for stub in generated_stubs()
        if (tmp_path / stub).read_bytes() != (ROOT / "client" / stub).read_bytes()
    ]
    assert not stale, f"stale stubs {stale}: run `python scripts/gen_protos.py` and commit them"


def test_every_proto_has_generated_stubs() -> None:
    stubs = generated_stubs()
    assert stubs
    for stub in stubs:
        assert (ROOT / "client" / stub).is_file(), stub
