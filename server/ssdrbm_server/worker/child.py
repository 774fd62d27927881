"""The training child process: trains the jobs it is sent, one start message at a time,
reporting over its pipe.

Started with the spawn method (never fork after CUDA, gRPC or Redis are initialised). It has no
Redis connection: everything it produces goes to its worker, which writes it with fencing. It
exits by itself when its worker dies.

One loop (:class:`Training`) trains a job alone or a pack (worker/run_sets.py). Each job is
built (or resumed) exactly as it would be alone and keeps its own evaluation and checkpoint
steps, blow-up recovery and end; a run that ends or is dropped is held while the others go on.
A packed run's evaluations and checkpoints go through its solo Trainer
(ssdcore.pack.run_to_trainer), so its metric events and checkpoints are a solo job's.

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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from google.protobuf import json_format
from ssdrbm.v1 import rbm_pb2

from ssdcore import checkpoint as ssdcheckpoint
from ssdcore.blowup import BlowUp, BlowUpError, Recovery
from ssdcore.models import model_from_config
from ssdcore.training import Trainer
from ssdrbm_server import logs
from ssdrbm_server.config import Settings
from ssdrbm_server.job_spec import check_resolved
from ssdrbm_server.worker import protocol
from ssdrbm_server.worker.datasets import DatasetError, SplitData, Uploaded, prepare
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
from ssdrbm_server.worker.run_sets import PackRuns, RunSet, SoloRun

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.25  # how often the child looks whether its worker is still alive
EXIT_PARENT_GONE = 70
# A job's failure reported as it reads: its data or spec cannot be used (no traceback needed).
USER_ERRORS = (DatasetError, ValueError)


def watch_parent(parent_pid: int) -> None:
    """Exit as soon as the worker is gone (e.g. SIGKILLed)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_PARENT_GONE)
            time.sleep(PARENT_CHECK_S)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def child_main(
    conn: Connection, parent_pid: int, log_level: str = "INFO", log_format: str = "text"
) -> None:
    """Warm up, then train each start message in turn until the worker closes the pipe."""
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
            # A stop or drop that arrives after its jobs have ended is ignored.
            if message.kind in (protocol.START, protocol.START_PACK):
                train(conn, message)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(EXIT_PARENT_GONE)  # the worker went away or is done with us
    finally:
        conn.close()


def warm_up() -> None:
    """Train a throw-away model for one step while no job waits: torch loads much of itself
    lazily (its compiler stack, the CUDA context), which costs seconds a claimed job then saves."""
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


def train(conn: Connection, start: protocol.Message) -> None:
    """Train the jobs of one start message; every failure is reported for each job it
    concerns, never raised. A job alone logs under its id and tenant."""
    alone = start.kind == protocol.START
    with logs.log_context(**(start.fields.get("log_context", {}) if alone else {})):
        try:
            training = Training(conn, start)
        except Exception as exc:  # a start message this process cannot read: every job fails
            logger.exception("training could not start")
            _fail_every_job(conn, start, _reason(exc))
            return
        try:
            training.run()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise
        except Exception as exc:  # report it for every job still training, rather than dying
            if not isinstance(exc, USER_ERRORS):
                logger.exception("training failed")
            training.fail_open(_reason(exc))


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, USER_ERRORS) else f"{type(exc).__name__}: {exc}"


def _fail_every_job(conn: Connection, start: protocol.Message, reason: str) -> None:
    packed = start.kind == protocol.START_PACK
    runs = [{"run": i} for i in range(len(start.fields.get("jobs", [])))] if packed else [{}]
    for run in runs:
        fields = {"reason": reason, "step": 0, "diverged": False, **run}
        with contextlib.suppress(OSError):  # the worker is gone: nobody to tell
            protocol.send(conn, protocol.Message(protocol.FAILED, fields))


@dataclass
class Job:
    """One job of a start message, and what the loop keeps for it."""

    index: int  # its place in the start message: the ``run`` a pack's messages name
    spec: rbm_pb2.StartTrainingRequest
    fields: dict[str, Any]  # its start fields: total_steps, n_visible, recovery_state, ...
    resume: bytes  # the checkpoint it resumes from (trainer state), or empty
    recovery: Recovery  # its blow-up rule, with the backoffs it took before
    last_checkpoint: int = -1
    slot: int = -1  # its run in the run set, once it joined
    open: bool = True

    @property
    def total(self) -> int:
        return int(self.fields["total_steps"])


