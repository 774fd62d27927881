"""The training child process: trains jobs with ssdcore, one at a time, reporting over its pipe.

Started with the spawn method (never fork after CUDA, gRPC or Redis are initialised). It has no
Redis connection: everything it produces (metrics, checkpoints, the outcome) goes to its worker,
which writes it with fencing. It exits by itself when its worker dies.
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
from pathlib import Path
from typing import Any

import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore import checkpoint as ssdcheckpoint
from ssdcore.errors import DivergenceError
from ssdcore.models import model_from_config
from ssdcore.training import Trainer
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.datasets import DatasetError, Uploaded, prepare
from ssdrbm_server.worker.spec import PlanDefaults, TrainingPlan, plan_from_request

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.25  # how often the child looks whether its worker is still alive
MAX_STEPS_BETWEEN_POLLS = 10  # train at most this many steps before looking for a stop request
EXACT_LL_MAX_HIDDEN = 16  # 2^16 hidden states: exact log Z is cheap enough for every event
EXIT_PARENT_GONE = 70


def watch_parent(parent_pid: int) -> None:
    """Exit the process as soon as its parent (the worker) is gone, e.g. killed by SIGKILL."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_PARENT_GONE)
            time.sleep(PARENT_CHECK_S)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def child_main(conn: Connection, parent_pid: int, log_level: str = "INFO") -> None:
    """Entry point of the spawned process: warm up, then train each job it is sent, in turn,
    until the worker closes the pipe (or dies)."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s[child] %(message)s")
    # Ctrl-C or a SIGTERM sent to the whole process group is for the worker: it decides when
    # this process checkpoints and stops. Parent death is caught by watch_parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pid)
    warm_up()
    try:
        while True:
            message = protocol.receive(conn)
            if message.kind == protocol.START:  # a stop that arrives after its job is ignored
                train_one(conn, message)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(EXIT_PARENT_GONE)  # the worker went away or is done with us
    finally:
        conn.close()


def train_one(conn: Connection, start: protocol.Message) -> None:
    """Train one job; every failure is reported to the worker, never raised."""
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


def pick_device() -> torch.device:
    """CUDA when present, CPU otherwise."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Training:
    """One job's training loop in the child."""

    def __init__(self, conn: Connection, start: protocol.Message) -> None:
        if start.kind != protocol.START:
            raise ValueError(f"expected a start message, got {start.kind!r}")
        self.conn = conn
        fields: dict[str, Any] = start.fields
        self.request = rbm_pb2.StartTrainingRequest.FromString(start.blobs["spec"])
        self.plan: TrainingPlan = plan_from_request(
            self.request, PlanDefaults(**fields["defaults"])
        )
        self.data_dir = Path(fields["data_dir"])
        self.uploaded = (
            Uploaded(
                fields["dataset_dtype"], tuple(fields["dataset_shape"]), start.blobs["dataset"]
            )
            if "dataset" in start.blobs
            else None
        )
        self.resume = start.blobs.get("resume", b"")
        if fields.get("torch_threads"):
            torch.set_num_threads(int(fields["torch_threads"]))
        self.last_checkpoint = -1

    def run(self) -> None:
        torch.manual_seed(self.plan.seed)
        device = pick_device()
        data = prepare(
            self.request.dataset,
            model_kind=self.plan.model_kind,
            data_dir=self.data_dir,
            uploaded=self.uploaded,
            validation_fraction=self.plan.validation_fraction,
            seed=self.plan.seed,
        )
        self.model = model_from_config(self.plan.model_config(data.n_visible), device=device)
        self.trainer = Trainer(
            self.model,
            data.train.to(device),
            optimizer=self.plan.optimizer,
            batch_size=self.plan.batch_size,
            cd_k=self.plan.cd_k,
            persistent=self.plan.persistent,
            seed=self.plan.seed,
            valid_data=None if data.valid is None else data.valid.to(device),
        )
        if self.resume:
            ssdcheckpoint.load_trainer_state(self.trainer, self.resume)
            self.last_checkpoint = self.trainer.step_count
        total = self.plan.total_steps(int(data.train.shape[0]))
        self.total = total
        self._send(
            protocol.STARTED,
            n_visible=data.n_visible,
            total_steps=total,
            start_step=self.trainer.step_count,
            device=str(device),
        )
        try:
            self._loop()
        except DivergenceError as exc:
            self._diverged(exc)

    def _diverged(self, exc: Exception) -> None:
        step = self.trainer.step_count
        kept = (
            f"the last good checkpoint (step {self.last_checkpoint}) is kept"
            if self.last_checkpoint >= 0
            else "no checkpoint was written before it"
        )
        hint = "" if isinstance(exc, DivergenceError) else " Lower optimizer.lr."
        reason = f"training diverged at step {step}: {exc} ({kept}).{hint}"
        _report_failure(self.conn, reason, step=step, diverged=True)

    def _loop(self) -> None:
        plan = self.plan
        while self.trainer.step_count < self.total:
            if self._stop_requested():
                self._checkpoint()
                self._send(protocol.STOPPED, step=self.trainer.step_count)
                return
            step = self.trainer.step_count
            boundary = min(
                _next_multiple(step, plan.eval_every),
                _next_multiple(step, plan.checkpoint_every),
                self.total,
            )
            n = min(boundary - step, MAX_STEPS_BETWEEN_POLLS)
            self.trainer.train_steps(n)
            step = self.trainer.step_count
            at_checkpoint = step % plan.checkpoint_every == 0 or step == self.total
            if step % plan.eval_every == 0 or step == self.total:
                self._metrics(with_ais=at_checkpoint and plan.ais)
            if at_checkpoint:
                self._checkpoint()
        self._send(protocol.FINISHED, step=self.trainer.step_count)

    def _stop_requested(self) -> bool:
        if not self.conn.poll():
            return False
        message = protocol.receive(self.conn)
        return message.kind == protocol.STOP

    def _metrics(self, *, with_ais: bool) -> None:
        if with_ais:
            method = "ais"
        elif self.plan.n_hidden <= EXACT_LL_MAX_HIDDEN:
            method = "exact"
        else:
            method = "none"
        values = self.trainer.evaluate(
            log_likelihood=method, ais_chains=self.plan.ais_chains, ais_betas=self.plan.ais_betas
        )
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
        self._send(
            protocol.CHECKPOINT,
            blobs={
                "model": ssdcheckpoint.model_to_bytes(self.model),
                "trainer": ssdcheckpoint.trainer_to_bytes(self.trainer),
            },
            step=step,
            config_json=json.dumps(self.model.config(), sort_keys=True),
        )
        self.last_checkpoint = step

    def _send(self, kind: str, *, blobs: dict[str, bytes] | None = None, **fields: Any) -> None:
        protocol.send(self.conn, protocol.Message(kind, fields, blobs or {}))


def _next_multiple(step: int, every: int) -> int:
    return (step // every + 1) * every


_LL_METHODS = {
    "exact": rbm_pb2.LOG_LIKELIHOOD_METHOD_EXACT,
    "ais": rbm_pb2.LOG_LIKELIHOOD_METHOD_AIS,
}


def metrics_message(values: dict[str, Any], *, step: int, total: int) -> rbm_pb2.Metrics:
    """A Metrics message from Trainer.evaluate()'s dict (keys named as the proto's fields)."""
    metrics = rbm_pb2.Metrics(step=step, total_steps=total)
    for name, value in values.items():
        if value is None or name in ("step", "total_steps"):
            continue
        if name == "log_likelihood_method":
            metrics.log_likelihood_method = _LL_METHODS.get(str(value).lower(), 0)
        elif name in rbm_pb2.Metrics.DESCRIPTOR.fields_by_name:
            setattr(metrics, name, float(value))
    return metrics
