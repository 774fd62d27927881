"""The client package stands alone: importing the SDK and the CLI never pulls in torch or Redis.

Checked in a fresh interpreter, because this test process itself has torch loaded by others.
"""

from __future__ import annotations

import re
import subprocess
import sys

CHECK = """
import importlib.abc, pkgutil, sys

class Absent(importlib.abc.MetaPathFinder):
    # As in an environment where only the client is installed.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "redis", "ssdrbm_server", "ssdcore"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Absent())
import ssdrbm, ssdrbm.aio, ssdrbm.cli
# every module of the package, the lazily used ones (plot, servers) included
for info in pkgutil.walk_packages(ssdrbm.__path__, "ssdrbm."):
    if not info.name.endswith("__main__"):
        __import__(info.name)
from ssdrbm.cli import main
assert main(["--target", "127.0.0.1:1", "--wait", "0", "jobs"]) == 3  # a real command path
assert main(["serve"]) == 1  # says how to install the server
HEAVY = ("torch", "redis", "ssdrbm_server", "ssdcore", "matplotlib")
heavy = sorted(m for m in HEAVY if m in sys.modules)
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
    # googleapis-common-protos: generated protobuf code only (google.rpc error details)
    assert names == {"grpcio", "protobuf", "googleapis-common-protos", "numpy"}
    assert project["scripts"]["ssdrbm"] == "ssdrbm.cli:main"
