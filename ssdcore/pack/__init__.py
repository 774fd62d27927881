"""Packed training: M RBMs of one kind and shape trained as one batched computation
(Bernoulli, or Gaussian of one variance form: :mod:`ssdcore.pack.models`).

See :mod:`ssdcore.pack.pack` for what holds run by run. The math is written once, over tensors
with an optional leading run axis, and the solo and packed paths call the same functions (polar
factors, step rules, optimizer steps, Gibbs sweeps, gradients, data order, step sizes); the few
operations whose kernel depends on the rank live in :mod:`ssdcore.batched`. This package keeps
what only a pack has: aligned stacked buffers, per-run settings as columns, the runs' random
sources, and freezing, holding and exchanging single runs.

Why not a solo Trainer as a pack of one: the solo step covers what packs refuse (the full
covariance, the randomized polar method, the preconditioned SSD, ``max_spectral_norm``, parallel
tempering, centering, the collapsed Gaussian sweep, the stale-factor probe) and exposes pieces
(``CDEstimator`` writing ``.grad``, ``torch.optim`` optimizers and their state dicts) that would
all need batching or a second path; and a set of one would pay for the aligned stacks, per-run
columns and chunking on every step of the most common run (a 784×50 CD-1 step is about half a
millisecond).
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
