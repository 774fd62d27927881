"""The three distributions, built as pip builds them.

- ``ssdcore`` (the repository root) is the core library: torch, no service, no client.
- ``ssdrbm-client`` (``client/``) is the ``ssdrbm`` SDK and CLI without torch; it installs into a
  clean environment beside kserve and tritonclient.
- ``ssdrbm-server`` (``server/``) is the service; it requires the other two, and the three given
  together (``pip install . ./client ./server``) resolve from the package index.
- Each installed file belongs to exactly one of them; all three have the one version (VERSION)
  and the one license.
- The committed stubs import under the protobuf and grpcio floors and under protobuf 7.

The wheels are built from a copy of the sources (nothing is written into the checkout). The
checks that need the package index are skipped, with the reason, where it cannot be reached.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import ssdrbm
from packaging.requirements import Requirement

from tests.fixtures.redis import free_port

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip"]
INDEX_TIMEOUT_S = 150  # a resolution against the index; a slower index is skipped, not failed
IGNORED = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "*.pyc", ".pytest_cache")

pytestmark = pytest.mark.slow


def _pip(*args: str, timeout: float = INDEX_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    command = [*PIP, "--disable-pip-version-check", "--no-input", *args]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip {args[0]} took over {timeout:.0f} s: the package index is too slow")


DISTRIBUTIONS = {"core": ".", "client": "client", "server": "server"}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each distribution's wheel ("core", "client", "server"), built from a copy of the checkout."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md", "LICENSE", "VERSION"):
        shutil.copy2(ROOT / name, source / name)
    for folder in ("ssdcore", "client", "server"):
        shutil.copytree(ROOT / folder, source / folder, symlinks=True, ignore=IGNORED)
    out = tmp_path_factory.mktemp("wheels")
    # No build isolation: the build backend (setuptools) is the one installed here, so building
    # needs no index.
    folders = [str(source / folder) for folder in DISTRIBUTIONS.values()]
    built = _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), *folders,
                 timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stderr
    return {
        "core": next(out.glob("ssdcore-*.whl")),
        "client": next(out.glob("ssdrbm_client-*.whl")),
        "server": next(out.glob("ssdrbm_server-*.whl")),
    }


@pytest.fixture(scope="module")
def index() -> None:
    """Skips the test when the package index cannot be reached."""
    probe = _pip("index", "versions", "protobuf", timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"the package index is not reachable: {probe.stderr.strip()[-300:]}")


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def _files(wheel: Path, prefix: str) -> dict[str, str]:
    """{path: sha256} of the wheel's files under ``prefix``."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in archive.namelist()
            if name.startswith(prefix)
        }


def _requirements(wheel: Path) -> list[Requirement]:
    return [Requirement(line) for line in _metadata(wheel).get_all("Requires-Dist") or []]


def _packages(wheel: Path) -> set[str]:
    """The top-level folders a wheel installs, its metadata aside."""
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    return {top for top in tops if not top.endswith(".dist-info")}


def test_each_installed_file_belongs_to_one_distribution(wheels) -> None:
    assert _packages(wheels["core"]) == {"ssdcore"}
    assert _packages(wheels["client"]) == {"ssdrbm"}
    assert _packages(wheels["server"]) == {"ssdrbm_server"}
    shipped = _files(wheels["client"], "ssdrbm/")
    for stub in ("rbm_pb2.py", "rbm_pb2_grpc.py", "rbm_pb2.pyi"):
        assert f"ssdrbm/v1/{stub}" in shipped, stub
    for needed in ("ssdrbm/__init__.py", "ssdrbm/cli/main.py", "ssdrbm/py.typed"):
        assert needed in shipped, needed
    assert _files(wheels["server"], "ssdrbm_server/dashboard/static/")  # the dashboard's pages
    # Only the client names the `ssdrbm` command.
    for name, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as archive:
            entry_points = [n for n in archive.namelist() if n.endswith("entry_points.txt")]
            text = "".join(archive.read(n).decode() for n in entry_points)
        assert ("ssdrbm = ssdrbm.cli:main" in text) == (name == "client"), name


