"""The ``ssdrbm`` command: exit codes, the error funnel, progress rendering, tables, figures, and
every command driven through its entry point against a real in-process service and real Redis."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save as safetensors_save
from ssdrbm import Client, errors
from ssdrbm.cli import jobs as jobs_cli
from ssdrbm.cli import main
from ssdrbm.cli import sweeps as sweeps_cli
from ssdrbm.cli.exit_codes import ExitCode
from ssdrbm.cli.funnel import Context, describe
from ssdrbm.cli.main import EPILOG
from ssdrbm.cli.plot import guess_image_shape, tile_images, write_figures
from ssdrbm.cli.progress import (
    ProgressDisplay,
    ProgressState,
    render_line,
    render_summary,
)
from ssdrbm.cli.tables import render_table
from ssdrbm.events import Job, JobState, Metrics, MetricsEvent, StateEvent
from ssdrbm.model_file import ExportedModel
from ssdrbm.sweeps import SweepState

from tests.fixtures.redis import free_port

ERROR_LINE = re.compile(r"^ssdrbm: error: .+ — .+$")

# --- exit codes and the error funnel ------------------------------------------------------------


def test_exit_codes_are_documented_where_users_look() -> None:
    table = dict(re.findall(r"^\s+([A-Z_]+)\s+(\d+)\s", ExitCode.__doc__ or "", re.MULTILINE))
    assert {name: int(value) for name, value in table.items()} == {
        code.name: int(code) for code in ExitCode
    }
    assert ExitCode.INTERRUPTED == 130 and ExitCode.OK == 0 and ExitCode.USAGE == 2
    for code in ExitCode:  # the --help epilog lists every code
        assert re.search(rf"\b{int(code)} ", EPILOG), code


def test_every_final_state_has_an_exit_code_and_only_those() -> None:
    assert set(jobs_cli.FINAL_EXIT_CODES) == {state for state in JobState if state.terminal}
    assert set(sweeps_cli.FINAL_EXIT_CODES) == {state for state in SweepState if state.terminal}


@pytest.mark.parametrize(
    ("error", "code", "says"),
    [
        (errors.Unavailable("connection refused"), ExitCode.UNAVAILABLE, "10.0.0.1:5"),
        (errors.DeadlineExceeded("slow"), ExitCode.UNAVAILABLE, "--timeout"),
        (errors.NotFound("no such job"), ExitCode.NOT_FOUND, "job j-1 not found"),
        (errors.NotFound("dataset 'd' not found; upload it"), ExitCode.NOT_FOUND, "ssdrbm upload"),
        (errors.NotFound("sweep 's' not found; check the id"), ExitCode.NOT_FOUND, "ssdrbm sweeps"),
        (errors.InvalidArgument("lr: must be > 0"), ExitCode.USAGE, "lr: must be > 0"),
        (errors.Unauthenticated("missing token"), ExitCode.UNAUTHENTICATED, "--token"),
        (errors.PermissionDenied("nope"), ExitCode.UNAUTHENTICATED, "not allowed"),
        (errors.FailedPrecondition("no checkpoint"), ExitCode.NOT_READY, "ssdrbm get j-1"),
        (errors.FailedPrecondition("s is running; pass --force"), ExitCode.NOT_READY, "g — pass"),
        (errors.ResourceExhausted("too big"), ExitCode.LIMIT, "too big — send less at once"),
        (errors.ResourceExhausted("64 points at most; use fewer"), ExitCode.LIMIT, "t — use fewer"),
        (errors.ServerError("boom"), ExitCode.ERROR, "boom"),
        (KeyboardInterrupt(), ExitCode.INTERRUPTED, "ssdrbm cancel j-1"),
        (FileNotFoundError(2, "No such file", "x.npy"), ExitCode.ERROR, "x.npy"),
        (RuntimeError("odd"), ExitCode.ERROR, "--debug"),
    ],
)
def test_each_failure_is_one_line_naming_what_to_do(error, code, says) -> None:
    failure = describe(error, Context(command="watch", target="10.0.0.1:5", job_id="j-1"))
    assert failure.code == code
    assert ERROR_LINE.match(failure.line()), failure.line()
    assert says in failure.line()


def test_unreachable_service_exits_3_with_the_address_and_no_traceback(capsys) -> None:
    target = f"127.0.0.1:{free_port()}"
    code = main(["--target", target, "--wait", "0", "get", "some-job"])
    out, err = capsys.readouterr()
    assert code == ExitCode.UNAVAILABLE
    assert out == ""
    assert err.count("\n") == 1 and ERROR_LINE.match(err.strip())
    assert f"cannot reach the ssdrbm service at {target}" in err and "Traceback" not in err

    code = main(["get", "some-job", "--target", target, "--wait", "0.5", "--debug"])  # after too
    err = capsys.readouterr().err
    assert code == ExitCode.UNAVAILABLE
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("ssdrbm: error:")


def test_target_and_token_come_from_the_environment(monkeypatch, capsys) -> None:
    target = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("SSDRBM_TARGET", target)
    monkeypatch.setenv("SSDRBM_WAIT", "0")
    assert main(["jobs"]) == ExitCode.UNAVAILABLE
    assert target in capsys.readouterr().err


def test_bad_command_lines_exit_2(capsys) -> None:
    assert main(["train", "--lr", "fast"]) == ExitCode.USAGE
    assert "invalid float value" in capsys.readouterr().err
    assert main(["train", "--optimizer", "adamw"]) == ExitCode.USAGE
    assert main(["train", "--steps", "5", "--epochs", "1"]) == ExitCode.USAGE
    capsys.readouterr()
    assert main(["train", "--hidden", "-4"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert ERROR_LINE.match(err.strip()) and "n_hidden" in err
    assert main(["train", "--option", "oops"]) == ExitCode.USAGE
    assert "--option expects KEY=VALUE" in capsys.readouterr().err
    assert main(["train", "--per-parameter-lr", "W=quick"]) == ExitCode.USAGE
    assert "--per-parameter-lr W= expects a number" in capsys.readouterr().err
    assert main(["plot", "j", "--output", "d", "--image-shape", "big"]) == ExitCode.USAGE


def test_serve_without_the_server_package_says_what_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ssdrbm_server", None)  # as if only the client were installed
    assert main(["serve"]) == ExitCode.ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ERROR_LINE.match(err.strip())
    assert "pip install . ./client ./server (or ./scripts/install) in a checkout" in err


# --- progress -----------------------------------------------------------------------------------


def _metrics(step: int, total: int = 1000, wall: float = 10.0, ll: float | None = None):
    return Metrics(
        step=step,
        total_steps=total,
        reconstruction_error=12.5,
        spectral_norm=3.0,
        wall_time_s=wall,
        samples_per_second=2500.0,
        log_likelihood=ll,
    )


def _metrics_event(step: int, **kwargs) -> MetricsEvent:
    return MetricsEvent("job-1", f"{step}-0", None, _metrics(step, **kwargs))


def _state_event(state: JobState, step: int = 0, message: str = "") -> StateEvent:
    return StateEvent("job-1", f"s{step}", None, state, message, 1, step)


def _job(state: JobState, error: str = "") -> Job:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    return Job(
        id="job-1",
        name="",
        state=state,
        step=1000,
        total_steps=1000,
        attempt=1,
        error=error,
        checkpoint_step=1000,
        worker="w",
        n_visible=100,
        created_at=start,
        started_at=start,
        finished_at=start + timedelta(seconds=83),
        latest_metrics=_metrics(1000, wall=80.0, ll=-61.25),
    )


def test_progress_state_computes_fraction_and_eta() -> None:
    progress = ProgressState("job-1")
    assert progress.eta_s() is None and progress.fraction == 0.0
    progress.update(_state_event(JobState.RUNNING))
    progress.update(_metrics_event(250, wall=10.0, ll=-70.0))  # 25 steps/s
    assert progress.state is JobState.RUNNING
    assert progress.fraction == 0.25
    assert progress.eta_s() == pytest.approx(30.0)
    progress.update(_metrics_event(500, wall=20.0))  # no LL this time: keep the latest one
    assert progress.log_likelihood == -70.0


def test_progress_line_shows_step_rate_eta_and_metrics() -> None:
    progress = ProgressState("job-1", state=JobState.RUNNING)
    progress.update(_metrics_event(250, wall=10.0, ll=-70.0))
    line = render_line(progress, width=200)
    for part in ("step 250/1000", "25%", "2,500 samples/s", "ETA 0:30", "recon 12.5", "LL -70"):
        assert part in line, (part, line)
    assert len(render_line(progress, width=40)) == 40


def test_progress_draws_in_place_on_a_tty_and_logs_lines_otherwise() -> None:
    events = [_state_event(JobState.RUNNING), _metrics_event(500), _metrics_event(1000)]
    tty = io.StringIO()
    display = ProgressDisplay("job-1", stream=tty, tty=True)
    for event in events:
        display.on_event(event)
    display.finish(_job(JobState.SUCCEEDED))
    text = tty.getvalue()
    assert text.startswith("\r\x1b[2K") and text.count("\n") == 1  # one line, redrawn
    assert text.endswith(render_summary(_job(JobState.SUCCEEDED)) + "\n")

    plain = io.StringIO()
    display = ProgressDisplay("job-1", stream=plain, tty=False)
    for event in events:
        display.on_event(event)
    display.finish(_job(JobState.SUCCEEDED))
    lines = plain.getvalue().splitlines()
    assert "\x1b" not in plain.getvalue() and "\r" not in plain.getvalue()
    assert lines[0] == "job-1 running at step 0"
    assert lines[1].startswith("job-1 step=500/1000 recon=12.5")
    assert len(lines) == 4


def test_a_finished_runs_note_follows_the_summary_on_a_tty_and_is_its_state_line_otherwise():
    note = "the reconstruction error ended at 1662, 4.6× its best 360.1 (step 200): ..."
    events = [_state_event(JobState.RUNNING), _state_event(JobState.SUCCEEDED, 1000, note)]
    tty = io.StringIO()
    display = ProgressDisplay("job-1", stream=tty, tty=True)
    for event in events:
        display.on_event(event)
    display.finish(_job(JobState.SUCCEEDED))
    assert tty.getvalue().splitlines()[-1] == f"note: {note}"
    plain = io.StringIO()
    display = ProgressDisplay("job-1", stream=plain, tty=False)
    for event in events:
        display.on_event(event)
    display.finish(_job(JobState.SUCCEEDED))
    assert f"job-1 succeeded at step 1000: {note}" in plain.getvalue().splitlines()
    assert "note:" not in plain.getvalue()  # said once, in its state line
    plain_finish = io.StringIO()
    display = ProgressDisplay("job-1", stream=plain_finish, tty=True)
    display.on_event(_state_event(JobState.SUCCEEDED, 1000, "finished"))
    display.finish(_job(JobState.SUCCEEDED))
    assert "note:" not in plain_finish.getvalue()


def test_summary_names_time_metrics_and_failure_reason() -> None:
    done = render_summary(_job(JobState.SUCCEEDED))
    assert done == "job job-1 succeeded at step 1000/1000 in 1:23 — recon 12.5, LL -61.25"
    failed = render_summary(_job(JobState.FAILED, error="diverged at step 17"))
    assert "failed" in failed and failed.endswith("— diverged at step 17")


# --- tables and figures -------------------------------------------------------------------------


def test_table_columns_are_aligned() -> None:
    text = render_table(("ID", "STATE"), [["a", "running"], ["long-id", "queued"]])
    assert text.splitlines() == ["ID       STATE", "a        running", "long-id  queued"]


def test_image_shapes_and_tiles() -> None:
    assert guess_image_shape(784) == (28, 28)
    assert guess_image_shape(560) == (28, 20)
    assert guess_image_shape(100) == (10, 10)
    assert guess_image_shape(30) is None
    canvas = tile_images(np.arange(12.0).reshape(3, 4), (2, 2), columns=2)
    assert canvas.shape == (5, 5)
    np.testing.assert_array_equal(canvas[0:2, 3:5], [[4, 5], [6, 7]])
    assert np.isnan(canvas[2]).all()


def test_figures_are_written_as_png(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tensors = {
        "model.W": rng.standard_normal((16, 6)).astype(np.float32),
        "model.a": np.zeros(6, dtype=np.float32),
        "model.log_var": rng.standard_normal(16).astype(np.float32),
    }
    model = ExportedModel.from_bytes(safetensors_save(tensors), config={"type": "gaussian"})
    history = [_metrics(step, ll=-50.0 + step / 100) for step in (10, 20, 30)]
    inputs = rng.random((3, 16))
    written = write_figures(
        tmp_path, history=history, model=model, inputs=inputs, reconstructions=inputs
    )
    names = sorted(path.name for path in written)
    assert names == [
        "filters.png",
        "metrics.png",
        "reconstructions.png",
        "variances.png",
        "weights_histogram.png",
    ]
    for path in written:
        assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="does not match"):
        write_figures(tmp_path, history=[], model=model, image_shape=(3, 3))


def test_json_output_of_a_job_is_plain_json() -> None:
    from ssdrbm.cli.output import dumps

    decoded = json.loads(dumps(_job(JobState.SUCCEEDED)))
    assert decoded["state"] == "succeeded"
    assert decoded["finished_at"] == "2026-01-01T00:01:23+00:00"
    assert decoded["latest_metrics"]["log_likelihood"] == -61.25


# --- every command against the real service -----------------------------------------------------


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``ssdrbm ARGS`` through its entry point; returns (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_end_to_end(service, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("SSDRBM_TARGET", service.target)
    rng = np.random.default_rng(0)
    x = (rng.random((120, 16)) < 0.3).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    x_path = str(tmp_path / "x.npy")

    code, out, _ = run_cli(capsys, "upload", x_path, "--json")
    assert code == ExitCode.OK
    dataset = json.loads(out)
    assert dataset["shape"] == [120, 16]

    # --data uploads, then trains; a Gaussian model so that its learned variances get plotted
    train = ["train", "--data", x_path, "--model", "gaussian", "--hidden", "8", "--steps", "60"]
    train += ["--batch-size", "40", "--eval-every", "20", "--name", "cli-job", "--watch"]
    code, out, err = run_cli(capsys, *train)
    assert code == ExitCode.OK, err
    job_id = out.strip()
    assert "\n" not in job_id and job_id  # stdout carries only the id: JOB=$(ssdrbm train ...)
    log = err.splitlines()
    assert any(line.startswith(f"{job_id} step=60/60 recon=") for line in log), err
    assert log[-1].startswith(f"job {job_id} succeeded at step 60/60 in ")

    code, out, _ = run_cli(capsys, "jobs")
    header, row = out.splitlines()
    assert header.split() == ["ID", "NAME", "STATE", "STEP", "RECON", "LOG-LIK", "CREATED"]
    assert row.split()[:4] == [job_id, "cli-job", "succeeded", "60/60"]

    code, out, _ = run_cli(capsys, "get", job_id, "--json")
    assert code == ExitCode.OK and json.loads(out)["state"] == "succeeded"
    code, out, _ = run_cli(capsys, "get", job_id)
    assert "id:" in out and "succeeded" in out

    code, out, err = run_cli(capsys, "watch", job_id, "--json")  # a finished job replays
    events = [json.loads(line) for line in out.splitlines()]
    assert code == ExitCode.OK
    assert [e["metrics"]["step"] for e in events if e["event"] == "metrics"][-1] == 60
    assert events[-1]["event"] == "job" and events[-1]["job"]["id"] == job_id

    code, out, _ = run_cli(capsys, "features", job_id, "-i", x_path, "-o", str(tmp_path / "h.npy"))
    assert code == ExitCode.OK
    h = np.load(tmp_path / "h.npy")
    assert h.shape == (120, 8) and h.min() >= 0.0 and h.max() <= 1.0
    code, _, _ = run_cli(
        capsys, "features", job_id, "-i", x_path, "-o", str(tmp_path / "s.npy"), "--sample"
    )
    assert set(np.unique(np.load(tmp_path / "s.npy"))) <= {0.0, 1.0}
    code, out, _ = run_cli(
        capsys, "reconstruct", job_id, "-i", x_path, "-o", str(tmp_path / "y.npy"), "--json"
    )
    assert code == ExitCode.OK and json.loads(out)["shape"] == [120, 16]
    assert np.load(tmp_path / "y.npy").shape == (120, 16)

    code, out, _ = run_cli(capsys, "export", job_id, "--output", str(tmp_path / "model"))
    assert code == ExitCode.OK
    assert sorted(Path(p).name for p in out.split()) == ["config.json", "model.safetensors"]
    exported = ExportedModel.load(tmp_path / "model")  # read with numpy alone
    assert exported.kind == "gaussian" and "log_var" in exported.parameters
    np.testing.assert_allclose(exported.hidden_probs(x), h, atol=1e-5)  # p(h|v) = σ(vᵀC⁻¹W + a)

    code, out, err = run_cli(
        capsys, "plot", job_id, "--output", str(tmp_path / "fig"), "--input", x_path
    )
    assert code == ExitCode.OK, err
    names = sorted(Path(p).name for p in out.split())
    assert names == [
        "filters.png",
        "metrics.png",
        "reconstructions.png",
        "variances.png",
        "weights_histogram.png",
    ]

    # The console script itself, as a user's shell runs it.
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ssdrbm"), "jobs", "--json", "--state", "succeeded"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SSDRBM_TARGET": service.target},
    )
    assert result.returncode == 0, result.stderr
    assert [job["id"] for job in json.loads(result.stdout)] == [job_id]


def test_cli_errors_name_the_job_and_the_field(service, capsys) -> None:
    target = ["--target", service.target]
    code, out, err = run_cli(capsys, *target, "get", "no-such-job")
    assert code == ExitCode.NOT_FOUND and out == ""
    assert ERROR_LINE.match(err.strip()) and "job 'no-such-job' not found —" in err
    assert "ssdrbm jobs" in err

    code, _, err = run_cli(capsys, *target, "train", "--hidden", "4", "--lr", "-1")
    assert code == ExitCode.USAGE
    assert ERROR_LINE.match(err.strip()) and "invalid argument: " in err and "lr" in err
    code, _, err = run_cli(capsys, *target, "train")
    assert code == ExitCode.USAGE and "model.n_hidden" in err and "required" in err

    code, _, err = run_cli(capsys, *target, "watch", "no-such-job")
    assert code == ExitCode.NOT_FOUND and "no-such-job" in err

    code, _, err = run_cli(capsys, *target, "upload", "/nonexistent/x.npy")
    assert code == ExitCode.ERROR and "/nonexistent/x.npy" in err and ERROR_LINE.match(err.strip())


def test_defaults_and_dry_run_show_what_the_server_fills_in(service, capsys) -> None:
    target = ["--target", service.target]
    code, out, _ = run_cli(capsys, *target, "defaults")
    assert code == ExitCode.OK
    assert "default step sizes" in out and "gaussian" in out and "ssd-preconditioned" in out
    assert "optimizer.method:" in out and "auto" in out  # resolved per device by the worker
    code, out, _ = run_cli(capsys, *target, "defaults", "--json")
    table = json.loads(out)
    gaussian_ssd = [
        (e["short_run_lr"], e["lr"])
        for e in table["step_sizes"]
        if (e["model"], e["variance"], e["optimizer"]) == ("gaussian", "diagonal", "ssd")
    ]
    assert len(gaussian_ssd) == 2  # one per SSD step rule
    assert (table["short_run_steps"], table["long_run_steps"]) == (400, 2000)
    shown = run_cli(capsys, *target, "defaults")[1]
    assert "step rule" in shown and "<= 400 steps" in shown and ">= 2000" in shown
    dry_run = [*target, "train", "--hidden", "4", "--model", "gaussian", "--dry-run", "--json"]
    for steps, lr in (("400", gaussian_ssd[0][0]), ("2000", gaussian_ssd[0][1])):
        code, out, _ = run_cli(capsys, *dry_run, "--steps", steps)
        job = json.loads(out)
        assert code == ExitCode.OK and job["id"] == ""  # nothing was created
        assert job["spec"]["optimizer"]["lr"] == lr  # the value for the job's length
    code, out, _ = run_cli(capsys, *target, "jobs", "--json")
    assert json.loads(out) == []


def test_serve_runs_the_service_until_sigterm(redis_url: str, capsys) -> None:
    port = free_port()
    env = {
        **os.environ,
        "SSDRBM_REDIS_URL": redis_url,
        "SSDRBM_METRICS_PORT": "0",
        "SSDRBM_LOG_LEVEL": "WARNING",
        "SSDRBM_ALLOW_NO_PERSISTENCE": "1",  # the test Redis keeps no AOF
    }
    command = [str(Path(sys.executable).parent / "ssdrbm"), "serve", "--no-worker"]
    process = subprocess.Popen(
        [*command, "--listen", f"127.0.0.1:{port}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    target = ["--target", f"127.0.0.1:{port}"]
    try:
        # As in the quick start: the next command waits for the service to come up.
        code, out, err = run_cli(capsys, *target, "--wait", "60", "train", "--hidden", "4")
        assert code == ExitCode.OK, err
        code, out, _ = run_cli(capsys, *target, "get", out.strip(), "--json")
        assert json.loads(out)["state"] == "queued"  # no worker in this process
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr


def _self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A throw-away certificate for 127.0.0.1 (it is its own CA) and its key."""
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=ssdrbm",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return key, cert


