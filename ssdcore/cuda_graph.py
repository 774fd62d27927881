"""A training step captured once as a CUDA graph and replayed with a single launch.

Why: a CD-10 step at MNIST sizes is about 150 small kernels. On an H100 the host needs 4-10 µs
to issue each one, so the step is bound by Python and the launch path (1.1 ms at 784×500 with
SGD, measured) while the GPU's own work is a fraction of that.

A captured step must not synchronize with the host (no ``.item()``, ``bool(tensor)``,
data-dependent shapes), keep no Python-side state that changes between steps, and read and
write tensors that stay in place (callers decide: ``Trainer``, ``TrainingPack``). The first
steps run eagerly on a side stream, as capture requires (lazy initialization of cuBLAS
workspaces, optimizer buffers and persistent chains happens there); the random generators are
registered with the graph, so each replay draws the numbers the eager step would have drawn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# Eager steps before capture; covers first-step branches (optimizer buffers, PCD chains).
WARMUP_STEPS = 3


def use_cuda_graph(requested: bool | None, obstacle: str | None) -> bool:
    """Whether to capture a step that ``obstacle`` (None: nothing) keeps from being captured:
    ``requested`` True insists (ValueError naming the obstacle), False never, None when it can."""
    if requested and obstacle:
        raise ValueError(f"cuda_graph=True but the step cannot be captured: {obstacle}")
    return requested is not False and obstacle is None


class GraphedStep:
    """Runs ``step`` eagerly for :data:`WARMUP_STEPS` calls, then captures it and replays it.
    ``generators`` are the CUDA generators the step draws from; they keep advancing with every
    replay, so their saved states stay exact for a resume."""

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
                # Capture records the kernels without running them; the caller replays once.
                graph = torch.cuda.CUDAGraph()
                for generator in self._generators:
                    graph.register_generator_state(generator)
                with torch.cuda.graph(graph, stream=self._stream):
                    self._step()
                logger.debug("captured the training step as a CUDA graph on %s", self._device)
                self._graph = graph
        current.wait_stream(self._stream)
