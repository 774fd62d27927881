"""Parallel tempering (PT) for the PCD negative phase.

The tempered family scales the whole energy (Desjardins et al. 2010; Cho, Raiko & Ilin 2010):
p_β(v, h) ∝ exp(-β E(v, h)). Unlike AIS's base-model interpolation
(:mod:`ssdcore.evaluation.annealing`) it needs no base model fitted to data, its conditionals
are the model's own with scaled inputs (one batched product serves every temperature), and
β → 0 flattens the landscape uniformly, which lets the hot chains cross between modes.

With x = vᵀC⁻¹W + a and m = b + Wh (C = I for the BRBM): p_β(h_j = 1 | v) = σ(β x_j);
BRBM p_β(v_i = 1 | h) = σ(β m_i); GRBM p_β(v | h) = N(m, C/β). The visible marginal, with
q(v) = -bᵀv (BRBM) or ½(v - b)ᵀC⁻¹(v - b) (GRBM) and S(β, x) = Σ_j softplus(β x_j), is

    log p̃_β(v) = -β q(v) + S(β, x(v)),

which is *not* exp(-β F(v)) (softplus(βx) ≠ β softplus(x)): the textbook swap rule holds for
joint states, not with F in place of E. Here the chains swap their visible states v, and each
temperature then draws h ~ p_β(h | v) afresh. Swapping v_i (at β_i) and v_j (at β_j) targets
p_βi(v_i) p_βj(v_j), so Metropolis accepts with

    log A = min(0, (β_i - β_j)(q(v_i) - q(v_j))
                   + S(β_i, x(v_j)) + S(β_j, x(v_i)) - S(β_i, x(v_i)) - S(β_j, x(v_j))),

exact up to float32 rounding (the normalizers cancel), so the β = 1 chain samples the model.

One PCD step: k sweeps at every temperature (the K·M chains stacked as one matrix), then swaps
between neighbours, even pairs on even steps and odd pairs on odd steps (disjoint, so applied at
once). The parity and the swap rates are device tensors: no host sync. Swap rates are per pair:
the mean acceptance over its first SWAP_RATE_WINDOW attempts, then an exponential average.
With K = 1 the step is plain PCD, draw for draw (Bernoulli RBM; a Gaussian RBM's PCD on the CPU
integrates the visibles out of intermediate sweeps, so there they agree in distribution only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssdcore.models.base import RBM, GibbsKernel
from ssdcore.models.gaussian import GaussianRBM
from ssdcore.sampling import RandomSource

# The ladder when a caller asks for tempering without saying more (the service's defaults too).
DEFAULT_N_TEMPERATURES = 10
DEFAULT_MIN_BETA = 0.5
DEFAULT_SPACING = "geometric"
SPACINGS = ("geometric", "linear")
# Each temperature costs a full set of chains: beyond this the sweeps dominate every step.
MAX_TEMPERATURES = 64
# Attempts over which a pair's swap rate is averaged (an exact mean until then).
SWAP_RATE_WINDOW = 100


@dataclass(frozen=True)
class TemperingConfig:
    """The inverse-temperature ladder 1 = β_0 > β_1 > ... > β_{K-1} = min_beta. ``spacing``
    "geometric" (equal ratios, the usual choice: swap rates depend on ratios of neighbouring β) or
    "linear"; ``betas`` gives the ladder explicitly instead (then ``n_temperatures`` and
    ``min_beta`` are taken from it)."""

    n_temperatures: int = DEFAULT_N_TEMPERATURES
    min_beta: float = DEFAULT_MIN_BETA
    spacing: str = DEFAULT_SPACING
    betas: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.betas is not None:
            betas = tuple(float(b) for b in self.betas)
            _check_explicit(betas)
            object.__setattr__(self, "betas", betas)
            object.__setattr__(self, "n_temperatures", len(betas))
            object.__setattr__(self, "min_beta", betas[-1])
            return
        n = self.n_temperatures
        if not (isinstance(n, int) and 1 <= n <= MAX_TEMPERATURES):
            raise ValueError(
                f"n_temperatures must be an integer in [1, {MAX_TEMPERATURES}], got {n!r}"
            )
        beta = self.min_beta
        if not (isinstance(beta, int | float) and math.isfinite(beta) and 0 < beta < 1):
            raise ValueError(f"min_beta must be in (0, 1), got {beta!r}")
        if self.spacing not in SPACINGS:
            raise ValueError(f"spacing must be one of {SPACINGS}, got {self.spacing!r}")

    def ladder(self) -> list[float]:
        """The K inverse temperatures, β_0 = 1 first, strictly decreasing."""
        if self.betas is not None:
            return list(self.betas)
        n, low = self.n_temperatures, float(self.min_beta)
        if n == 1:
            return [1.0]
        if self.spacing == "geometric":
            return [low ** (k / (n - 1)) for k in range(n)]
        return [1.0 - (1.0 - low) * k / (n - 1) for k in range(n)]

    def to_dict(self) -> dict[str, object]:
        """JSON-serializable; :meth:`from_dict` rebuilds the same ladder."""
        if self.betas is not None:
            return {"betas": list(self.betas)}
        return {
            "n_temperatures": self.n_temperatures,
            "min_beta": self.min_beta,
            "spacing": self.spacing,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> TemperingConfig:
        if "betas" in data:
            return cls(betas=tuple(data["betas"]))  # type: ignore[arg-type]
        return cls(**data)  # type: ignore[arg-type]


def _check_explicit(betas: tuple[float, ...]) -> None:
    if not 1 <= len(betas) <= MAX_TEMPERATURES:
        raise ValueError(f"betas must list 1 to {MAX_TEMPERATURES} values, got {len(betas)}")
    if betas[0] != 1.0:
        raise ValueError(f"betas must start at 1 (the model itself), got {betas[0]}")
    if not all(math.isfinite(b) and b > 0 for b in betas):
        raise ValueError(f"betas must be finite and > 0, got {list(betas)}")
    if any(low >= high for high, low in itertools.pairwise(betas)):
        raise ValueError(f"betas must be strictly decreasing, got {list(betas)}")


def visible_energy(model: RBM, v: torch.Tensor) -> torch.Tensor:
    """q(v) (B,): the visible-only part of the energy, -bᵀv or ½(v - b)ᵀC⁻¹(v - b)."""
    if isinstance(model, GaussianRBM):
        centered = v - model.b.detach()
        return 0.5 * (model.apply_precision(centered) * centered).sum(dim=1)
    return -(v @ model.b.detach())


def tempered_log_marginal(model: RBM, v: torch.Tensor, beta: float) -> torch.Tensor:
    """log p̃_β(v) (B,), unnormalized: -β q(v) + Σ_j softplus(β x_j(v))."""
    x = model.hidden_input(v)
    return -beta * visible_energy(model, v) + F.softplus(beta * x).sum(dim=1)


def swap_log_acceptance(
    beta_i: torch.Tensor | float,
    beta_j: torch.Tensor | float,
    q_i: torch.Tensor,
    q_j: torch.Tensor,
    x_i: torch.Tensor,
    x_j: torch.Tensor,
) -> torch.Tensor:
    """log of the Metropolis ratio for exchanging v_i (at β_i) and v_j (at β_j), before min(0, ·).
    ``q_*`` are visible energies (M,), ``x_*`` hidden inputs (M, H); the β arguments are floats or
    tensors that broadcast against q (e.g. (P, 1) for P pairs of (P, M) chains)."""
    bi, bj = _per_unit(beta_i), _per_unit(beta_j)
    cross = F.softplus(bi * x_j).sum(-1) + F.softplus(bj * x_i).sum(-1)
    own = F.softplus(bi * x_i).sum(-1) + F.softplus(bj * x_j).sum(-1)
    return (beta_i - beta_j) * (q_i - q_j) + cross - own


def _per_unit(beta: torch.Tensor | float) -> torch.Tensor | float:
    """β with one more trailing axis, so that it multiplies x's hidden units."""
    return beta.unsqueeze(-1) if isinstance(beta, torch.Tensor) else beta