def test_tls_and_token_from_options_and_environment(
    service_factory, tmp_path: Path, capsys, monkeypatch
) -> None:
    key, cert = _self_signed_certificate(tmp_path)
    running = service_factory(
        run_worker=False,
        auth_mode="token",
        auth_tokens="s3cret=team-a",
        tls_cert_file=str(cert),
        tls_key_file=str(key),
    )
    target = ["--target", running.target]

    code, _, err = run_cli(capsys, *target, "--wait", "0", "--token", "s3cret", "jobs")  # no TLS
    assert code == ExitCode.UNAVAILABLE and running.target in err

    code, _, err = run_cli(capsys, *target, "--tls-ca", str(cert), "jobs")  # no token
    assert code == ExitCode.UNAUTHENTICATED
    assert ERROR_LINE.match(err.strip()) and "--token or set SSDRBM_TOKEN" in err
    code, _, err = run_cli(capsys, *target, "--tls-ca", str(cert), "--token", "wrong", "jobs")
    assert code == ExitCode.UNAUTHENTICATED

    monkeypatch.setenv("SSDRBM_TLS_CA", str(cert))
    monkeypatch.setenv("SSDRBM_TOKEN", "s3cret")
    code, out, err = run_cli(capsys, *target, "jobs", "--json")
    assert code == ExitCode.OK, err
    assert json.loads(out) == []
    with Client(running.target) as client:  # the SDK reads the same variables
        job = client.start_training(n_hidden=4, steps=10)
        assert client.get_job(job.id).state is JobState.QUEUED
    with Client(running.target, token="wrong") as client, pytest.raises(errors.Unauthenticated):
        client.get_job(job.id)


