"""Fast random draws and block-Gibbs sweeps for CD/PCD, with preallocated buffers.

On small CD-k steps the CPU time goes to random numbers and per-op overhead, not FLOPs: torch's
CPU ``uniform_`` costs 3-4 ns per float (a serial Mersenne Twister), ``torch.bernoulli`` several
times more. So on the CPU the bits come from numpy's SFC64 (``random_raw``, about 0.5 ns per 16
bits): a Bernoulli draw compares p with a uniform on the 16-bit grid k / 65536, so P(1) is p
rounded up to a multiple of 2⁻¹⁶ (an error below 1.6e-5, far under the CD noise); normals come
from torch's ``normal_``. On CUDA the device's Philox generator is fast: ``uniform_`` + compare.
The models' own sampling methods keep plain torch sampling; this module serves training.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ssdcore.batched import addmm, over_rows
from ssdcore.models.base import GibbsKernel

logger = logging.getLogger(__name__)

_TWO_POW_16 = 65536.0
_RAW_WORDS_PER_SFC64_STATE = 4
_MAX_SCRATCH_BUFFERS = 16


def bits_offset(device: torch.device) -> torch.Tensor:
    """The constant :func:`bits_below_` takes: -32768 as a float32 tensor on ``device``."""
    return torch.tensor(-_TWO_POW_16 / 2, device=device, dtype=torch.float32)


def bits_below_(
    bits: torch.Tensor,
    probs: torch.Tensor,
    offset: torch.Tensor,
    threshold: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """0/1 draws from 16-bit integers k in [-32768, 32767] (as floats, ``bits``): 1 where
    ``k < 65536·p - 32768`` ⇔ ``(k + 32768) / 65536 < p``, a 16-bit uniform on [0, 1) below
    p; ``threshold`` is scratch of ``probs``' shape, ``offset`` from :func:`bits_offset`."""
    torch.add(offset, probs, alpha=_TWO_POW_16, out=threshold)
    return torch.lt(bits, threshold, out=out)


@dataclass(frozen=True)
class _Scratch:
    """Buffers for Bernoulli draws of one shape: uniforms (flat and shaped) and thresholds."""

    flat: torch.Tensor
    uniform: torch.Tensor
    threshold: torch.Tensor