class ParallelTempering:
    """Persistent chains at every temperature of a ladder, and the swaps between them. ``chains``
    (K, M, H) holds binary hidden states, temperature 0 (β = 1) first; ``run`` advances them one PCD
    step and writes the β = 1 negative phase where the estimator reads it. Random draws come from
    the estimator's :class:`~ssdcore.sampling.RandomSource`."""

    def __init__(self, config: TemperingConfig, model: RBM, source: RandomSource):
        self.config = config
        self.model = model
        self.source = source
        device = model.W.device
        betas = config.ladder()
        self.n_temperatures = len(betas)
        self.betas = torch.tensor(betas, device=device, dtype=torch.float32)  # (K,)
        self.chains: torch.Tensor | None = None  # (K, M, H)
        n_pairs = max(self.n_temperatures - 1, 0)
        self.swap_rates = torch.zeros(n_pairs, device=device, dtype=torch.float64)
        self.swap_attempts = torch.zeros(n_pairs, device=device, dtype=torch.int64)
        # 0: this step swaps the even pairs (0,1), (2,3), ...; 1: the odd ones.
        self.parity = torch.zeros((), device=device, dtype=torch.int64)
        self._pair_index = torch.arange(n_pairs, device=device)
        self._buffers: _Buffers | None = None

    @torch.no_grad()
    def run(
        self,
        kernel: GibbsKernel,
        k: int,
        start: torch.Tensor | None,
        visible_out: torch.Tensor,
        hidden_probs_out: torch.Tensor,
    ) -> None:
        """One PCD step: k sweeps at every β, one round of swaps, fresh hidden states. ``start``
        (M, H) binary hidden states start every temperature's chains when there are none yet;
        afterwards it is ignored. On return ``visible_out`` (M, V) holds the β = 1 chains' visible
        states and ``hidden_probs_out`` (M, H) their p(h | v)."""
        if self.chains is None:
            if start is None:
                raise ValueError("the first tempering step needs starting hidden states")
            self.chains = start.unsqueeze(0).repeat(self.n_temperatures, 1, 1)
        K, M, H = self.chains.shape
        buf = self._buffers_for(M)
        hidden = self.chains.view(K * M, H)
        for sweep in range(k):
            self._sample_visible(kernel, hidden, buf)
            torch.addmm(kernel.hidden_bias, buf.visible, kernel.hidden_weight, out=buf.inputs)
            if sweep < k - 1:
                torch.mul(buf.inputs, buf.row_betas, out=buf.probs).sigmoid_()
                hidden = self.source.bernoulli_(buf.probs, out=buf.hidden)
        if K > 1:
            self._swap(buf, K, M)
        torch.mul(buf.inputs, buf.row_betas, out=buf.probs).sigmoid_()
        visible_out.copy_(buf.visible[:M])
        hidden_probs_out.copy_(buf.probs[:M])
        self.source.bernoulli_(buf.probs, out=self.chains.view(K * M, H))

    def _sample_visible(self, kernel: GibbsKernel, hidden: torch.Tensor, buf: _Buffers) -> None:
        out = torch.addmm(kernel.visible_bias, hidden, kernel.weight_t, out=buf.visible)
        if not kernel.gaussian:
            out.mul_(buf.row_betas)
            self.source.bernoulli_(out.sigmoid_(), out=out)
            return
        # N(m, C/β): the β = 1 noise, scaled by 1/sqrt(β) per row.
        out.addcmul_(kernel.correlate_(self.source.normal_(buf.noise)), buf.row_noise_scale)

    def _swap(self, buf: _Buffers, K: int, M: int) -> None:
        """Metropolis exchanges of v (and its hidden input) between neighbours of this parity."""
        visible = buf.visible.view(K, M, -1)
        inputs = buf.inputs.view(K, M, -1)
        q = visible_energy(self.model, buf.visible).view(K, M)
        betas = self.betas.unsqueeze(-1)  # (K, 1)
        log_ratio = swap_log_acceptance(
            betas[:-1], betas[1:], q[:-1], q[1:], inputs[:-1], inputs[1:]
        )  # (K-1, M)
        uniform = torch.rand(
            log_ratio.shape, generator=self.source.generator, out=buf.uniform
        )  # float64 in [0, 1)
        active = (self._pair_index % 2) == self.parity  # (K-1,)
        # accept ⇔ u < exp(log_ratio), for u in [0, 1): 1 - u in (0, 1] keeps log finite.
        accept = torch.log1p(-uniform) < log_ratio.double()
        accept &= active.unsqueeze(-1)
        self._record(accept, active)
        # Pairs of one parity are disjoint: temperature t takes t+1's state when pair t
        # swaps, t-1's when pair t-1 swaps, and keeps its own otherwise.
        from_above = torch.zeros(K, M, 1, dtype=torch.bool, device=accept.device)
        from_below = torch.zeros_like(from_above)
        from_above[:-1, :, 0] = accept
        from_below[1:, :, 0] = accept
        for state in (visible, inputs):
            above = torch.roll(state, -1, dims=0)
            below = torch.roll(state, 1, dims=0)
            swapped = torch.where(from_above, above, torch.where(from_below, below, state))
            state.copy_(swapped)
        self.parity.bitwise_xor_(1)

    def _record(self, accept: torch.Tensor, active: torch.Tensor) -> None:
        """Running swap rate per pair: a mean over the first window, then an exponential one."""
        self.swap_attempts += active
        weight = 1.0 / self.swap_attempts.clamp(min=1, max=SWAP_RATE_WINDOW).double()
        step_rate = accept.double().mean(dim=1)
        update = (step_rate - self.swap_rates) * weight
        self.swap_rates += torch.where(active, update, torch.zeros_like(update))

    def _buffers_for(self, n_chains: int) -> _Buffers:
        if self._buffers is None or self._buffers.n_chains != n_chains:
            self._buffers = _Buffers(self.model, self.betas, n_chains)
        return self._buffers

    def visible_states(self) -> torch.Tensor:
        """(K, M, V) every temperature's visible states after the last step (after its swaps)."""
        if self._buffers is None or self.chains is None:
            raise RuntimeError("no tempering step has run yet")
        return self._buffers.visible.view(self.n_temperatures, -1, self.model.n_visible)

    def swap_rate_list(self) -> list[float]:
        """Each neighbour pair's running swap rate (K - 1 values; pairs not yet tried: 0)."""
        return [float(r) for r in self.swap_rates.cpu()]

    def metrics(self) -> dict[str, object]:
        """``pt_swap_rate_min``, ``pt_swap_rate_mean`` and ``pt_swap_rates`` (empty for K = 1)."""
        if self.n_temperatures < 2:
            return {}
        rates = self.swap_rate_list()
        return {
            "pt_swap_rate_min": min(rates),
            "pt_swap_rate_mean": sum(rates) / len(rates),
            "pt_swap_rates": rates,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {
            "swap_rates": self.swap_rates.cpu().clone(),
            "swap_attempts": self.swap_attempts.cpu().clone(),
            "parity": self.parity.cpu().clone().reshape(1),
        }
        if self.chains is not None:
            state["chains"] = self.chains.cpu().clone()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        device = self.betas.device
        rates = state["swap_rates"]
        if rates.shape != self.swap_rates.shape:
            raise ValueError(
                f"saved tempering state has {rates.shape[0] + 1} temperatures; this ladder has "
                f"{self.n_temperatures}: resume with the same tempering settings"
            )
        self.swap_rates = rates.to(device, torch.float64).clone()
        self.swap_attempts = state["swap_attempts"].to(device, torch.int64).clone()
        self.parity = state["parity"].to(device, torch.int64).reshape(()).clone()
        chains = state.get("chains")
        if chains is None:
            self.chains = None
            return
        expected = (self.n_temperatures, self.model.n_hidden)
        if chains.ndim != 3 or (chains.shape[0], chains.shape[2]) != expected:
            raise ValueError(
                f"saved tempering chains have shape {tuple(chains.shape)}; expected "
                f"({expected[0]}, n, {expected[1]})"
            )
        self.chains = chains.to(device, torch.float32).clone()


class _Buffers:
    """Per-chain-count buffers, every temperature's rows stacked: rows [t·M, (t+1)·M) are β_t."""

    def __init__(self, model: RBM, betas: torch.Tensor, n_chains: int):
        f32 = {"device": betas.device, "dtype": torch.float32}
        K, V, H = betas.shape[0], model.n_visible, model.n_hidden
        rows = K * n_chains
        self.n_chains = n_chains
        self.row_betas = betas.repeat_interleave(n_chains).unsqueeze(1)  # (K·M, 1)
        self.row_noise_scale = self.row_betas.rsqrt()
        self.visible = torch.empty(rows, V, **f32)
        self.inputs = torch.empty(rows, H, **f32)  # x = vᵀC⁻¹W + a, β-free
        self.probs = torch.empty(rows, H, **f32)
        self.hidden = torch.empty(rows, H, **f32)
        self.noise = torch.empty(rows, V, **f32)
        self.uniform = torch.empty(
            max(K - 1, 0), n_chains, device=betas.device, dtype=torch.float64
        )
