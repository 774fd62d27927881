"""Packed training: M RBMs of one kind and shape trained as one batched computation
(Bernoulli, or Gaussian of one variance form: :mod:`ssdcore.pack.models`).

See :mod:`ssdcore.pack.pack` for what holds run by run, and docs/ARCHITECTURE.md for the API.
"""

from __future__ import annotations

from ssdcore.pack.exchange import (
    insert_bytes,
    insert_trainer,
    pack_trainers,
    run_to_bytes,
    run_to_trainer,
    trainer_to_run_state,
)
from ssdcore.pack.fit import RunInPack, divergence_blowup, evaluate_run, fit_pack
from ssdcore.pack.pack import PackRun, RunDivergence, TrainingPack, pack_key, run_rules
from ssdcore.pack.state import RunState

__all__ = [
    "PackRun",
    "RunDivergence",
    "RunInPack",
    "RunState",
    "TrainingPack",
    "divergence_blowup",
    "evaluate_run",
    "fit_pack",
    "insert_bytes",
    "insert_trainer",
    "pack_key",
    "pack_trainers",
    "run_rules",
    "run_to_bytes",
    "run_to_trainer",
    "trainer_to_run_state",
]
