"""The Redis launcher (server/ssdrbm_server/redis_process.py) that the demo, the benchmarks and the
test fixtures share: its defaults pass the service's own durability checks, a SIGTERM stop and a
SIGKILL both keep what the append-only file holds, and a server that cannot start says why."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ssdrbm_server.redis_checks import CHECKED, judge
from ssdrbm_server.redis_process import RedisServer


def settings(server: RedisServer) -> dict[str, str]:
    client = server.client(decode_responses=True)
    try:
        names = (*CHECKED, "save", "bind")
        return {name: client.config_get(name)[name] for name in names}
    finally:
        client.close()


def test_defaults_are_the_ones_the_service_requires(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        values = settings(server)
    assert values["appendonly"] == "yes"
    assert values["appendfsync"] == "everysec"
    assert values["maxmemory-policy"] == "noeviction"
    assert values["save"] == ""
    assert values["bind"] == "127.0.0.1"
    assert judge({"": values}, allow_no_persistence=False).refused == ()


def test_without_persistence_only_when_asked(tmp_path: Path) -> None:
    with RedisServer(tmp_path, appendonly=False, save="900 1") as server:
        values = settings(server)
    assert values["appendonly"] == "no"
    assert values["save"] == "900 1"
    assert judge({"": values}, allow_no_persistence=False).refused != ()


def test_an_unsafe_fsync_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="appendfsync"):
        RedisServer(tmp_path, appendfsync="no")


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_data_survives_a_stop_and_a_crash_on_the_same_port_and_directory(
    tmp_path: Path, end: str
) -> None:
    server = RedisServer(tmp_path, appendfsync="always")
    with server:
        client = server.client()
        client.set("kept", "1")
        client.close()
        process = server.process
        assert process is not None
        getattr(server, end)()
        assert process.returncode == (0 if end == "stop" else -signal.SIGKILL)
        assert not server.running()
        server.start()
        client = server.client()
        assert client.get("kept") == b"1"
        client.close()
    assert not server.running()


def test_a_server_whose_port_is_taken_fails_to_start_and_says_why(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "first") as first:
        taken = RedisServer(tmp_path / "second", port=first.port)
        with pytest.raises(RuntimeError, match="exited at start") as failed:
            taken.start()
    # The end of its log, which names the cause; the other server's answers were not taken for
    # this one's.
    assert "Address already in use" in str(failed.value)
    assert not taken.running()
