"""The ``ssdrbm`` command as a new user meets it: real processes against the real service.

- With the service up and Redis down, a command says Redis is unreachable (not "start the
  service"), and ``ssdrbm serve`` waits for Redis, saying so, then serves.
- A mistyped command, option or choice gets a "did you mean".
- An empty listing says what it looked for.
- Wherever a job id is taken, the name of one of the caller's jobs is taken too.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import PIL.Image
import pytest
from matplotlib.colors import to_hex
from ssdrbm.cli import main
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.plot import SweepCurve, sweep_figure, write_sweep_figure
from ssdrbm.events import Metrics

from ssdrbm_server.redis_process import RedisServer
from ssdrbm_server.redis_wait import printable_url
from tests.fixtures.console import SSDRBM, cli
from tests.fixtures.redis import free_port

ANSWERED_S = 30.0  # a refusal comes back well within this, even on a loaded 2-core machine


def _closed_redis_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


# --- Redis down ---------------------------------------------------------------------------------


def test_a_service_without_redis_is_reported_as_such(service_factory) -> None:
    service = service_factory(_closed_redis_url(), run_worker=False)
    for command in (["jobs"], ["datasets"], ["train", "--hidden", "4"]):
        started = time.monotonic()
        result = cli(service, *command)
        assert time.monotonic() - started < ANSWERED_S
        assert result.returncode == ExitCode.UNAVAILABLE, result.stderr
        line = result.stderr.strip()
        assert line.count("\n") == 0, result.stderr
        assert f"the ssdrbm service at {service.target} is up" in line
        assert "(Redis) is unreachable" in line and "SSDRBM_REDIS_URL" in line
        assert "ssdrbm serve" not in line  # it is running: starting it is no fix


def test_serve_help_is_whole_and_its_defaults_are_the_settings() -> None:
    """`ssdrbm serve --help` (the service's own help) ends no sentence midway and names the
    settings a first run needs with the defaults the service really uses."""
    from ssdrbm_server.config import Settings

    result = subprocess.run([SSDRBM, "serve", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    description = text.split("options:")[0].split("\n\n", 1)[1]
    assert " ".join(description.split()).endswith("the options below override them.")
    defaults = Settings()
    for name in ("redis_url", "listen_address", "http_port", "metrics_port", "auth_mode"):
        assert f"SSDRBM_{name.upper()} (default {getattr(defaults, name)})" in text, name
    assert "exit codes: 0 stopped, 1 failed while running, 2 configuration error" in text


QUICK_START_SETUP = ("./scripts/install", "redis-server", "ssdrbm serve")  # done by the fixture


def test_the_readme_quick_start_runs_as_written(service, tmp_path: Path) -> None:
    """The README's Quick start, its commands as written after the install, Redis and `ssdrbm
    serve` (the fixture's service): scikit-learn's digits uploaded and learned, their features
    and figures written (in a temporary folder)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if not line.startswith(QUICK_START_SETUP)]
    assert len(lines) < len(block.splitlines()), "the setup lines are where the test expects"
    env = {
        **os.environ,
        "PATH": f"{Path(SSDRBM).parent}:{os.environ['PATH']}",
        "SSDRBM_TARGET": service.target,
    }
    script = "set -euo pipefail\n" + "\n".join(lines)
    result = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "succeeded at step 1000/1000" in result.stderr
    assert np.load(tmp_path / "h.npy").shape == (8, 25)
    for figure in ("metrics", "filters", "reconstructions"):
        assert (tmp_path / "figures" / f"{figure}.png").stat().st_size > 0, figure


def _read_until(stream, needle: str, deadline: float) -> str:
    seen = ""
    while needle not in seen:
        assert time.monotonic() < deadline, f"{needle!r} not said; got {seen!r}"
        line = stream.readline()
        assert line, f"the process ended before saying {needle!r}; got {seen!r}"
        seen += line
    return seen


def test_worker_waits_for_redis_saying_so_and_help_names_its_settings(tmp_path: Path) -> None:
    """`ssdrbm worker` waits for Redis as `ssdrbm serve` does, then runs; its help names the
    worker's own settings with their defaults (slots among them)."""
    result = subprocess.run([SSDRBM, "worker", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "--slots N" in result.stdout and "SSDRBM_WORKER_SLOTS (default 0)" in result.stdout
    redis_port = free_port()
    env = {
        **os.environ,
        "SSDRBM_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "SSDRBM_WORKER_METRICS_PORT": "0",
        "SSDRBM_ALLOW_NO_PERSISTENCE": "1",
    }
    process = subprocess.Popen(
        [SSDRBM, "worker"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    redis = RedisServer(tmp_path / "redis", port=redis_port, appendonly=False)
    try:
        deadline = time.monotonic() + ANSWERED_S
        said = _read_until(process.stderr, "waiting for Redis", deadline)
        assert said.startswith("ssdrbm worker: waiting for Redis at ")
        redis.start()
        _read_until(process.stderr, "Redis answers", deadline + ANSWERED_S)
        _read_until(process.stderr, "started", deadline + ANSWERED_S)
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[1]
        redis.stop()
    assert process.returncode == 0, output


def test_serve_waits_for_redis_saying_so(tmp_path: Path) -> None:
    redis_port, port = free_port(), free_port()
    env = {
        **os.environ,
        "SSDRBM_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "SSDRBM_METRICS_PORT": "0",
        "SSDRBM_LOG_LEVEL": "WARNING",
        "SSDRBM_ALLOW_NO_PERSISTENCE": "1",
    }
    process = subprocess.Popen(
        [SSDRBM, "serve", "--no-worker", "--listen", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    redis = RedisServer(tmp_path / "redis", port=redis_port, appendonly=False)
    try:
        deadline = time.monotonic() + ANSWERED_S
        said = _read_until(process.stderr, "waiting for Redis", deadline)
        assert f"redis://127.0.0.1:{redis_port}/0" in said
        assert "redis-server" in said and "SSDRBM_REDIS_URL" in said
        assert process.poll() is None  # still waiting, not exited

        redis.start()
        _read_until(process.stderr, "Redis answers", deadline + ANSWERED_S)
        result = subprocess.run(
            [SSDRBM, "--wait", "60", "jobs", "--json", "--target", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == ExitCode.OK, result.stderr
        assert result.stdout.strip() == "[]"
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
        redis.stop()
    assert process.returncode == 0


def test_a_redis_password_is_not_printed() -> None:
    assert printable_url("redis://:hunter2@db:6379/0") == "redis://:***@db:6379/0"
    assert printable_url("rediss://me:hunter2@db:6380/1") == "rediss://me:***@db:6380/1"
    assert printable_url("redis://db:6379/0") == "redis://db:6379/0"


# --- did you mean -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "suggestion"),
    [
        (["trian", "--hidden", "4"], "did you mean 'train'?"),
        (["jbos"], "did you mean 'jobs'?"),
        (["sweep-shwo", "s-1"], "did you mean 'sweep-show'?"),
        (["train", "--hiden", "4"], "did you mean '--hidden'?"),
        (["train", "--hidden=4", "--stpes=5"], "did you mean '--steps'?"),
        (["jobs", "--json", "--limt", "3"], "did you mean '--limit'?"),
        (["train", "--model", "bernouli"], "did you mean 'bernoulli'?"),
        (["jobs", "--state", "runing"], "did you mean 'running'?"),
    ],
)
def test_a_mistyped_word_gets_a_suggestion(capsys, command, suggestion) -> None:
    assert main(command) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert suggestion in err.splitlines()[-1], err


def test_no_suggestion_for_a_word_close_to_nothing(capsys) -> None:
    assert main(["xyzzy"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "invalid choice: 'xyzzy'" in err and "did you mean" not in err


# --- empty listings -----------------------------------------------------------------------------


def test_an_empty_filtered_listing_names_its_filter(service) -> None:
    result = cli(service, "jobs", "--state", "running")
    assert result.returncode == ExitCode.OK, result.stderr
    assert result.stdout.startswith("no running jobs") and "yet" not in result.stdout
    assert cli(service, "jobs").stdout.startswith("no jobs yet")


# --- jobs by name -------------------------------------------------------------------------------


def test_every_job_command_takes_a_unique_job_name(service, tmp_path: Path) -> None:
    x = (np.random.default_rng(0).random((60, 9)) < 0.3).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    train = ["train", "--hidden", "4", "--steps", "20", "--batch-size", "20", "--data"]
    result = cli(service, *train, str(tmp_path / "x.npy"), "--name", "digits-small")
    assert result.returncode == ExitCode.OK, result.stderr
    job = result.stdout.strip()

    watched = cli(service, "watch", "digits-small")
    assert watched.returncode == ExitCode.OK, watched.stderr
    assert f"job {job} succeeded" in watched.stderr
    got = cli(service, "get", "digits-small", "--json")
    assert json.loads(got.stdout)["id"] == job
    for command in ("features", "reconstruct"):
        out = tmp_path / f"{command}.npy"
        used = cli(service, command, "digits-small", "-i", str(tmp_path / "x.npy"), "-o", str(out))
        assert used.returncode == ExitCode.OK, used.stderr
    exported = cli(service, "export", "digits-small", "-o", str(tmp_path / "model"), "--json")
    assert json.loads(exported.stdout)["job_id"] == job
    assert cli(service, "cancel", "digits-small").stdout.split() == [job, "succeeded"]

    # A name two jobs share is refused, naming both; an unknown one is not found.
    again = cli(service, "train", "--hidden", "4", "--steps", "20", "--name", "digits-small")
    assert again.returncode == ExitCode.OK, again.stderr
    shared = cli(service, "get", "digits-small")
    assert shared.returncode == ExitCode.USAGE
    assert "names more than one of your jobs" in shared.stderr
    assert job in shared.stderr and again.stdout.strip() in shared.stderr
    missing = cli(service, "get", "no-such-name")
    assert missing.returncode == ExitCode.NOT_FOUND and "no-such-name" in missing.stderr

    deleted = cli(service, "delete", again.stdout.strip(), "--force")
    assert deleted.returncode == ExitCode.OK, deleted.stderr
    deleted = cli(service, "delete", "digits-small")  # unique again
    assert deleted.stdout.strip() == f"{job} deleted"


# --- uploads made for a submit ------------------------------------------------------------------


def _dataset_ids(service) -> list[str]:
    listed = cli(service, "datasets", "--json")
    assert listed.returncode == ExitCode.OK, listed.stderr
    return [dataset["id"] for dataset in json.loads(listed.stdout)]


def test_a_dry_run_or_refused_submit_leaves_no_uploaded_dataset(service, tmp_path: Path) -> None:
    data = tmp_path / "x.npy"
    np.save(data, (np.random.default_rng(1).random((40, 6)) < 0.5).astype(np.float32))
    train = ["train", "--hidden", "3", "--steps", "10", "--batch-size", "10", "--data", str(data)]

    dry = cli(service, *train, "--dry-run", "--json")
    assert dry.returncode == ExitCode.OK, dry.stderr
    assert json.loads(dry.stdout)["n_visible"] == 6  # the upload was used, then deleted
    refused = cli(service, *train, "--lr", "-1")
    assert refused.returncode == ExitCode.USAGE and "lr" in refused.stderr
    sweep = cli(service, "sweep", *train[1:], "--lr", "0.01,0.02", "--dry-run", "--json")
    assert sweep.returncode == ExitCode.OK, sweep.stderr
    assert _dataset_ids(service) == []

    # A dataset the caller had already is left alone; a submit that happens keeps its upload.
    uploaded = cli(service, "upload", str(data)).stdout.strip()
    assert cli(service, *train, "--lr", "-1").returncode == ExitCode.USAGE
    assert cli(service, *train, "--dry-run").returncode == ExitCode.OK
    assert _dataset_ids(service) == [uploaded]
    assert cli(service, "delete-dataset", uploaded).returncode == ExitCode.OK
    submitted = cli(service, *train)
    assert submitted.returncode == ExitCode.OK, submitted.stderr
    assert _dataset_ids(service) == [uploaded]


# --- one rendering of enum values and numbers ---------------------------------------------------

PROTO_ENUM_NAME = re.compile(r"\b[A-Z]+(?:_[A-Z]+)+\b")  # MODEL_KIND_BERNOULLI, STEP_RULE_PAPER


def test_enum_values_read_as_the_options_take_them_and_numbers_are_numbers(service) -> None:
    train = ["train", "--hidden", "4", "--steps", "300", "--seed", "7", "--dry-run"]
    train += ["--step-rule", "paper", "--schedule", "cosine", "--method", "newton-schulz"]
    shown = cli(service, *train)
    assert shown.returncode == ExitCode.OK, shown.stderr
    lines = dict(line.split(":", 1) for line in shown.stdout.splitlines())
    assert lines["spec.model.kind"].strip() == "bernoulli"
    assert lines["spec.optimizer.kind"].strip() == "ssd"
    assert lines["spec.optimizer.step_rule"].strip() == "paper"
    assert lines["spec.optimizer.schedule.kind"].strip() == "cosine"
    assert lines["spec.optimizer.method"].strip() == "newton-schulz"
    assert not PROTO_ENUM_NAME.search(shown.stdout), shown.stdout

    spec = json.loads(cli(service, *train, "--json").stdout)["spec"]
    assert (spec["model"]["kind"], spec["optimizer"]["step_rule"]) == ("bernoulli", "paper")
    assert spec["training"]["steps"] == 300 and spec["training"]["seed"] == 7  # 64-bit: numbers
    assert spec["optimizer"]["schedule"]["horizon"] == 300
    defaults = cli(service, "defaults", "--json").stdout
    assert not PROTO_ENUM_NAME.search(defaults), defaults
    assert json.loads(defaults)["example"]["model"]["kind"] == "bernoulli"


# --- the sweep's figure -------------------------------------------------------------------------


def _history(scale: float) -> list[Metrics]:
    return [
        Metrics(
            step=step,
            total_steps=40,
            reconstruction_error=scale / step,
            spectral_norm=1.0,
            wall_time_s=float(step),
            samples_per_second=100.0,
        )
        for step in (10, 20, 40)
    ]


def test_the_sweep_figure_keeps_its_legend_off_the_curves_in_distinct_colours(
    tmp_path: Path,
) -> None:
    curves = [SweepCurve(f"lr={i}", _history(1.0 + i), best=i == 3) for i in range(30)]
    figure = sweep_figure(curves, "reconstruction_error")
    axis = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    legend = axis.get_legend().get_window_extent(renderer)
    assert legend.x0 >= axis.get_window_extent(renderer).x1  # to the right of the axes
    colours = [line.get_color() for line in axis.get_lines()]
    assert len({to_hex(colour) for colour in colours}) == len(curves)
    assert to_hex(colours[-1]) == "#000000"  # the best, drawn last (on top), in black
    plt.close(figure)

    path = write_sweep_figure(tmp_path, curves, "reconstruction_error")
    with PIL.Image.open(path) as image:
        width, _ = image.size
    assert width >= legend.x1 - 1  # the image holds the whole legend: widened, not cut off
