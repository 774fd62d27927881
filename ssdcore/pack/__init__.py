"""Packed training: M RBMs of one kind and shape trained as one batched computation
(Bernoulli, or Gaussian of one variance form: :mod:`ssdcore.pack.models`).

See :mod:`ssdcore.pack.pack` for what holds run by run, and docs/ARCHITECTURE.md for the API.

One definition of the math for a run and a pack. Every formula is written once, over tensors
with an optional leading run axis, and the solo and packed paths call the same function, as
torch keeps its single-tensor and multi-tensor optimizer steps side by side:

- polar factors (:mod:`ssdcore.optim.polar`: ``polar_svd``, ``polar_gram_factors``, both
  Newton–Schulz forms), step-rule lengths (:mod:`ssdcore.optim.step_rules`), the SGD/Nesterov
  step (:func:`ssdcore.optim.sgd.momentum_step_`), the l∞ and spectral updates
  (:mod:`ssdcore.optim.ssd`: ``linf_step_``, ``apply_polar_``, ``apply_factored_``);
- Gibbs sweeps and conditionals (:func:`ssdcore.sampling.gibbs_sweeps`) on a
  :class:`~ssdcore.models.base.GibbsKernel` with or without a run axis, the Gaussian kernel
  (:func:`ssdcore.models.gaussian.diagonal_kernel_tensors`), the CD gradients and variance
  gradients (:mod:`ssdcore.gradients`), Bernoulli bit draws (:func:`ssdcore.sampling.bits_below_`);
- the data order (:class:`ssdcore.order.RunOrder`), step sizes
  (:func:`ssdcore.schedules.step_size`), evaluation metrics and settings checks
  (:mod:`ssdcore.training`).

The few operations whose kernel depends on the rank live in :mod:`ssdcore.batched` (``mm`` or
``bmm``, a full reduction per matrix, ``mv`` per run, a per-run ``alpha``); they are what keeps a
packed run equal to its solo run bit for bit on the CPU. This package keeps what only a pack
has: the stacked, aligned buffers and their per-run offsets, per-run settings as columns, the
runs' random sources, and freezing, holding and exchanging single runs.

Why not a solo Trainer as a pack of one: the solo step covers what packs refuse (the full
covariance, the randomized polar method, the preconditioned SSD, ``max_spectral_norm``, parallel
tempering, centering, the collapsed Gaussian sweep, the stale-factor probe), and its public
pieces (:class:`~ssdcore.CDEstimator` writing ``.grad``, ``torch.optim`` optimizers with their
``param_groups`` and state dicts in checkpoints) would either need all of that batched or a
second path again; and a set of one would pay for the aligned stacks, per-run columns and
chunking on every step of the most common run (a 784×50 CD-1 step is about half a
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
