"""The training child process: trains jobs with ssdcore, one at a time, reporting over its pipe.

Started with the spawn method (never fork after CUDA, gRPC or Redis are initialised). It has no
Redis connection: everything it produces (metrics, checkpoints, the outcome) goes to its worker,
which writes it with fencing. It exits by itself when its worker dies.

Liveness: the child sends an `alive` heartbeat once warm and then from the training loop itself
(between step chunks, and before and after each evaluation and checkpoint), never from a thread:
a thread would keep beating while the training it vouches for is stuck in a torch call. A child
silent for SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS is taken for hung by its worker and killed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
from google.protobuf import json_format
from ssdrbm.v1 import rbm_pb2

from ssdcore import checkpoint as ssdcheckpoint
from ssdcore.blowup import BlowUp, BlowUpError, blowup_from_error
from ssdcore.errors import DivergenceError
from ssdcore.models import model_from_config
from ssdcore.training import Trainer
from ssdrbm_server import logs
from ssdrbm_server.config import Settings
from ssdrbm_server.job_spec import check_resolved
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.datasets import DatasetError, Uploaded, prepare
from ssdrbm_server.worker.job_training import (
    ALIVE_MAX_INTERVAL_S,
    MAX_STEPS_BETWEEN_POLLS,
    backoff_message,
    build_trainer,
    check_start,
    checkpoint_parts,
    evaluate_job,
    failure_reason,
    job_recovery,
    metrics_message,
    pick_device,
    rollback_needs_checkpoint,
    runtime,
)
from ssdrbm_server.worker.pack_child import train_pack

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.25  # how often the child looks whether its worker is still alive
EXIT_PARENT_GONE = 70


def watch_parent(parent_pid: int) -> None:
    """Exit the process as soon as its parent (the worker) is gone, e.g. killed by SIGKILL."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_PARENT_GONE)
            time.sleep(PARENT_CHECK_S)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def child_main(
    conn: Connection, parent_pid: int, log_level: str = "INFO", log_format: str = "text"
) -> None:
    """Entry point of the spawned process: warm up, then train each job it is sent, in turn,
    until the worker closes the pipe (or dies)."""
    logs.configure(log_level, log_format, text_format="%(asctime)s %(name)s[child] %(message)s")
    # Ctrl-C or a SIGTERM sent to the whole process group is for the worker: it decides when
    # this process checkpoints and stops. Parent death is caught by watch_parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pid)
    warm_up()
    try:
        protocol.send(conn, protocol.Message(protocol.ALIVE))  # warm: ready for a job
        while True:
            message = protocol.receive(conn)
            if message.kind == protocol.START:  # a stop that arrives after its job is ignored
                train_one(conn, message)
            elif message.kind == protocol.START_PACK:  # a drop after its pack is ignored too
                train_pack(conn, message)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(EXIT_PARENT_GONE)  # the worker went away or is done with us
    finally:
        conn.close()


def train_one(conn: Connection, start: protocol.Message) -> None:
    """Train one job; every failure is reported to the worker, never raised."""
    with logs.log_context(**start.fields.get("log_context", {})):
        _train(conn, start)


def _train(conn: Connection, start: protocol.Message) -> None:
    try:
        Training(conn, start).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        raise
    except (DatasetError, ValueError) as exc:
        _report_failure(conn, str(exc), step=0)
    except Exception as exc:  # report anything else too, rather than dying silently
        logger.exception("training failed")
        _report_failure(conn, f"{type(exc).__name__}: {exc}", step=0)


def warm_up() -> None:
    """Train a throw-away model for one step while no job is waiting.

    torch loads much of itself lazily on first use (its compiler stack on the first optimizer,
    the CUDA context), which costs seconds; paying that before the start message arrives lets
    a job begin training as soon as it is claimed.
    """
    try:
        device = pick_device()  # on a GPU this also creates the CUDA context ahead of time
        model = model_from_config(
            {"type": "bernoulli", "n_visible": 4, "n_hidden": 2}, device=device
        )
        trainer = Trainer(model, torch.rand(8, 4, device=device).round(), batch_size=4)
        trainer.train_steps(1)
        trainer.evaluate("exact")
    except Exception:  # only an optimisation: the job itself will report real problems
        logger.exception("warm-up failed")