class RandomSource:
    """Seeded Bernoulli and Gaussian draws into preallocated tensors on one device. `state_dict()` /
    `load_state_dict()` capture the generator exactly, so a resumed run draws the same numbers as an
    uninterrupted one."""

    def __init__(self, device: torch.device | str, seed: int):
        self.device = torch.device(device)
        self._scratch: dict[tuple[torch.Size, torch.dtype], _Scratch] = {}
        self._offset = bits_offset(self.device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._bits = np.random.SFC64(seed) if self.device.type == "cpu" else None

    @property
    def generator(self) -> torch.Generator:
        """The torch generator behind the draws (a CUDA graph registers it to replay draws)."""
        return self._generator

    def bernoulli_(self, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write 0/1 draws with P(1) = probs into `out` (same shape; may alias `probs`)."""
        scratch = self._scratch_for(probs)
        if self._bits is None:
            scratch.uniform.uniform_(generator=self._generator)
            return torch.lt(scratch.uniform, probs, out=out)
        # integers k in [-32768, 32767], converted to float without a temporary
        scratch.flat.copy_(torch.from_numpy(self.bits16(scratch.flat.numel())))
        return bits_below_(scratch.uniform, probs, self._offset, scratch.threshold, out)

    def bits16(self, n: int) -> np.ndarray:
        """The next ``n`` signed 16-bit integers of the CPU bit stream: what :meth:`bernoulli_`
        compares against for ``n`` draws, so a caller that thresholds them itself (a pack, for
        many runs at once) reproduces this source's draws."""
        if self._bits is None:
            raise RuntimeError("bits16 is for CPU sources; a CUDA source draws with uniform_")
        words = self._bits.random_raw((n + 3) // 4)
        return words.view(np.int16)[:n]

    def normal_(self, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` with independent standard normal draws."""
        return out.normal_(generator=self._generator)

    def _scratch_for(self, probs: torch.Tensor) -> _Scratch:
        # Views are made once per shape: even a view costs microseconds per call.
        key = (probs.shape, probs.dtype)
        scratch = self._scratch.get(key)
        if scratch is None:
            if len(self._scratch) >= _MAX_SCRATCH_BUFFERS:  # shapes changed: start afresh
                self._scratch.clear()
            flat = torch.empty(probs.numel(), dtype=probs.dtype, device=self.device)
            threshold = torch.empty(probs.shape, dtype=probs.dtype, device=self.device)
            scratch = _Scratch(flat, flat.view(probs.shape), threshold)
            self._scratch[key] = scratch
        return scratch

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The generators' states as tensors (safetensors-friendly)."""
        state = {"generator": self._generator.get_state()}
        if self._bits is not None:
            bits = self._bits.state
            words = np.asarray(bits["state"]["state"], dtype=np.uint64)
            extra = np.asarray([bits["has_uint32"], bits["uinteger"]], dtype=np.uint64)
            packed = np.concatenate([words, extra]).view(np.int64)
            state["sfc64"] = torch.from_numpy(packed.copy())
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a state from `state_dict()`. A state saved on the other kind of device (CPU
        vs CUDA generators) reseeds from a hash of itself: a run moved between a CPU and a GPU
        worker goes on deterministically, statistically the same but not bit for bit."""
        if "generator" not in state:
            raise ValueError(
                "random state lacks 'generator'; pass RandomSource.state_dict() output"
            )
        if not restore_generator(self._generator, state["generator"]):
            if self._bits is not None:
                self._bits = np.random.SFC64(seed_from_state(state["generator"]))
            logger.warning(
                "random state saved on a %s device, restored on %s: the draws continue from a "
                "seed derived from it, not the same stream",
                "CPU" if "sfc64" in state else "CUDA",
                self.device,
            )
            return
        if self._bits is None:
            return
        if "sfc64" not in state:
            raise ValueError("random state lacks 'sfc64'; pass RandomSource.state_dict() output")
        packed = state["sfc64"].cpu().numpy().astype(np.int64).view(np.uint64)
        if packed.shape != (_RAW_WORDS_PER_SFC64_STATE + 2,):
            raise ValueError(f"random state 'sfc64' has shape {packed.shape}; expected (6,)")
        self._bits.state = {
            "bit_generator": "SFC64",
            "state": {"state": packed[:_RAW_WORDS_PER_SFC64_STATE].copy()},
            "has_uint32": int(packed[4]),
            "uinteger": int(packed[5]),
        }


def seed_from_state(state: torch.Tensor) -> int:
    """A 63-bit seed from a saved generator state's bytes (sha256): same state, same seed."""
    digest = hashlib.sha256(state.cpu().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def restore_generator(generator: torch.Generator, state: torch.Tensor) -> bool:
    """Set ``generator`` to a saved state; False (and reseeded from it, see
    :func:`seed_from_state`) when the state belongs to another kind of generator, e.g. a CUDA
    generator's state restored on the CPU."""
    if state.numel() != generator.get_state().numel():
        generator.manual_seed(seed_from_state(state))
        return False
    generator.set_state(state.cpu())
    return True


def seed_from(generator: torch.Generator | None) -> int:
    """A 63-bit seed drawn from `generator` (or from torch's global generator)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=device).item())


class Draws(Protocol):
    """Where a sweep's random draws come from: a :class:`RandomSource`, or a pack's sources for
    its runs' stacked rows (:meth:`ssdcore.pack.random.PackedRandom.for_runs`)."""

    def bernoulli_(self, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

    def normal_(self, out: torch.Tensor) -> torch.Tensor: ...


def hidden_probs_(kernel: GibbsKernel, visible: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out ← p(h = 1 | visible) = σ(v C⁻¹W + a), for one run's rows (B, ·) or a pack's
    (M, B, ·) with a pack's kernel."""
    return addmm(over_rows(kernel.hidden_bias), visible, kernel.hidden_weight, out=out).sigmoid_()


def sample_visible_(
    kernel: GibbsKernel,
    draws: Draws,
    hidden: torch.Tensor,
    out: torch.Tensor,
    noise: torch.Tensor | None,
) -> None:
    """out ← a draw of v ~ p(v | hidden) (Gaussian visibles use the scratch ``noise``)."""
    addmm(over_rows(kernel.visible_bias), hidden, kernel.weight_t, out=out)
    if not kernel.gaussian:
        draws.bernoulli_(out.sigmoid_(), out=out)
        return
    assert noise is not None, "Gaussian visibles need the noise scratch"
    noise = draws.normal_(noise)
    if kernel.noise_transform is not None:
        out.addmm_(noise, kernel.noise_transform)
    elif kernel.noise_scale is not None:
        out.addcmul_(noise, over_rows(kernel.noise_scale))
    else:
        out.add_(noise)


def gibbs_sweeps(
    kernel: GibbsKernel,
    draws: Draws,
    hidden_start: torch.Tensor,
    k: int,
    visible_out: torch.Tensor,
    hidden_probs_out: torch.Tensor,
    hidden: torch.Tensor,
    noise: torch.Tensor | None,
) -> None:
    """k plain sweeps h → v → h from the binary states ``hidden_start``, for one run's chains
    or a pack's (a leading run axis on every tensor, kernel included). On return
    ``visible_out`` holds v_k and ``hidden_probs_out`` p(h | v_k); ``hidden`` and ``noise``
    are scratch for the intermediate hidden states and the Gaussian visibles' draws."""
    state = hidden_start
    for sweep in range(k):
        sample_visible_(kernel, draws, state, visible_out, noise)
        hidden_probs_(kernel, visible_out, hidden_probs_out)
        if sweep < k - 1:
            state = draws.bernoulli_(hidden_probs_out, out=hidden)


@dataclass(frozen=True)
class CollapsedSweep:
    """The Gaussian RBM's h → h transition with the visible layer integrated out. Given h,
    v ~ N(b + Wh, C), and the hidden units see v only through x = vᵀC⁻¹W + a, which is then exactly
    Gaussian: x ~ N(c + hᵀA, A) with A = WᵀC⁻¹W (H, H) and c = a + bᵀC⁻¹W. So a sweep costs an H×H
    product and H normal draws instead of two V×H products and V draws."""

    coupling: torch.Tensor  # A (H, H)
    offset: torch.Tensor  # c (H,)
    noise_factor_t: torch.Tensor  # Rᵀ with R Rᵀ = A (Cholesky); rows ξRᵀ ~ N(0, A)


def collapsed_sweep(kernel: GibbsKernel, n_chains: int, sweeps: int) -> CollapsedSweep | None:
    """The collapsed transition when it is cheaper for `sweeps` h → h steps, else None. Building it
    costs V·H² + H³/3 multiply-adds; each sweep then saves about 2·n·H·(V - H). It is only used when
    that saving is at least twice the cost, and when A is numerically positive definite (otherwise
    the plain sweep is exact and always available)."""
    if not kernel.gaussian or sweeps < 1:
        return None
    n_visible, n_hidden = kernel.weight.shape
    setup = n_visible * n_hidden**2 + n_hidden**3 / 3
    saving = sweeps * 2 * n_chains * n_hidden * (n_visible - n_hidden)
    if saving < 2 * setup:
        return None
    coupling = kernel.weight.t() @ kernel.hidden_weight  # Wᵀ C⁻¹ W
    coupling = 0.5 * (coupling + coupling.t())
    factor, info = torch.linalg.cholesky_ex(coupling)
    if int(info) != 0:
        return None
    offset = torch.addmv(kernel.hidden_bias, kernel.hidden_weight.t(), kernel.visible_bias)
    return CollapsedSweep(coupling, offset, factor.t())


class GibbsChain:
    """Block-Gibbs sweeps h → v → h for a fixed number of chains, all buffers preallocated;
    `run` writes into the caller's buffers (where the CD estimator's gradient step reads)."""

    def __init__(
        self,
        n_chains: int,
        n_visible: int,
        n_hidden: int,
        device: torch.device,
        source: RandomSource,
    ):
        self.source = source
        self.hidden = torch.empty(n_chains, n_hidden, device=device, dtype=torch.float32)
        self.noise = torch.empty(n_chains, n_visible, device=device, dtype=torch.float32)
        self.hidden_noise: torch.Tensor | None = None
        # Integrate the Gaussian visible layer out of intermediate sweeps where that is cheaper:
        # on the CPU. On a GPU the plain sweep's larger products cost less than the Cholesky
        # factorization and host synchronization the collapsed one needs (and a sync would keep
        # the step out of a CUDA graph).
        self.collapse = torch.device(device).type == "cpu"

    def sample_visible_(self, kernel: GibbsKernel, hidden: torch.Tensor, out: torch.Tensor) -> None:
        """out ← a draw of v ~ p(v | hidden)."""
        sample_visible_(kernel, self.source, hidden, out, self.noise)

    def run(
        self,
        kernel: GibbsKernel,
        hidden_start: torch.Tensor,
        k: int,
        visible_out: torch.Tensor,
        hidden_probs_out: torch.Tensor,
    ) -> None:
        """k sweeps from the binary hidden states `hidden_start` (n_chains, H). On return
        `visible_out` (n_chains, V) holds v_k and `hidden_probs_out` (n_chains, H) p(h | v_k)."""
        hidden = hidden_start
        collapsed = collapsed_sweep(kernel, hidden_start.shape[0], k - 1) if self.collapse else None
        if collapsed is not None:
            hidden = self._run_collapsed(collapsed, hidden, k - 1, hidden_probs_out)
            k = 1
        gibbs_sweeps(
            kernel, self.source, hidden, k, visible_out, hidden_probs_out, self.hidden, self.noise
        )

    def _run_collapsed(
        self, collapsed: CollapsedSweep, hidden: torch.Tensor, sweeps: int, probs: torch.Tensor
    ) -> torch.Tensor:
        """`sweeps` collapsed h → h steps; returns the final binary hidden states."""
        if self.hidden_noise is None or self.hidden_noise.shape != hidden.shape:
            self.hidden_noise = torch.empty_like(hidden)
        for _ in range(sweeps):
            torch.addmm(collapsed.offset, hidden, collapsed.coupling, out=probs)
            probs.addmm_(self.source.normal_(self.hidden_noise), collapsed.noise_factor_t)
            hidden = self.source.bernoulli_(probs.sigmoid_(), out=self.hidden)
        return hidden
