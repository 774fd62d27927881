"""The committed gRPC stubs match the protos: regenerate into a temp dir and compare bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUB_DIR = Path("ssdrbm") / "v1"
GENERATED = ("rbm_pb2.py", "rbm_pb2.pyi", "rbm_pb2_grpc.py")


def test_committed_stubs_are_not_stale(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)],
        check=True,
        timeout=120,
    )
    stale = [
        name
        for name in GENERATED
        if (tmp_path / STUB_DIR / name).read_bytes()
        != (ROOT / "client" / STUB_DIR / name).read_bytes()
    ]
    assert not stale, f"stale stubs {stale}: run `python scripts/gen_protos.py` and commit them"


def test_every_proto_has_generated_stubs() -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    assert protos
    for proto in protos:
        stem = proto.stem
        assert (ROOT / "client" / STUB_DIR / f"{stem}_pb2.py").is_file(), proto