def _report_failure(conn: Connection, reason: str, *, step: int, diverged: bool = False) -> None:
    message = protocol.Message(
        protocol.FAILED, {"reason": reason, "step": step, "diverged": diverged}
    )
    with contextlib.suppress(OSError):  # the worker is gone: nobody to tell
        protocol.send(conn, message)


class Training:
    """One job's training loop in the child: its spec, data, trainer and blow-up recovery."""

    def __init__(self, conn: Connection, start: protocol.Message) -> None:
        if start.kind != protocol.START:
            raise ValueError(f"expected a start message, got {start.kind!r}")
        self.conn = conn
        fields: dict[str, Any] = start.fields
        self.spec = rbm_pb2.StartTrainingRequest.FromString(start.blobs["spec"])
        check_resolved(self.spec)
        self.settings = Settings(**fields["settings"])
        self.recovery = job_recovery(self.spec, int(fields.get("backoffs", 0)))
        self.uploaded = (
            Uploaded(
                fields["dataset_dtype"], tuple(fields["dataset_shape"]), start.blobs["dataset"]
            )
            if "dataset" in start.blobs
            else None
        )
        self.resume = start.blobs.get("resume", b"")
        self.recovery_state: str = fields.get("recovery_state", "")  # kept with the checkpoint
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        self.total = int(fields["total_steps"])
        self.n_visible = int(fields.get("n_visible", 0))  # as resolved when the job was accepted
        self.last_checkpoint = -1
        self.alive_interval = min(
            ALIVE_MAX_INTERVAL_S, self.settings.child_heartbeat_timeout_seconds / 4
        )
        self.last_sent = time.monotonic()
        self.runs: list[tuple[int, float]] = []  # (steps, seconds) not yet sent to the worker
        self.progress_sent = self.last_sent

    def run(self) -> None:
        spec = self.spec
        torch.manual_seed(spec.training.seed)
        device = pick_device()
        self._beat(force=True)  # loading the data (a built-in set from disk) may take a while
        data = prepare(spec, self.settings, self.uploaded)
        self._beat(force=True)
        if self.n_visible and data.n_visible != self.n_visible:
            raise DatasetError(
                f"the dataset now has {data.n_visible} visible units, but the job was accepted "
                f"for {self.n_visible}; its data changed on this server since — submit it again"
            )
        self.trainer = build_trainer(spec, data, device)
        self.model = self.trainer.model
        if self.resume:
            ssdcheckpoint.load_trainer_state(self.trainer, self.resume)
            self.last_checkpoint = self.trainer.step_count
        self.trainer.set_lr_scale(self.recovery.lr_scale)
        # The evaluation before training: the detector's baseline (or, resumed, the references
        # its checkpoint kept) and the first rollback point.
        blowup = check_start(
            self.recovery,
            self._evaluate(with_ais=False),
            self.trainer,
            resumed=bool(self.resume),
            recovery_state=self.recovery_state,
        )
        self._send(
            protocol.STARTED,
            start_step=self.trainer.step_count,
            runtime=json.dumps(self._runtime(device)),
        )
        if blowup is None or self._recover(blowup):
            self._loop()

    def _runtime(self, device: torch.device) -> dict[str, Any]:
        weight_group = next(g for g in self.trainer.optimizer.param_groups if g["name"] == "W")
        spectral = weight_group.get("geometry") == "spectral"
        described = runtime(
            self.spec.optimizer,
            device=str(device),
            weight_method=weight_group["method"] if spectral else None,
            cuda_graph=bool(self.trainer.cuda_graph),
        )
        return json_format.MessageToDict(described, preserving_proto_field_name=True)

    def _loop(self) -> None:
        every = self.spec.eval.every
        checkpoint_every = self.spec.training.checkpoint_every
        while self.trainer.step_count < self.total:
            if self._stop_requested():
                self._checkpoint()
                self._send(protocol.STOPPED, step=self.trainer.step_count)
                return
            step = self.trainer.step_count
            boundary = min(
                _next_multiple(step, every), _next_multiple(step, checkpoint_every), self.total
            )
            self._beat()
            started = time.perf_counter()
            try:
                self.trainer.train_steps(min(boundary - step, MAX_STEPS_BETWEEN_POLLS))
                self._trained(self.trainer.step_count - step, time.perf_counter() - started)
            except DivergenceError as exc:
                if not self._recover(blowup_from_error(exc, self.trainer.step_count)):
                    return
                continue
            step = self.trainer.step_count
            at_checkpoint = step % checkpoint_every == 0 or step == self.total
            # A checkpoint is taken only of a model that passed the blow-up check, so every
            # checkpoint step is also an evaluation step.
            if step % every == 0 or at_checkpoint:
                values = self._evaluate(with_ais=at_checkpoint and self.spec.eval.ais)
                blowup = self.recovery.check(values, self.trainer)
                if blowup is not None:
                    if not self._recover(blowup):
                        return
                    continue
                self._publish(values)
            if at_checkpoint:
                self._checkpoint()
        self._send(protocol.FINISHED, step=self.trainer.step_count)

    def _recover(self, blowup: BlowUp) -> bool:
        """Roll back to the last healthy evaluation and continue with smaller steps (True), or
        fail the job once its backoffs are spent (False): ssdcore.blowup's rule."""
        try:
            event = self.recovery.recover(blowup, self.trainer)
        except BlowUpError as error:
            if self.runs:
                self._send_progress()
            reason = failure_reason(error, self.last_checkpoint)
            _report_failure(self.conn, reason, step=blowup.step, diverged=True)
            return False
        if rollback_needs_checkpoint(event, self.last_checkpoint):
            self._checkpoint()
        self._send(
            protocol.BACKOFF,
            blobs={"backoff": backoff_message(event).SerializeToString()},
            rollback_step=event.rolled_back_to,
        )
        return True

    def _stop_requested(self) -> bool:
        if not self.conn.poll():
            return False
        message = protocol.receive(self.conn)
        return message.kind == protocol.STOP

    def _evaluate(self, *, with_ais: bool) -> dict[str, Any]:
        # An AIS estimate may run for minutes without a chance to beat: it starts with the
        # whole deadline, which SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS is sized for.
        self._beat(force=with_ais)
        values = self._evaluate_now(with_ais=with_ais)
        self._beat()
        return values

    def _evaluate_now(self, *, with_ais: bool) -> dict[str, Any]:
        return evaluate_job(self.trainer, self.spec, with_ais=with_ais)

    def _publish(self, values: dict[str, Any]) -> None:
        # wall_time_s and samples_per_second come from the trainer: its training time is part
        # of its state, so they continue across a resume.
        metrics = metrics_message(values, step=self.trainer.step_count, total=self.total)
        self._send(
            protocol.METRICS,
            blobs={"metrics": metrics.SerializeToString()},
            step=self.trainer.step_count,
        )

    def _checkpoint(self) -> None:
        step = self.trainer.step_count
        if step == self.last_checkpoint:
            return
        self._beat()
        blobs, fields = checkpoint_parts(self.trainer, self.recovery)
        self._send(protocol.CHECKPOINT, blobs=blobs, step=step, **fields)
        self.last_checkpoint = step

    def _trained(self, steps: int, seconds: float) -> None:
        """Note a run of steps for the worker's metrics; sent with the next message, or on
        its own once PROGRESS_INTERVAL_S has passed."""
        self.runs.append((steps, seconds))
        if time.monotonic() - self.progress_sent >= protocol.PROGRESS_INTERVAL_S:
            self._send_progress()

    def _send_progress(self) -> None:
        runs, self.runs = self.runs, []
        self.progress_sent = time.monotonic()
        protocol.send(self.conn, protocol.Message(protocol.PROGRESS, {"runs": runs}))
        self.last_sent = self.progress_sent

    def _send(self, kind: str, *, blobs: dict[str, bytes] | None = None, **fields: Any) -> None:
        if self.runs:  # the worker counts the steps before it hears of what followed them
            self._send_progress()
        protocol.send(self.conn, protocol.Message(kind, fields, blobs or {}))
        self.last_sent = time.monotonic()  # any message tells the worker this process lives

    def _beat(self, *, force: bool = False) -> None:
        """Send a heartbeat when nothing was sent for a while (or now, before a long phase)."""
        if force or time.monotonic() - self.last_sent >= self.alive_interval:
            self._send(protocol.ALIVE)


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every
