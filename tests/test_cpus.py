"""CPU pinning of serving and training (SSDRBM_SERVING_CPUS, SSDRBM_TRAINING_CPUS)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ssdrbm_server.config import ConfigError, Settings
from ssdrbm_server.cpus import parse_cpu_list
from ssdrbm_server.healthcheck import check
from tests.fixtures.redis import free_port
from tests.fixtures.server_process import python_m_server, stop_gracefully, wait_until

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="needs Linux CPU affinity"
)


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), ("0", {0}), ("0-2", {0, 1, 2}), ("3,1-2", {1, 2, 3}), (" 4 , 4 ", {4})],
)
def test_cpu_lists_parse(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a", "'a' is not a CPU number or range"),
        ("1-", "'1-' is not a CPU number or range"),
        ("-1", "'-1' is not a CPU number or range"),
        ("3-1", "range '3-1' runs backwards"),
        ("4096", "names CPUs [4096] but this host has"),
    ],
)
def test_bad_cpu_lists_stop_the_start_naming_the_variable(text, message):
    with pytest.raises(ConfigError) as caught:
        Settings.from_env(environ={"SSDRBM_TRAINING_CPUS": text})
    assert str(caught.value).startswith("SSDRBM_TRAINING_CPUS")
    assert message in str(caught.value)


def allowed_cpus(pid: int, thread: int | None = None) -> str:
    """The kernel's Cpus_allowed_list of a process (or one of its threads)."""
    path = Path(f"/proc/{pid}") / ("" if thread is None else f"task/{thread}") / "status"
    for line in path.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list in {path}")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # the process ended meanwhile
                continue
            # the command name is parenthesised and may hold spaces: the ppid follows ") S "
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def training_child(pid: int) -> list[int]:
    """The spawned training process (not multiprocessing's resource tracker)."""
    return [child for child in children_of(pid) if b"spawn_main" in cmdline(child)]


def test_python_m_server_pins_serving_and_its_training_process(redis_url: str) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    serving, training = str(cpus[0]), str(cpus[-1])  # disjoint where there are two CPUs
    port = free_port()
    with python_m_server(
        redis_url, port, metrics_port="0", serving_cpus=serving, training_cpus=training
    ) as process:
        wait_until(
            process,
            lambda: check(f"127.0.0.1:{port}", timeout_s=1.0) and training_child(process.pid),
            "the server and its training process starting",
        )
        threads = [int(t) for t in os.listdir(f"/proc/{process.pid}/task")]
        assert len(threads) > 1  # gRPC's and asyncio's threads, all under the serving mask
        assert {allowed_cpus(process.pid, t) for t in threads} == {serving}
        (child,) = training_child(process.pid)
        # The child pins itself first thing, a moment after it starts.
        wait_until(process, lambda: allowed_cpus(child) == training, "the training process pinning")
        assert allowed_cpus(child) == training
        output = stop_gracefully(process)
    assert process.returncode == 0, output
    assert f"serving process {process.pid} pinned to CPUs [{serving}]" in output
