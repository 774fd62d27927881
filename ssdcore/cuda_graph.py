"""A training step captured once as a CUDA graph and replayed with a single launch.

Why: a CD-10 step at MNIST sizes is about 150 small kernels. On an H100 the host needs 4-10 µs
to issue each one, so the step is bound by Python and the launch path (1.1 ms at 784×500 with
SGD, measured) while the GPU's own work is a fraction of that. A CUDA graph records the kernels
once and replays them all with one launch.

What a captured step must satisfy (callers decide, see ``Trainer``): no host synchronization
(no ``.item()``, ``bool(tensor)``, data-dependent shapes), no Python-side state that changes
from step to step, and inputs read from and outputs written to tensors that stay in place. The
first steps run eagerly on a side stream, as CUDA graph capture requires (lazy initialization of
cuBLAS workspaces, optimizer buffers and persistent chains happens there); the random generators
are registered with the graph, so each replay draws fresh numbers — the same numbers, offset for
offset, as the eager step would have drawn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# Eager steps before capture; covers first-step branches (optimizer buffers, PCD chains).
WARMUP_STEPS = 3


class GraphedStep:
    """Runs ``step`` eagerly for :data:`WARMUP_STEPS` calls, then captures it and replays it.

    ``generators`` are the CUDA generators the step draws from; they keep advancing with every
    replay, so their saved states stay exact for a resume.
    """

    def __init__(
        self,
        step: Callable[[], None],
        generators: Sequence[torch.Generator],
        device: torch.device,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA device, got {device}")
        self._step = step
        self._generators = list(generators)
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._eager_steps = 0
        self.replays = 0

    def __call__(self) -> None:
        if self._graph is None:
            self._warm_up_or_capture()
        if self._graph is not None:
            self._graph.replay()
            self.replays += 1

    def _warm_up_or_capture(self) -> None:
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            if self._eager_steps < WARMUP_STEPS:
                self._step()
                self._eager_steps += 1
            else:
                self._graph = self._capture()
        current.wait_stream(self._stream)

    def _capture(self) -> torch.cuda.CUDAGraph:
        # Capture records the kernels without running them; the caller replays once after.
        graph = torch.cuda.CUDAGraph()
        for generator in self._generators:
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, stream=self._stream):
            self._step()
        logger.debug("captured the training step as a CUDA graph on %s", self._device)
        return graph