def jobs_of(start: protocol.Message) -> list[Job]:
    """The jobs of a start message: one (start), or a pack's (start_pack, ``.<i>`` parts)."""
    packed = start.kind == protocol.START_PACK
    job_fields = start.fields["jobs"] if packed else [start.fields]
    jobs = []
    for i, fields in enumerate(job_fields):
        suffix = f".{i}" if packed else ""
        spec = rbm_pb2.StartTrainingRequest.FromString(start.blobs[f"spec{suffix}"])
        label = f"packed run {i}" if packed else ""
        jobs.append(
            Job(
                index=i,
                spec=spec,
                fields=fields,
                resume=start.blobs.get(f"resume{suffix}", b""),
                recovery=job_recovery(spec, int(fields.get("backoffs", 0)), label=label),
            )
        )
    return jobs


class Training:
    """The training loop of one start message: its jobs' data and trainers, trained as a run
    set (a job alone or a pack), each job under its own rules."""

    def __init__(self, conn: Connection, start: protocol.Message) -> None:
        self.conn = conn
        self.packed = start.kind == protocol.START_PACK
        self.jobs = jobs_of(start)
        fields: dict[str, Any] = start.fields
        self.settings = Settings(**fields["settings"])
        self.uploaded = (
            Uploaded(
                fields["dataset_dtype"], tuple(fields["dataset_shape"]), start.blobs["dataset"]
            )
            if "dataset" in start.blobs
            else None
        )
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        self.alive_interval = min(
            ALIVE_MAX_INTERVAL_S, self.settings.child_heartbeat_timeout_seconds / 4
        )
        self.last_sent = time.monotonic()
        self.progress: list[tuple[int, float]] = []  # (steps, seconds) not yet sent
        self.progress_sent = self.last_sent
        self.runs: RunSet | None = None

    def run(self) -> None:
        device = pick_device()
        self._beat(force=True)  # loading the data (a built-in set from disk) may take a while
        # One data tensor serves every job: equal pack keys mean the same dataset,
        # preprocessing and split (ssdrbm_server/packing.py), and the same seed. torch is
        # seeded before the data loads, and each job's model starts from the generator state
        # that follows, as it would alone.
        torch.manual_seed(self.jobs[0].spec.training.seed)
        data = prepare(self.jobs[0].spec, self.settings, self.uploaded)
        seeded_cpu = torch.get_rng_state()
        seeded_cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._beat(force=True)
        trainers: list[Trainer] = []
        for job in self.jobs:
            try:
                torch.set_rng_state(seeded_cpu)  # the model's initial weights
                if seeded_cuda is not None:
                    torch.cuda.set_rng_state(seeded_cuda, device)
                trainers.append(self._trainer(job, data, device))
                job.slot = len(trainers) - 1
            except USER_ERRORS as exc:
                self._fail(job, str(exc), step=0)
            self._beat()
        if not trainers:
            return
        if self.packed:
            valid = None if data.valid is None else data.valid.to(device)
            self.runs = PackRuns(trainers, valid)
        else:
            self.runs = SoloRun(trainers[0])
        for job in self._open():
            self._start(job, trainers[job.slot], device, len(trainers))
        self._loop()

    def _trainer(self, job: Job, data: SplitData, device: torch.device) -> Trainer:
        check_resolved(job.spec)
        n_visible = int(job.fields.get("n_visible", 0))  # as resolved when it was accepted
        if n_visible and data.n_visible != n_visible:
            raise DatasetError(
                f"the dataset now has {data.n_visible} visible units, but the job was accepted "
                f"for {n_visible}; its data changed on this server since — submit it again"
            )
        trainer = build_trainer(job.spec, data, device)
        if job.resume:
            ssdcheckpoint.load_trainer_state(trainer, job.resume)
            job.last_checkpoint = trainer.step_count
        trainer.set_lr_scale(job.recovery.lr_scale)
        return trainer

    def _start(self, job: Job, built: Trainer, device: torch.device, size: int) -> None:
        """The evaluation before training (job_training.check_start), then the job's STARTED."""
        values = self._evaluate(job, self.runs.trainer(job.slot), with_ais=False)
        blowup = check_start(
            job.recovery,
            values,
            self.runs.recoverable(job.slot),
            resumed=bool(job.resume),
            recovery_state=job.fields.get("recovery_state", ""),
        )
        described = self._runtime(job, built, device, size)
        self._send(job, protocol.STARTED, start_step=self._step(job), runtime=described)
        if blowup is not None:
            self._recover(job, blowup)

    def _runtime(self, job: Job, trainer: Trainer, device: torch.device, size: int) -> str:
        """The job's Runtime as JSON; a packed run's summary adds "packed with N runs"."""
        weight_group = next(g for g in trainer.optimizer.param_groups if g["name"] == "W")
        spectral = weight_group.get("geometry") == "spectral"
        described = runtime(
            job.spec.optimizer,
            device=str(device),
            weight_method=weight_group["method"] if spectral else None,
            cuda_graph=self.runs.cuda_graph,
        )
        if self.packed:
            described.summary += f", {packed_summary(size)}"
        return json.dumps(json_format.MessageToDict(described, preserving_proto_field_name=True))

    def _step(self, job: Job) -> int:
        return self.runs.step(job.slot)

    def _open(self) -> list[Job]:
        return [job for job in self.jobs if job.open]

    def _loop(self) -> None:
        for job in self._open():
            if self._step(job) >= job.total:  # resumed from its last checkpoint: done
                self._end(job, protocol.FINISHED, step=self._step(job))
        while self._open():
            if self._requests():
                return
            running = self._open()
            if not running:
                return
            chunk = min(
                min(_boundary(job, self._step(job)) - self._step(job) for job in running),
                MAX_STEPS_BETWEEN_POLLS,
            )
            self._beat()
            started = time.perf_counter()
            blowups = self.runs.train_steps(chunk)
            self._trained(chunk, time.perf_counter() - started)
            for job in running:
                if not job.open:
                    continue
                blowup = blowups.get(job.slot)
                if blowup is not None:
                    self._recover(job, blowup)
                else:
                    self._after_steps(job)

    def _after_steps(self, job: Job) -> None:
        """Evaluate, publish, checkpoint, end: as the job's step asks."""
        step, spec = self._step(job), job.spec
        at_checkpoint = step % spec.training.checkpoint_every == 0 or step == job.total
        # A checkpoint is taken only of a model that passed the blow-up check, so every
        # checkpoint step is also an evaluation step.
        values = None
        if step % spec.eval.every == 0 or at_checkpoint:
            trainer = self.runs.trainer(job.slot)
            values = self._evaluate(job, trainer, with_ais=at_checkpoint and spec.eval.ais)
            blowup = job.recovery.check(values, self.runs.recoverable(job.slot))
            if blowup is not None:
                self._recover(job, blowup)
                return
            # wall_time_s and samples_per_second come from the trainer: its training time is
            # part of its state, so they continue across a resume.
            metrics = metrics_message(values, step=step, total=job.total)
            self._send(
                job, protocol.METRICS, blobs={"metrics": metrics.SerializeToString()}, step=step
            )
            if at_checkpoint:
                self._checkpoint(job, trainer)
        if step >= job.total:
            note = job.recovery.drift(values) if values is not None else None
            self._end(job, protocol.FINISHED, step=step, note=note)

    def _evaluate(self, job: Job, trainer: Trainer, *, with_ais: bool) -> dict[str, Any]:
        # An AIS estimate may run for minutes without a chance to beat: it starts with the
        # whole deadline, which SSDRBM_CHILD_HEARTBEAT_TIMEOUT_SECONDS is sized for.
        self._beat(force=with_ais)
        values = evaluate_job(trainer, job.spec, with_ais=with_ais)
        self._beat()
        return values

    def _recover(self, job: Job, blowup: BlowUp) -> None:
        """Roll the job back and go on with smaller steps, or fail it once its backoffs are
        spent: ssdcore.blowup's rule, for this run alone."""
        try:
            event = job.recovery.recover(blowup, self.runs.recoverable(job.slot))
        except BlowUpError as error:
            reason = failure_reason(error, job.last_checkpoint)
            self._fail(job, reason, step=blowup.step, diverged=True)
            return
        if rollback_needs_checkpoint(event, job.last_checkpoint):
            self._checkpoint(job)
        self._send(
            job,
            protocol.BACKOFF,
            blobs={"backoff": backoff_message(event).SerializeToString()},
            rollback_step=event.rolled_back_to,
        )

    def _checkpoint(self, job: Job, trainer: Trainer | None = None) -> None:
        step = self._step(job)
        if step == job.last_checkpoint:
            return
        self._beat()
        blobs, fields = checkpoint_parts(trainer or self.runs.trainer(job.slot), job.recovery)
        self._send(job, protocol.CHECKPOINT, blobs=blobs, step=step, **fields)
        job.last_checkpoint = step

    def _requests(self) -> bool:
        """Read what the worker sent: a stop (every job checkpoints and stops: True), or a stop
        or drop of one run. Nothing is read once every run has left: what follows in the pipe
        (the worker's next start) is the main loop's."""
        while self._open() and self.conn.poll():
            message = protocol.receive(self.conn)
            if message.kind == protocol.STOP:
                for job in self._open():
                    self._stop(job)
                return True
            if message.kind not in (protocol.STOP_RUN, protocol.DROP):
                continue
            job = self.jobs[int(message.fields["run"])]
            if job.open and message.kind == protocol.STOP_RUN:
                self._stop(job)
            elif job.open:
                logger.info("packed run %d leaves the pack", job.index)
                self._close(job)
        return False

    def _stop(self, job: Job) -> None:
        self._checkpoint(job)
        self._end(job, protocol.STOPPED, step=self._step(job))

    def _close(self, job: Job) -> None:
        job.open = False
        if self.runs is not None and job.slot >= 0:
            self.runs.hold(job.slot)  # it stands still from now on; the others go on

    def _end(self, job: Job, kind: str, **fields: Any) -> None:
        self._send(job, kind, **fields)
        self._close(job)

    def _fail(self, job: Job, reason: str, *, step: int, diverged: bool = False) -> None:
        self._end(job, protocol.FAILED, reason=reason, step=step, diverged=diverged)

    def fail_open(self, reason: str) -> None:
        for job in self._open():
            with contextlib.suppress(OSError):  # the worker is gone: nobody to tell
                step = self._step(job) if job.slot >= 0 and self.runs is not None else 0
                self._fail(job, reason, step=step)

    def _trained(self, steps: int, seconds: float) -> None:
        """Note a run of steps for the worker's metrics (sent with the next message, or alone
        after PROGRESS_INTERVAL_S)."""
        self.progress.append((steps, seconds))
        if time.monotonic() - self.progress_sent >= protocol.PROGRESS_INTERVAL_S:
            self._send_progress()

    def _send_progress(self) -> None:
        runs, self.progress = self.progress, []
        self.progress_sent = time.monotonic()
        protocol.send(self.conn, protocol.Message(protocol.PROGRESS, {"runs": runs}))
        self.last_sent = self.progress_sent

    def _send(
        self, job: Job | None, kind: str, *, blobs: dict[str, bytes] | None = None, **fields: Any
    ) -> None:
        """A message about ``job`` (a pack's name its run), or the process's (None)."""
        if self.progress:  # the worker counts the steps before it hears of what followed them
            self._send_progress()
        if job is not None and self.packed:
            fields["run"] = job.index
        protocol.send(self.conn, protocol.Message(kind, fields, blobs or {}))
        self.last_sent = time.monotonic()  # any message tells the worker this process lives

    def _beat(self, *, force: bool = False) -> None:
        """Send a heartbeat when nothing was sent for a while (or now, before a long phase)."""
        if force or time.monotonic() - self.last_sent >= self.alive_interval:
            self._send(None, protocol.ALIVE)


def packed_summary(size: int) -> str:
    """The end of a packed job's Runtime summary."""
    return f"packed with {size} runs"


def _boundary(job: Job, step: int) -> int:
    """The job's next evaluation, checkpoint or last step after ``step``."""
    every, checkpoint_every = job.spec.eval.every, job.spec.training.checkpoint_every
    return min(
        (step // every + 1) * every, (step // checkpoint_every + 1) * checkpoint_every, job.total
    )
