"""The blow-up detector's references travel with each checkpoint and come back at a resume.

Store level (a real redis-server): the recovery state is written in the checkpoint's own fenced
script, read back with the trainer state and checked by its sha256; a checkpoint written
before it was kept reads as having none. Training-process level (ssdrbm_server.worker
.job_training.check_start, on a real Trainer): a resume with the state keeps the references
of the run before it and does not count the resume point's evaluation twice; one without it
restarts them there and says so in the log. tests/test_recovery.py shows the whole service
doing it: a job killed or stopped before a slow blow-up backs off where the library does.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ssdcore.blowup import Recovery
from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.models import model_from_config
from ssdcore.training import Trainer
from ssdrbm_server.keys import Keys
from ssdrbm_server.store import CheckpointStore, FencedJob, JobStore, LeaseStore
from ssdrbm_server.store.checkpoints import CorruptCheckpointError
from ssdrbm_server.worker.job_training import check_start
from tests.test_store import run, submit


def test_the_recovery_state_is_written_with_its_checkpoint_and_verified(redis_url: str) -> None:
    async def scenario(redis) -> None:
        jobs, leases, checkpoints = JobStore(redis), LeaseStore(redis), CheckpointStore(redis)
        job, _ = await submit(jobs)
        fenced = FencedJob(redis, await leases.claim(job.id, "w1", lease_ms=10_000))
        for step in (10, 20, 30):
            await fenced.put_checkpoint(
                step,
                data=b"model",
                config_json="{}",
                trainer_state=b"trainer",
                recovery_state=json.dumps({"written_at": step}),  # opaque to the store
            )
        latest = await checkpoints.latest(job.id, with_trainer_state=True)
        assert (latest.step, json.loads(latest.recovery_state)) == (30, {"written_at": 30})
        assert (await checkpoints.latest(job.id)).recovery_state == ""  # only with the trainer

        # A flipped byte: the resume falls back to the previous checkpoint, whole.
        await redis.hset(Keys().checkpoint(job.id, 30), "recovery_state", '{"written_at": 31}')
        with pytest.raises(CorruptCheckpointError, match="recovery state at step 30"):
            await checkpoints.get(job.id, 30, with_trainer_state=True)
        assert (await checkpoints.latest(job.id, with_trainer_state=True)).step == 20

        # Written by a version that did not keep it: no state, no digest, no error.
        await redis.hdel(Keys().checkpoint(job.id, 20), "recovery_state", "recovery_sha256")
        older = await checkpoints.get(job.id, 20, with_trainer_state=True)
        assert (older.trainer_state, older.recovery_state) == (b"trainer", "")

    run(redis_url, scenario)


def trained(steps: int) -> tuple[Trainer, Recovery, list[dict]]:
    """A small Gaussian RBM trained ``steps`` steps with every 10th evaluated through its
    recovery (as a job's training process does); its evaluations."""
    torch.manual_seed(0)
    data = torch.randn(200, 12)
    model = model_from_config({"type": "gaussian", "n_visible": 12, "n_hidden": 6})
    trainer = Trainer(model, data, batch_size=20, seed=0)
    recovery = Recovery()
    evaluations = []
    for _ in range(0, steps + 1, 10):
        values = trainer.evaluate()
        assert recovery.check(values, trainer) is None
        evaluations.append(values)
        if trainer.step_count < steps:
            trainer.train_steps(10)
    return trainer, recovery, evaluations


def resumed_from(trainer: Trainer) -> tuple[Trainer, Recovery]:
    data = trainer.train_data
    return trainer_from_bytes(trainer_to_bytes(trainer), data), Recovery()


def test_a_resume_with_the_kept_state_judges_as_the_run_before_it() -> None:
    trainer, recovery, evaluations = trained(60)
    kept = json.dumps(recovery.state_dict())
    resumed, fresh = resumed_from(trainer)
    values = resumed.evaluate()
    assert check_start(fresh, values, resumed, resumed=True, recovery_state=kept) is None
    # The references are the run's own, and the resume point is not counted a second time.
    assert fresh.state_dict() == recovery.state_dict()
    assert fresh.healthy_step == 60 == recovery.healthy_step
    best = min(evaluations, key=lambda values: values["reconstruction_error"])
    assert fresh.detector.best_step == best["step"]


def test_a_resume_from_an_older_checkpoint_restarts_the_references_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer, _, _ = trained(60)
    resumed, fresh = resumed_from(trainer)
    values = resumed.evaluate()
    with caplog.at_level(logging.INFO, logger="ssdrbm_server.worker.job_training"):
        assert check_start(fresh, values, resumed, resumed=True, recovery_state="") is None
    assert "keeps no blow-up detector references" in caplog.text
    assert fresh.detector.observations == 1 and fresh.detector.best_step == 60
    assert fresh.healthy_step == 60


def test_a_fresh_job_takes_its_baseline_without_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    trainer, _, _ = trained(0)
    recovery = Recovery()
    with caplog.at_level(logging.INFO, logger="ssdrbm_server.worker.job_training"):
        check_start(recovery, trainer.evaluate(), trainer, resumed=False, recovery_state="")
    assert caplog.text == "" and recovery.detector.observations == 1
