"""One run's complete state inside a pack: what a solo checkpoint holds, in the pack's terms,
handed out and taken back for rollbacks and (:mod:`ssdcore.pack.exchange`) for solo Trainers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from torch import Tensor

from ssdcore.optim.config import OptimizerConfig


@dataclass
class RunState:
    """Everything run ``i`` of a pack needs to continue exactly (tensors are own copies)."""

    model_config: dict  # RBM.config() of the run's model (its solo checkpoint checks it)
    parameters: dict[str, Tensor]  # "W" (V, H), "b" (V,), "a" (H,)
    optimizer: OptimizerConfig  # resolved: every step size explicit
    seed: int
    step: int
    epoch: int
    position: int
    permutation: Tensor  # (N,) int64: the current epoch's data order
    order_generator: Tensor  # the data-order generator's state
    random: dict[str, Tensor]  # the estimator's RandomSource.state_dict()
    chains: Tensor | None = None  # (B, H) persistent chains (PCD), None before the first step
    momentum: dict[str, Tensor] = field(default_factory=dict)  # parameter name -> buffer
    lr_scale: float = 1.0
    wall_time_s: float = 0.0

    def copy(self) -> RunState:
        """A deep copy, so a snapshot survives being restored more than once."""
        return copy.deepcopy(self)
