"""The training process's side of a pack: several jobs trained as one ssdcore TrainingPack.

Each job is built (or resumed from its checkpoint) as a solo Trainer exactly as
:class:`~ssdrbm_server.worker.child.Training` builds it, and the Trainers are packed
(:func:`ssdcore.pack.pack_trainers`), so each run continues its solo trajectory (bit for bit on
the CPU, docs/ARCHITECTURE.md "Packed training"). From there every job keeps the solo loop's
rules on its own: its own evaluation and checkpoint steps, blow-up recovery (ssdcore.blowup's
rule: detector, backoff budget, rollback point at its last healthy evaluation), and messages
that carry its index (``run``) so the worker writes each with that job's fencing token. A run
that finishes, fails or is dropped by the worker (cancelled, lease lost) is held in its slot —
it stops moving, the others go on. Its evaluations and checkpoints go through the run's solo
Trainer (:func:`ssdcore.pack.run_to_trainer`), so metric events and checkpoints are the solo
job's, to the byte layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from google.protobuf import json_format
from ssdrbm.v1 import rbm_pb2

from ssdcore import checkpoint as ssdcheckpoint
from ssdcore.blowup import BlowUp, BlowUpError, Recovery
from ssdcore.pack import (
    RunInPack,
    TrainingPack,
    divergence_blowup,
    pack_trainers,
    run_to_trainer,
)
from ssdcore.training import Trainer
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

logger = logging.getLogger(__name__)


@dataclass
class PackedJob:
    """One job of the pack, and what the solo loop keeps for its job."""

    index: int  # its place in the start message: the ``run`` of its messages
    spec: rbm_pb2.StartTrainingRequest
    total: int
    recovery: Recovery  # its blow-up rule, with the backoffs it took before
    last_checkpoint: int = -1
    slot: int = -1  # its slot in the TrainingPack
    open: bool = True


def train_pack(conn: Connection, start: protocol.Message) -> None:
    """Train one pack; every failure is reported to the worker for each job, never raised."""
    try:
        training = PackTraining(conn, start)
    except Exception as exc:  # a start message this process cannot read: every job fails
        logger.exception("packed training could not start")
        for run in range(len(start.fields.get("jobs", []))):
            message = protocol.Message(
                protocol.FAILED,
                {"run": run, "reason": f"{type(exc).__name__}: {exc}", "step": 0},
            )
            with contextlib.suppress(OSError):
                protocol.send(conn, message)
        return
    try:
        training.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        raise
    except Exception as exc:  # report it for every job still training, rather than dying
        logger.exception("packed training failed")
        training.fail_open(f"{type(exc).__name__}: {exc}")


class PackTraining:
    """The packed loop in the child: the jobs' data, their trainers packed, per-job rules."""

    def __init__(self, conn: Connection, start: protocol.Message) -> None:
        if start.kind != protocol.START_PACK:
            raise ValueError(f"expected a start_pack message, got {start.kind!r}")
        self.conn = conn
        fields: dict[str, Any] = start.fields
        self.settings = Settings(**fields["settings"])
        self.uploaded = (
            Uploaded(
                fields["dataset_dtype"], tuple(fields["dataset_shape"]), start.blobs["dataset"]
            )
            if "dataset" in start.blobs
            else None
        )
        self.job_fields: list[dict[str, Any]] = fields["jobs"]
        specs = [
            rbm_pb2.StartTrainingRequest.FromString(start.blobs[f"spec.{i}"])
            for i in range(len(self.job_fields))
        ]
        self.jobs = [
            PackedJob(
                index=i,
                spec=spec,
                total=int(job["total_steps"]),
                recovery=job_recovery(spec, int(job.get("backoffs", 0)), label=f"packed run {i}"),
            )
            for i, (spec, job) in enumerate(zip(specs, self.job_fields, strict=True))
        ]
        self.resumes = [start.blobs.get(f"resume.{i}", b"") for i in range(len(self.jobs))]
        if self.settings.torch_threads:
            torch.set_num_threads(self.settings.torch_threads)
        self.alive_interval = min(
            ALIVE_MAX_INTERVAL_S, self.settings.child_heartbeat_timeout_seconds / 4
        )
        self.last_sent = time.monotonic()
        self.progress: list[tuple[int, float]] = []
        self.progress_sent = self.last_sent
        self.pack: TrainingPack | None = None
        self.valid: torch.Tensor | None = None

    # --- start ----------------------------------------------------------------------------

    def run(self) -> None:
        device = pick_device()
        self._beat(force=True)
        # One data tensor serves every job: equal pack keys mean the same dataset,
        # preprocessing and split (ssdrbm_server/packing.py), and the same seed. The solo
        # process seeds torch before loading the data and builds its model after; each job's
        # model starts from that same generator state here.
        torch.manual_seed(self.jobs[0].spec.training.seed)
        data = prepare(self.jobs[0].spec, self.settings, self.uploaded)
        self.seeded = _generator_states(device)
        self._beat(force=True)
        self.valid = None if data.valid is None else data.valid.to(device)
        trainers: list[Trainer] = []
        joined: list[PackedJob] = []
        for job in self.jobs:
            try:
                trainers.append(self._trainer(job, data, device))
                joined.append(job)
            except (DatasetError, ValueError) as exc:
                self._fail(job, str(exc), step=0)
            self._beat()
        if not joined:
            return
        self.pack = pack_trainers(trainers)
        for slot, job in enumerate(joined):
            job.slot = slot
            # The evaluation before training: the baseline (or, resumed, the references its
            # checkpoint kept) and the first rollback point.
            trainer = run_to_trainer(self.pack, slot, valid_data=self.valid)
            values = evaluate_job(trainer, job.spec, with_ais=False)
            blowup = check_start(
                job.recovery,
                values,
                RunInPack(self.pack, slot),
                resumed=bool(self.resumes[job.index]),
                recovery_state=self.job_fields[job.index].get("recovery_state", ""),
            )
            described = self._runtime(job, trainers[slot], device, len(joined))
            self._send(job, protocol.STARTED, start_step=self._step(job), runtime=described)
            if blowup is not None:
                self._recover(job, blowup)
        self._loop()

    def _trainer(self, job: PackedJob, data: SplitData, device: torch.device) -> Trainer:
        """The job's Trainer as its solo training process would build or resume it."""
        spec = job.spec
        check_resolved(spec)
        n_visible = int(self.job_fields[job.index].get("n_visible", 0))
        if n_visible and data.n_visible != n_visible:
            raise DatasetError(
                f"the dataset now has {data.n_visible} visible units, but the job was accepted "
                f"for {n_visible}; its data changed on this server since — submit it again"
            )
        _set_generator_states(device, self.seeded)  # the model's initial weights, as solo
        trainer = build_trainer(spec, data, device)
        resume = self.resumes[job.index]
        if resume:
            ssdcheckpoint.load_trainer_state(trainer, resume)
            job.last_checkpoint = trainer.step_count
        trainer.set_lr_scale(job.recovery.lr_scale)
        return trainer

    def _runtime(self, job: PackedJob, trainer: Trainer, device: torch.device, size: int) -> str:
        """The job's Runtime as JSON, the solo one's with "packed with N runs" in its summary."""
        weight_group = next(g for g in trainer.optimizer.param_groups if g["name"] == "W")
        spectral = weight_group.get("geometry") == "spectral"
        assert self.pack is not None
        described = runtime(
            job.spec.optimizer,
            device=str(device),
            weight_method=weight_group["method"] if spectral else None,
            cuda_graph=bool(self.pack.cuda_graph),
        )
        described.summary += f", {packed_summary(size)}"
        return json.dumps(json_format.MessageToDict(described, preserving_proto_field_name=True))

    # --- the loop -------------------------------------------------------------------------

    def _step(self, job: PackedJob) -> int:
        assert self.pack is not None
        return self.pack.step_counts[job.slot]

    def _open(self) -> list[PackedJob]:
        return [job for job in self.jobs if job.open]

    def _loop(self) -> None:
        assert self.pack is not None
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
            diverged = {event.run: event for event in self.pack.train_steps(chunk)}
            self._trained(chunk, time.perf_counter() - started)
            for job in running:
                if not job.open:
                    continue
                event = diverged.get(job.slot)
                if event is not None:
                    self._recover(job, divergence_blowup(event))
                else:
                    self._after_steps(job)

    def _after_steps(self, job: PackedJob) -> None:
        """The solo loop's work after a chunk, for one job: evaluate, publish, checkpoint, end."""
        assert self.pack is not None
        step, spec = self._step(job), job.spec
        at_checkpoint = step % spec.training.checkpoint_every == 0 or step == job.total
        if step % spec.eval.every == 0 or at_checkpoint:
            trainer = run_to_trainer(self.pack, job.slot, valid_data=self.valid)
            with_ais = at_checkpoint and spec.eval.ais
            self._beat(force=with_ais)
            values = evaluate_job(trainer, spec, with_ais=with_ais)
            self._beat()
            blowup = job.recovery.check(values, RunInPack(self.pack, job.slot))
            if blowup is not None:
                self._recover(job, blowup)
                return
            metrics = metrics_message(values, step=step, total=job.total)
            self._send(
                job, protocol.METRICS, blobs={"metrics": metrics.SerializeToString()}, step=step
            )
            if at_checkpoint:
                self._checkpoint(job, trainer)
        if step >= job.total:
            self._end(job, protocol.FINISHED, step=step)

    def _recover(self, job: PackedJob, blowup: BlowUp) -> None:
        """Roll the job back to its last healthy evaluation with smaller steps, or fail it (the
        solo process's rule, for this run alone)."""
        assert self.pack is not None
        try:
            event = job.recovery.recover(blowup, RunInPack(self.pack, job.slot))
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

    def _checkpoint(self, job: PackedJob, trainer: Trainer | None = None) -> None:
        assert self.pack is not None
        step = self._step(job)
        if step == job.last_checkpoint:
            return
        self._beat()
        if trainer is None:
            trainer = run_to_trainer(self.pack, job.slot, valid_data=self.valid)
        blobs, fields = checkpoint_parts(trainer, job.recovery)
        self._send(job, protocol.CHECKPOINT, blobs=blobs, step=step, **fields)
        job.last_checkpoint = step

    def _requests(self) -> bool:
        """Read what the worker sent: a stop (every job checkpoints and stops: True), or a
        stop or drop of one run. Nothing is read once every run has left: what follows in the
        pipe (the worker's next start, sent as soon as the pack ended on its side) is the main
        loop's."""
        while self._open() and self.conn.poll():
            message = protocol.receive(self.conn)
            if message.kind == protocol.STOP:
                for job in self._open():
                    self._checkpoint(job)
                    self._end(job, protocol.STOPPED, step=self._step(job))
                return True
            if message.kind == protocol.STOP_RUN:
                job = self.jobs[int(message.fields["run"])]
                if job.open:
                    self._checkpoint(job)
                    self._end(job, protocol.STOPPED, step=self._step(job))
            if message.kind == protocol.DROP:
                job = self.jobs[int(message.fields["run"])]
                if job.open:
                    logger.info("packed run %d leaves the pack", job.index)
                    self._close(job)
        return False

    # --- ends -----------------------------------------------------------------------------

    def _close(self, job: PackedJob) -> None:
        job.open = False
        if self.pack is not None and job.slot >= 0:
            self.pack.hold(job.slot)  # it stands still from now on; the others go on

    def _end(self, job: PackedJob, kind: str, **fields: Any) -> None:
        self._send(job, kind, **fields)
        self._close(job)

    def _fail(self, job: PackedJob, reason: str, *, step: int, diverged: bool = False) -> None:
        self._end(job, protocol.FAILED, reason=reason, step=step, diverged=diverged)

    def fail_open(self, reason: str) -> None:
        """Report every job still training as failed (the pack itself cannot go on)."""
        for job in self._open():
            with contextlib.suppress(OSError):
                step = self._step(job) if job.slot >= 0 and self.pack is not None else 0
                self._fail(job, reason, step=step)

    # --- messages -------------------------------------------------------------------------

    def _trained(self, steps: int, seconds: float) -> None:
        self.progress.append((steps, seconds))
        if time.monotonic() - self.progress_sent >= protocol.PROGRESS_INTERVAL_S:
            self._send_progress()

    def _send_progress(self) -> None:
        runs, self.progress = self.progress, []
        self.progress_sent = time.monotonic()
        protocol.send(self.conn, protocol.Message(protocol.PROGRESS, {"runs": runs}))
        self.last_sent = self.progress_sent

    def _send(
        self, job: PackedJob, kind: str, *, blobs: dict[str, bytes] | None = None, **fields: Any
    ) -> None:
        if self.progress:  # the worker counts the steps before it hears of what followed them
            self._send_progress()
        fields["run"] = job.index
        protocol.send(self.conn, protocol.Message(kind, fields, blobs or {}))
        self.last_sent = time.monotonic()

    def _beat(self, *, force: bool = False) -> None:
        if force or time.monotonic() - self.last_sent >= self.alive_interval:
            protocol.send(self.conn, protocol.Message(protocol.ALIVE))
            self.last_sent = time.monotonic()


def _generator_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's default generators for the CPU and ``device`` (where a model is initialised)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_generator_states(
    device: torch.device, states: tuple[torch.Tensor, torch.Tensor | None]
) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def packed_summary(size: int) -> str:
    """How a packed job's Runtime summary says it ran packed."""
    return f"packed with {size} runs"


def _boundary(job: PackedJob, step: int) -> int:
    """The job's next evaluation, checkpoint or last step after ``step``."""
    every, checkpoint_every = job.spec.eval.every, job.spec.training.checkpoint_every
    return min(
        (step // every + 1) * every, (step // checkpoint_every + 1) * checkpoint_every, job.total
    )
