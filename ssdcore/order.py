"""A run's minibatch order: its own seeded generator, permutation and position.

A fresh ``randperm`` of the training rows at every epoch, the last partial batch dropped. The
solo :class:`~ssdcore.Trainer` keeps one; a pack keeps one per run, so a run's batches are its
solo batches whatever else shares the pack.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from ssdcore.sampling import restore_generator

logger = logging.getLogger(__name__)


class RunOrder:
    """One run's data order; the fields are what a checkpoint stores."""

    def __init__(self, n_rows: int, batch_size: int, seed: int, device: torch.device) -> None:
        self.n_rows = n_rows
        self.batch_size = batch_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.epoch = 0
        self.position = 0
        self.permutation = self._new_permutation()

    def _new_permutation(self) -> Tensor:
        return torch.randperm(self.n_rows, generator=self.generator, device=self.generator.device)

    def next_indices(self) -> Tensor:
        """The row indices of this run's next batch (B,); reshuffles at an epoch's end."""
        if self.position + self.batch_size > self.permutation.shape[0]:
            self.permutation = self._new_permutation()
            self.position = 0
            self.epoch += 1
        index = self.permutation[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return index

    def check_permutation(self, permutation: Tensor) -> None:
        """ValueError unless a saved permutation covers this order's rows (the same data)."""
        if permutation.shape != (self.n_rows,):
            raise ValueError(
                f"saved data order covers {permutation.shape[0]} examples but the training data "
                f"has {self.n_rows}; resume with the same data"
            )

    def restore(
        self, epoch: int, position: int, permutation: Tensor, generator_state: Tensor
    ) -> None:
        """Continue a saved order (a checkpoint's fields). A generator state saved on another
        kind of device continues from a seed derived from it (logged)."""
        self.check_permutation(permutation)
        self.epoch, self.position = int(epoch), int(position)
        self.permutation = permutation.to(self.generator.device, torch.int64).clone()
        if not restore_generator(self.generator, generator_state):
            logger.warning(
                "data-order generator saved on another kind of device than %s: the order "
                "continues from a seed derived from it",
                self.generator.device,
            )


def gather_batches(orders: list[RunOrder], data: Tensor, out: Tensor) -> Tensor:
    """Every run's next batch into ``out`` (M, B, V), from the shared (N, V) ``data``."""
    index = torch.cat([order.next_indices() for order in orders])  # (M·B,)
    torch.index_select(data, 0, index, out=out.view(-1, data.shape[1]))
    return out
