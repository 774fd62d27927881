"""Server defaults for the spec fields a job leaves at zero (kept free of torch imports, so
that the worker process itself never loads torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanDefaults:
    """Server defaults for spec fields left at zero."""

    batch_size: int = 100
    eval_every: int = 100
    checkpoint_every: int = 500
    validation_fraction: float = 0.1
    ais_chains: int = 100
    ais_betas: int = 1000
