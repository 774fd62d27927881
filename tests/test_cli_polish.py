"""The ``ssdrbm`` command as a shell runs it: real processes against the real service, or a port
where nothing listens.

- A reader that goes away (``| head``) ends the command quietly: exit 141 (``--help``, printed by
  argparse, 0), nothing on stderr.
- ``ssdrbm plot`` without matplotlib names the [plot] extra and the pip commands that add it.
- A service that is down fails at once without --wait; with --wait the command says what it
  waits for, and goes on when the service comes up.
- ``ssdrbm completion bash|zsh|fish`` prints scripts the shells accept and that complete.
- ``ssdrbm --version``: the client's version and the service's (``GetServerInfo``).
- No message or document tells anyone to install a package that is on no package index.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import grpc
import pytest
import ssdrbm
from ssdrbm import Client
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.v1 import rbm_pb2, rbm_pb2_grpc

from tests.fixtures.console import SSDRBM
from tests.fixtures.redis import free_port

ROOT = Path(__file__).resolve().parent.parent
# Before, an unreachable service was retried silently for 10 s by default; now a command tries
# once. The bound is loose on purpose (the interpreter's start alone takes about a second here).
FAIL_FAST_S = 6.0


def _closed_target() -> str:
    return f"127.0.0.1:{free_port()}"


def _run(*args: str, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SSDRBM, *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


# --- closed pipe --------------------------------------------------------------------------------


def _with_stdout_closed(*args: str) -> tuple[int, str]:
    """Run ``ssdrbm ARGS`` with its stdout's reader gone before it writes; (exit code, stderr)."""
    process = subprocess.Popen(
        [SSDRBM, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()  # as `head` does once it has its line, here before the first one
    _, err = process.communicate(timeout=60)
    return process.returncode, err


def test_a_closed_pipe_ends_the_command_quietly(service) -> None:
    code, err = _with_stdout_closed("jobs", "--json", "--target", service.target)
    assert (code, err) == (ExitCode.BROKEN_PIPE, "")
    # Help is printed by argparse, which ignores a failed write and exits 0: quiet too.
    code, err = _with_stdout_closed("--help")
    assert code in (ExitCode.OK, ExitCode.BROKEN_PIPE) and err == ""
    code, err = _with_stdout_closed("completion", "bash")  # no service needed
    assert (code, err) == (ExitCode.BROKEN_PIPE, "")


def test_a_closed_pipe_in_a_shell_pipeline(service) -> None:
    """`ssdrbm completion bash | head -1`: the first line arrives, and no error is printed."""
    result = subprocess.run(
        ["bash", "-c", f"set -o pipefail; '{SSDRBM}' completion bash | head -1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.startswith("# ssdrbm completion for bash")
    assert result.stderr == ""
    # Whether the script was all written before head left depends on timing: 0 or 141.
    assert result.returncode in (0, ExitCode.BROKEN_PIPE)


# --- missing matplotlib -------------------------------------------------------------------------

# Runs the CLI where `import matplotlib` fails as it does where matplotlib is not installed.
WITHOUT_MATPLOTLIB = """
import sys

class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoMatplotlib())
from ssdrbm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_plot_without_matplotlib_names_the_plot_extra(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, "plot", "some-job", "-o", str(tmp_path),
         "--target", _closed_target()],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == ExitCode.ERROR and result.stdout == ""
    line = result.stderr.strip()
    assert line.count("\n") == 0, result.stderr  # one line, no traceback
    assert line.startswith("ssdrbm: error: 'ssdrbm plot' needs matplotlib")
    assert "[plot] extra" in line
    assert "pip install './client[plot]'" in line
    assert not any(tmp_path.iterdir())  # nothing fetched or written first


# --- unreachable service ------------------------------------------------------------------------


def test_an_unreachable_service_fails_at_once_without_wait() -> None:
    target = _closed_target()
    started = time.monotonic()
    result = _run("jobs", "--target", target, env={**os.environ, "SSDRBM_WAIT": ""})
    elapsed = time.monotonic() - started
    assert result.returncode == ExitCode.UNAVAILABLE and result.stdout == ""
    assert result.stderr.startswith(f"ssdrbm: error: cannot reach the ssdrbm service at {target}")
    assert "--wait" in result.stderr  # says how to wait for a service that is starting
    assert "waiting for" not in result.stderr  # it did not wait
    assert elapsed < FAIL_FAST_S, elapsed


def test_wait_says_what_it_waits_for_and_goes_on_when_the_service_comes_up(
    service_factory,
) -> None:
    port = free_port()
    process = subprocess.Popen(
        [SSDRBM, "--target", f"127.0.0.1:{port}", "--wait", "60", "jobs", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = process.stderr.readline()  # printed before the service exists
        assert first.startswith(f"waiting for 127.0.0.1:{port}… (up to 60 s"), first
        assert process.poll() is None
        service_factory(listen_address=f"127.0.0.1:{port}")
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == ExitCode.OK, err
    assert out.strip() == "[]" and err == ""


def test_wait_gives_up_after_its_time_with_the_usual_error() -> None:
    target = _closed_target()
    started = time.monotonic()
    result = _run("jobs", "--target", target, "--wait", "1")
    elapsed = time.monotonic() - started
    assert result.returncode == ExitCode.UNAVAILABLE
    waiting, error = result.stderr.strip().splitlines()
    assert waiting == f"waiting for {target}… (up to 1 s, --wait)"
    assert error.startswith(f"ssdrbm: error: cannot reach the ssdrbm service at {target}")
    assert 1.0 <= elapsed < 1.0 + FAIL_FAST_S, elapsed


# --- completion ---------------------------------------------------------------------------------


def _bash_complete(script: str, *words: str) -> list[str]:
    """What the bash function suggests for the command line ``ssdrbm WORDS`` (the last one is
    the word being completed)."""
    quoted = " ".join(f"'{word}'" for word in ("ssdrbm", *words))
    program = (
        f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words)}; COMPREPLY=()\n"
        '_ssdrbm; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    result = subprocess.run(["bash", "--norc", "-c", program], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if line]


def test_bash_completion_parses_and_completes() -> None:
    result = _run("completion", "bash")
    assert result.returncode == 0 and result.stderr == ""
    script = result.stdout
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert _bash_complete(script, "tr") == ["train"]
    assert "completion" in _bash_complete(script, "")
    assert set(_bash_complete(script, "train", "--mo")) == {"--model", "--momentum"}
    assert _bash_complete(script, "train", "--model", "") == ["bernoulli", "gaussian"]
    assert _bash_complete(script, "completion", "") == ["bash", "zsh", "fish"]
    assert "--target" in _bash_complete(script, "jobs", "--")  # the shared options too
    assert _bash_complete(script, "--target", "") == []  # a value: left to the shell
    assert _bash_complete(script, "jobs", "--limit", "") == []


def test_zsh_and_fish_completion() -> None:
    zsh, fish = _run("completion", "zsh"), _run("completion", "fish")
    assert zsh.returncode == fish.returncode == 0
    assert "bashcompinit" in zsh.stdout and "complete -o default -F _ssdrbm ssdrbm" in zsh.stdout
    assert "complete -c ssdrbm" in fish.stdout
    assert re.search(r"-a train -d 'submit a training job", fish.stdout)
    assert "-n '__fish_seen_subcommand_from train' -l model -x -a 'bernoulli gaussian'" in (
        fish.stdout
    )
    for shell, result in (("zsh", zsh), ("fish", fish)):
        if shutil.which(shell) is None:
            continue  # syntax checked where the shell is installed
        check = subprocess.run([shell, "-n"], input=result.stdout, text=True, capture_output=True)
        assert check.returncode == 0, (shell, check.stderr)


def test_completion_refuses_an_unknown_shell() -> None:
    result = _run("completion", "tcsh")
    assert result.returncode == ExitCode.USAGE and "invalid choice" in result.stderr


# --- versions -----------------------------------------------------------------------------------


def test_server_info_names_the_one_version(service) -> None:
    with Client(service.target) as client:
        info = client.server_info()
    assert info.version == ssdrbm.__version__
    assert info.api == "ssdrbm.v1"
    assert info.python_version == platform.python_version()
    assert info.torch_version == metadata.version("torch")
    assert "onnx-export" in info.features and "open-inference" in info.features


def test_version_shows_the_client_and_the_service(service) -> None:
    result = _run("--version", "--target", service.target)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.splitlines() == [
        f"ssdrbm {ssdrbm.__version__} (client)",
        f"server {ssdrbm.__version__} at {service.target} (api ssdrbm.v1, "
        f"python {platform.python_version()}, torch {metadata.version('torch')})",
    ]


def test_version_without_a_service_shows_the_client_with_a_note() -> None:
    target = _closed_target()
    started = time.monotonic()
    result = _run("--version", "--target", target)
    assert time.monotonic() - started < FAIL_FAST_S
    assert result.returncode == 0
    assert result.stdout == f"ssdrbm {ssdrbm.__version__} (client)\n"
    assert f"cannot reach the ssdrbm service at {target}" in result.stderr
    assert "only the client's is shown" in result.stderr


class OtherVersion(rbm_pb2_grpc.RBMServiceServicer):
    """A service of another release: only GetServerInfo, answering version 0.0.1."""

    def GetServerInfo(self, request, context):
        return rbm_pb2.ServerInfo(version="0.0.1", api="ssdrbm.v1")


@pytest.mark.parametrize("servicer", [None, OtherVersion()], ids=["older", "other-version"])
def test_version_against_an_older_or_other_service(servicer) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    if servicer is not None:
        rbm_pb2_grpc.add_RBMServiceServicer_to_server(servicer, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        result = _run("--version", "--target", target)
    finally:
        server.stop(None)
    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == f"ssdrbm {ssdrbm.__version__} (client)"
    if servicer is None:  # a service from before GetServerInfo: UNIMPLEMENTED
        assert len(result.stdout.splitlines()) == 1
        assert f"the service at {target} is older than GetServerInfo" in result.stderr
    else:
        assert result.stdout.splitlines()[1].startswith(f"server 0.0.1 at {target}")
        assert f"the client ({ssdrbm.__version__}) and the service (0.0.1)" in result.stderr


def test_a_command_is_still_required() -> None:
    result = _run()
    assert result.returncode == ExitCode.USAGE
    assert "the following arguments are required: COMMAND" in result.stderr


# --- install advice -----------------------------------------------------------------------------

# `pip install <name>` for one of our distributions: they are on no package index, so such advice
# would install whatever someone else registered under that name.
STALE_ADVICE = re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?ssdrbm[\w-]*", re.IGNORECASE)


def _advice_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.toml", "*.yml", "Dockerfile", "scripts/*"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [ROOT / name for name in listed if not name.startswith("tests/")]


def test_no_advice_names_a_package_that_is_not_published() -> None:
    files = _advice_files()
    assert any(path.name == "funnel.py" for path in files)  # the messages are among them
    stale = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in files
        if path.is_file()
        for match in STALE_ADVICE.finditer(path.read_text(errors="replace"))
    ]
    assert stale == []
