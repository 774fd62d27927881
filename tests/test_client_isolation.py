"""The client package stands alone: importing the SDK and the CLI never pulls in torch or Redis.

Checked in a fresh interpreter, because this test process itself has torch loaded by others.
"""

from __future__ import annotations

import re
import subprocess
import sys

CHECK = """
import pkgutil, sys
import ssdrbm, ssdrbm.aio, ssdrbm.cli
from ssdrbm.cli.main import build_parser
# every module of the package, the lazily used ones (plot, servers) included
for info in pkgutil.walk_packages(ssdrbm.__path__, "ssdrbm."):
    if not info.name.endswith("__main__"):
        __import__(info.name)
build_parser().parse_args(["jobs"])
heavy = sorted(m for m in ("torch", "redis", "server", "ssdcore", "matplotlib") if m in sys.modules)
assert not heavy, heavy
print("ok")
"""


def test_client_imports_without_torch_redis_or_server() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_client_declares_only_light_dependencies() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads(
        (Path(__file__).parent.parent / "client" / "pyproject.toml").read_text()
    )["project"]
    names = {re.split(r"[<>=\[ ]", dep)[0] for dep in project["dependencies"]}
    assert names == {"grpcio", "protobuf", "numpy"}
    assert project["scripts"]["ssdrbm"] == "ssdrbm.cli:main"
