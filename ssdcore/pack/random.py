"""Bernoulli draws for a pack of runs, each run from its own random source.

Every run keeps the :class:`~ssdcore.sampling.RandomSource` a solo :class:`~ssdcore.Trainer`
with the same seed would have, and each packed draw takes that run's numbers exactly as the
solo ``bernoulli_`` of the same shape would: a run's draws are its solo draws, whatever shares
the pack. On the CPU that is one ``random_raw`` call per run and one torch comparison for the
pack; on CUDA one ``uniform_`` kernel per run and draw, which ``independent=False`` saves (one
generator for the pack; a run's draws then depend on the pack's composition).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ssdcore.sampling import RandomSource, bits_below_, bits_offset

# Scratch shapes kept before starting afresh (a pack uses two or three).
_MAX_SCRATCH = 8
# Draws per run from which each run's bits are copied into its rows one run at a time (no
# gathering copy); below it one gathered copy is cheaper than a copy call per run.
_PER_RUN_COPY_MIN = 4096


class PackedRandom:
    """One :class:`RandomSource` per run; ``bernoulli_`` draws for all runs at once.

    Args:
        sources: the runs' sources, in pack order (each owned by this object from now on).
        device: where the draws go.
        independent: False shares one generator (``shared_seed``) across the pack.
    """

    def __init__(
        self,
        sources: list[RandomSource],
        device: torch.device,
        *,
        independent: bool = True,
        shared_seed: int = 0,
    ) -> None:
        self.sources = sources
        self.device = device
        self.shared = None if independent else RandomSource(device, shared_seed)
        self._offset = bits_offset(device)
        self._scratch: dict[torch.Size, tuple[Tensor, Tensor]] = {}
        self._bits = np.empty(0, dtype=np.int16)

    @property
    def generators(self) -> list[torch.Generator]:
        """Every torch generator a draw may advance (a CUDA graph registers them)."""
        if self.shared is not None:
            return [self.shared.generator]
        return [source.generator for source in self.sources]

    def bernoulli_(self, probs: Tensor, out: Tensor, runs: slice | None = None) -> Tensor:
        """0/1 draws with P(1) = ``probs`` (R, ...) into ``out``; row i from the source of run
        ``runs.start + i`` (``runs``: the pack's runs these rows belong to; None: all)."""
        if self.shared is not None:
            return self.shared.bernoulli_(probs, out=out)
        sources = self.sources if runs is None else self.sources[runs]
        uniform, threshold = self._scratch_for(probs.shape)
        if self.device.type != "cpu":
            for i, source in enumerate(sources):
                uniform[i].uniform_(generator=source.generator)
            return torch.lt(uniform, probs, out=out)
        per_run = probs[0].numel()
        if per_run >= _PER_RUN_COPY_MIN:
            for row, source in zip(uniform, sources, strict=True):
                row.view(-1).copy_(torch.from_numpy(source.bits16(per_run)))
        else:
            bits = self._bits_buffer(probs.shape)
            np.concatenate([source.bits16(per_run) for source in sources], out=bits)
            uniform.view(-1).copy_(torch.from_numpy(bits))
        return bits_below_(uniform, probs, self._offset, threshold, out)

    def source(self, run: int) -> RandomSource:
        """The source run ``run``'s draws come from (the shared one for a shared stream)."""
        return self.shared if self.shared is not None else self.sources[run]

    def normal_(self, out: Tensor, runs: slice | None = None) -> Tensor:
        """Standard normal draws into ``out`` (R, ...), row i from run ``runs.start + i``'s
        source: a torch generator fills one tensor per call, so one call per run."""
        first = 0 if runs is None else runs.start
        for offset, rows in enumerate(out):
            self.source(first + offset).normal_(rows)
        return out

    def for_runs(self, runs: slice) -> RunDraws:
        """The draws of runs ``runs`` as one source: what a sweep written for one run
        (:func:`ssdcore.sampling.gibbs_sweeps`) calls on their stacked rows."""
        return RunDraws(self, runs)

    def _bits_buffer(self, shape: torch.Size) -> np.ndarray:
        """A reused int16 buffer for one draw's bits: a fresh multi-MiB array per draw costs
        page faults that took longer than drawing the bits."""
        size = int(np.prod(shape))
        if self._bits.size < size:
            self._bits = np.empty(size, dtype=np.int16)
        return self._bits[:size]

    def _scratch_for(self, shape: torch.Size) -> tuple[Tensor, Tensor]:
        scratch = self._scratch.get(shape)
        if scratch is None:
            if len(self._scratch) >= _MAX_SCRATCH:
                self._scratch.clear()
            f32 = {"device": self.device, "dtype": torch.float32}
            scratch = (torch.empty(shape, **f32), torch.empty(shape, **f32))
            self._scratch[shape] = scratch
        return scratch


class RunDraws:
    """:class:`PackedRandom`'s draws for a slice of its runs, with :class:`RandomSource`'s
    ``bernoulli_`` / ``normal_`` signature."""

    def __init__(self, random: PackedRandom, runs: slice) -> None:
        self.random = random
        self.runs = runs

    def bernoulli_(self, probs: Tensor, out: Tensor) -> Tensor:
        return self.random.bernoulli_(probs, out=out, runs=self.runs)

    def normal_(self, out: Tensor) -> Tensor:
        return self.random.normal_(out, runs=self.runs)