def test_one_version_one_license_and_the_server_requires_the_other_two(wheels) -> None:
    metadata = {name: _metadata(wheel) for name, wheel in wheels.items()}
    assert {m["Version"] for m in metadata.values()} == {ssdrbm.__version__}
    assert ssdrbm.__version__ == (ROOT / "VERSION").read_text().strip()
    assert {m["License-Expression"] for m in metadata.values()} == {"MIT"}
    license_text = (ROOT / "LICENSE").read_bytes()
    assert b"MIT License" in license_text and b"the ssdrbm authors" in license_text
    for wheel in wheels.values():
        licenses = {k: v for k, v in _files(wheel, "").items() if k.endswith("/licenses/LICENSE")}
        assert list(licenses.values()) == [hashlib.sha256(license_text).hexdigest()], wheel.name
    server = {req.name for req in _requirements(wheels["server"])}
    assert {"ssdcore", "ssdrbm-client", "redis", "grpcio"} <= server
    # The client and the core need nothing of the others; only the core needs torch.
    for name in ("core", "client"):
        assert not any(r.name.startswith("ssd") for r in _requirements(wheels[name])), name
    assert "torch" in {req.name for req in _requirements(wheels["core"])}
    assert "torch" not in {req.name for req in _requirements(wheels["client"])}
    # What the server names beside the client (grpcio, protobuf, ...) it names in the same words.
    server_requirements = {req.name: str(req) for req in _requirements(wheels["server"])}
    for requirement in _requirements(wheels["client"]):
        if requirement.name in server_requirements:
            assert str(requirement) == server_requirements[requirement.name], requirement


def _resolve(*targets: str) -> dict[str, str]:
    """What ``pip install`` would install into an empty environment: {name: version}."""
    result = _pip("install", "--dry-run", "--ignore-installed", "--only-binary", ":all:",
                  "--quiet", "--report", "-", *targets)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in report["install"]}  # fmt: skip


def test_the_three_wheels_resolve_together(wheels, index) -> None:
    """`pip install . ./client ./server` needs nothing beyond the index: torch, grpc, Redis."""
    resolved = _resolve(*(str(wheel) for wheel in wheels.values()))
    expected = {"ssdcore", "ssdrbm-client", "ssdrbm-server", "torch", "grpcio", "redis"}
    assert expected <= set(resolved)


def test_the_client_resolves_beside_kserve_and_tritonclient(wheels, index) -> None:
    resolved = _resolve(str(wheels["client"]), "kserve", "tritonclient[grpc]")
    assert {"ssdrbm-client", "kserve", "tritonclient"} <= set(resolved)
    assert "torch" not in resolved


@pytest.fixture(scope="module")
def protobuf_7_client(wheels, index, tmp_path_factory) -> Iterator[Path]:
    """A clean virtual environment with only the client wheel, protobuf 7 and grpcio's floor."""
    venv = tmp_path_factory.mktemp("client-venv")
    # --without-pip: the environment stays empty; this pip installs into it (--python).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = _pip("--python", str(python), "install", "-q", "--only-binary", ":all:",
                     str(wheels["client"]), "protobuf>=7,<8", "grpcio==1.74.0")  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    yield venv


def test_a_clean_client_install_runs_under_protobuf_7_against_the_service(
    protobuf_7_client: Path, service
) -> None:
    python, command = protobuf_7_client / "bin" / "python", protobuf_7_client / "bin" / "ssdrbm"
    versions = subprocess.run(
        [str(python), "-c", "import google.protobuf, grpc, importlib.util as u; "
         "print(google.protobuf.__version__, grpc.__version__, u.find_spec('torch'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert versions[0].startswith("7.") and versions[1] == "1.74.0" and versions[2] == "None"
    result = subprocess.run(
        [str(command), "--version", "--target", service.target],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    client_line, server_line = result.stdout.splitlines()
    assert client_line == f"ssdrbm {ssdrbm.__version__} (client)"
    assert server_line.startswith(f"server {ssdrbm.__version__} at {service.target} (api ssdrbm.v1")
    # No service: the client's version alone, and a note saying why.
    closed = f"127.0.0.1:{free_port()}"
    result = subprocess.run([str(command), "--version", "--target", closed],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0 and result.stdout.splitlines() == [client_line]
    assert f"cannot reach the ssdrbm service at {closed}" in result.stderr


def test_the_stubs_import_under_the_protobuf_and_grpcio_floors(tmp_path: Path, index) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = _pip("--python", str(python), "install", "-q", "--only-binary", ":all:",
                     "protobuf==6.31.1", "grpcio==1.74.0")  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-3000:]
    # The stubs alone, under an empty `ssdrbm` package (the SDK needs numpy besides).
    package = tmp_path / "stubs" / "ssdrbm"
    shutil.copytree(ROOT / "client" / "ssdrbm" / "v1", package / "v1", ignore=IGNORED)
    (package / "__init__.py").write_text("")
    check = (
        "from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc\n"
        "info = rbm_pb2.ServerInfo(version='1', features=['x'])\n"
        "assert rbm_pb2.ServerInfo.FromString(info.SerializeToString()) == info\n"
        "service = rbm_pb2.DESCRIPTOR.services_by_name['RBMService']\n"
        "assert 'GetServerInfo' in service.methods_by_name\n"
        "import google.protobuf; print(google.protobuf.__version__)\n"
    )
    result = subprocess.run([str(python), "-c", check], cwd=package.parent,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "6.31.1"
