"""The runs one training process trains at once, behind one interface for its training loop.

A job alone trains on its solo Trainer (:class:`SoloRun`); compatible jobs packed together
train as one ssdcore TrainingPack of M runs (:class:`PackRuns`), each continuing the Trainer it
was built as (bit for bit on the CPU, docs/ARCHITECTURE.md "Packed training"). The training
loop (worker/child.py) asks either for the same per-run operations, each run named by its index:
``train_steps(n)`` (the runs that diverged, with their blow-up), ``step(run)``, ``trainer(run)``
(a Trainer of the run as it is now, to evaluate and checkpoint it), ``recoverable(run)`` (the
run as the blow-up recovery snapshots and rolls it back) and ``hold(run)`` (it stops moving, the
others go on); ``cuda_graph``: whether the steps run as a captured CUDA graph. A job alone is
not a pack of one: its own Trainer trains it, as fast as it trains anywhere.
"""

from __future__ import annotations

import torch

from ssdcore.blowup import BlowUp, Recoverable, blowup_from_error
from ssdcore.errors import DivergenceError
from ssdcore.pack import RunInPack, divergence_blowup, pack_trainers, run_to_trainer
from ssdcore.training import Trainer


class SoloRun:
    """A job alone: its Trainer, as run 0."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self.cuda_graph = bool(trainer.cuda_graph)

    def train_steps(self, n: int) -> dict[int, BlowUp]:
        try:
            self._trainer.train_steps(n)
        except DivergenceError as exc:
            return {0: blowup_from_error(exc, self._trainer.step_count)}
        return {}

    def step(self, run: int) -> int:
        return self._trainer.step_count

    def trainer(self, run: int) -> Trainer:
        return self._trainer

    def recoverable(self, run: int) -> Recoverable:
        return self._trainer

    def hold(self, run: int) -> None:
        """Nothing to do: the training loop ends with its one run."""


class PackRuns:
    """Jobs' Trainers packed (ssdcore.pack.pack_trainers): run i continues ``trainers[i]``."""

    def __init__(self, trainers: list[Trainer], valid: torch.Tensor | None) -> None:
        self.pack = pack_trainers(trainers)
        self.cuda_graph = bool(self.pack.cuda_graph)
        self._valid = valid  # the validation rows every run shares, for its evaluations

    def train_steps(self, n: int) -> dict[int, BlowUp]:
        return {event.run: divergence_blowup(event) for event in self.pack.train_steps(n)}

    def step(self, run: int) -> int:
        return self.pack.step_counts[run]

    def trainer(self, run: int) -> Trainer:
        return run_to_trainer(self.pack, run, valid_data=self._valid)

    def recoverable(self, run: int) -> Recoverable:
        return RunInPack(self.pack, run)

    def hold(self, run: int) -> None:
        self.pack.hold(run)


RunSet = SoloRun | PackRuns