def test_ctrl_c_while_watching_exits_130_and_leaves_the_job_running(
    service_factory, capsys
) -> None:
    running = service_factory(run_worker=False)  # the job stays queued: watch would never end
    with Client(running.target) as client:
        job = client.start_training(n_hidden=4, steps=10)
    # As from a terminal: a suite started in the background (`cmd &` in a script) runs with
    # SIGINT ignored, and an ignored signal stays ignored across exec, so a fresh interpreter
    # restores it and execs the command. (Not preexec_fn: that runs Python in the forked copy of
    # this process, whose gRPC threads' fork handlers then log to the command's stderr.)
    command = [str(Path(sys.executable).parent / "ssdrbm"), "watch", job.id]
    restore = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); " + (
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", restore, *command],
        env={**os.environ, "SSDRBM_TARGET": running.target},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = process.stderr.readline()  # the replayed "queued" event: it is watching now
        assert first.startswith(f"{job.id} queued"), first
        process.send_signal(signal.SIGINT)
        _, rest = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == ExitCode.INTERRUPTED
    assert rest.strip() == (
        f"ssdrbm: error: interrupted — the job keeps running; stop it with 'ssdrbm cancel {job.id}'"
    )
    with Client(running.target) as client:
        assert client.get_job(job.id).state is JobState.QUEUED

    # Cancelled for real, the job ends, and watching it exits with the cancelled code.
    code = main(["--target", running.target, "cancel", job.id])
    assert code == ExitCode.OK
    assert capsys.readouterr().out == f"{job.id} cancelled\n"
    code = main(["--target", running.target, "watch", job.id])
    assert code == ExitCode.JOB_CANCELLED
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"job {job.id} cancelled at step 0")
