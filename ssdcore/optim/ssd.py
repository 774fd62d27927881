"""Stochastic Spectral Descent (Carlson, Cevher & Carin 2015; Fan): steepest descent in S∞ / l∞.

Matrices take the S∞ step ``W -= lr * ‖σ(G)‖₁ * U Vᵀ``, vectors the l∞ step
``x -= lr * ‖g‖₁ * sign(g)``: the minimisers of the paper's bound ``⟨G, Δ⟩ + c ‖Δ‖²`` in each
norm. ``geometry="euclidean"`` makes a group take a plain SGD step, so the paper's hybrids are a
matter of grouping; ``step_rule="normalized"`` keeps the direction at the SGD step's length
(:mod:`ssdcore.optim.step_rules`).

Low-rank gradients: an estimator may attach ``param.grad_factors = (left, right)`` with
``param.grad == left @ right`` (the CD weight gradient has rank ≤ 2B), and may leave
``param.grad`` None. ``method="lowrank"`` then takes the exact step from the factors
(:func:`~ssdcore.optim.polar.polar_lowrank_factors`) when their rank is below both sides, else
from the dense gradient's small Gram matrix; ``"newton-schulz"`` iterates in the factors' space
when it has factors only. The optimizer consumes the factors every step, and with a dense
gradient present a one-vector probe ``grad @ x == left @ (right @ x)`` guards against stale
ones (which fall back to the dense Gram route).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ssdcore.batched import add_product_, add_scaled_product_, per_matrix_scalar
from ssdcore.optim.polar import (
    FactoredPolar,
    Polar,
    polar_gram,
    polar_gram_factors,
    polar_lowrank_factors,
    polar_newton_schulz,
    polar_newton_schulz_factors,
    polar_randomized,
    polar_svd,
)
from ssdcore.optim.sgd import (
    OptimizerBase,
    check_hyperparameters,
    euclidean_update_,
)
from ssdcore.optim.step_rules import (
    DEFAULT_STEP_RULE,
    check_step_rule,
    linf_length,
    spectral_length,
)

logger = logging.getLogger(__name__)

METHODS = ("svd", "lowrank", "randomized", "newton-schulz")
# Methods that take the step from the gradient's low-rank factors when those are thinner than
# the matrix; their producer may then skip the dense gradient.
FACTORED_METHODS = ("lowrank", "newton-schulz")
GEOMETRIES = ("spectral", "euclidean")
PRECONDITIONERS = (None, "rmsprop", "adam")
# Randomized sketch rank when none is given: enough for the leading part of a CD gradient;
# the residual correction accounts for the rest.
DEFAULT_SKETCH_RANK = 64
# Relative mismatch of the factor probe above which factors are treated as stale; float32
# rounding of a rank-400 product stays around 1e-5.
STALE_FACTOR_TOLERANCE = 1e-3
# Seeds the randomized sketch from the parameter's step count, so runs and resumes repeat.
SKETCH_SEED = 0x55D


class SSD(OptimizerBase):
    """Stochastic Spectral Descent with per-group geometry and polar method.

    Args:
        params: parameters or parameter groups (dicts may override any keyword below).
        lr: step size, > 0.
        method: how matrices get ``U Vᵀ`` and ``‖σ(G)‖₁``: ``"lowrank"`` (exact, see the module
            docstring), ``"svd"``, ``"randomized"`` or ``"newton-schulz"``.
        geometry: ``"spectral"`` (the SSD step) or ``"euclidean"`` (a plain SGD step).
        momentum, nesterov: SGD momentum, for ``geometry="euclidean"`` groups only (a momentum
            buffer is full-rank, which would defeat the exact low-rank spectral step).
        weight_decay: decoupled decay ``p *= 1 - lr * weight_decay``, kept out of the gradient
            so that it stays low-rank.
        max_spectral_norm: project matrices onto ``‖W‖₂ ≤ R`` after each step (the paper's R).
        rank: sketch rank for ``"randomized"``; 0 means 64, or the factors' rank if smaller.
        step_rule: ``"paper"`` or ``"normalized"`` (:mod:`ssdcore.optim.step_rules`).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        *,
        method: str = "lowrank",
        geometry: str = "spectral",
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_spectral_norm: float | None = None,
        rank: int = 0,
        preconditioner: str | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        damping: float = 0.1,
        step_rule: str = DEFAULT_STEP_RULE,
    ) -> None:
        defaults = {
            "lr": lr,
            "method": method,
            "geometry": geometry,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "max_spectral_norm": max_spectral_norm,
            "rank": rank,
            "preconditioner": preconditioner,
            "betas": betas,
            "eps": eps,
            "damping": damping,
            "step_rule": step_rule,
        }
        super().__init__(params, defaults)
        self._sketch_generators: dict[torch.device, torch.Generator] = {}
        self._fallback_logged: set[int] = set()
        # Scratch space, not state: checkpoints need not carry it.
        self._sign_buffers: dict[Tensor, Tensor] = {}

    def check_group(self, group: Mapping[str, Any]) -> None:
        _check_group(group)

    def take_gradient(
        self, param: Tensor
    ) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None] | None:
        """The gradient and its low-rank factors (either may be missing; None when both are)."""
        factors = _take_factors(param)
        return None if param.grad is None and factors is None else (param.grad, factors)

    def update_(
        self,
        param: Tensor,
        gradient: tuple[Tensor | None, tuple[Tensor, Tensor] | None],
        group: dict[str, Any],
    ) -> None:
        grad, factors = gradient
        state = self.state[param]
        if _counts_steps(group):
            state["step"] = state.get("step", 0) + 1
        if group["geometry"] == "euclidean":
            grad = grad if grad is not None else factors[0] @ factors[1]
            euclidean_update_(
                param,
                grad,
                state,
                lr=group["lr"],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
            )
        elif group["preconditioner"] is not None:
            self._preconditioned_step(param, _dense(param, factors), state, group)
        elif param.ndim == 2:
            self._spectral_matrix_step(param, factors, state, group)
        else:
            self._linf_step_(param, grad, group["lr"], group["step_rule"])

    def capturable(self) -> bool:
        """Whether :meth:`step` can be captured in a CUDA graph (:mod:`ssdcore.cuda_graph`):
        only the Newton–Schulz polar step is tensor operations alone (the exact methods check
        ranks on the host, the randomized one reseeds from a step counter, the preconditioners
        count steps in Python, the ‖W‖₂ projection decides on the host)."""
        return all(_group_capturable(group) for group in self.param_groups)

    def needs_dense_gradient(self, param: Tensor, factor_rank: int) -> bool:
        """Whether :meth:`step` reads ``param.grad`` when given factors of rank ``factor_rank``
        (if not, the producer may attach just ``grad_factors``)."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                plain = group["geometry"] == "spectral" and group["preconditioner"] is None
                return not (
                    plain
                    and param.ndim == 2
                    and takes_factors_only(group["method"], param.shape, factor_rank)
                )
        return True

    def _spectral_matrix_step(
        self,
        param: Tensor,
        factors: tuple[Tensor, Tensor] | None,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> None:
        """S∞ step for a matrix, fusing the low-rank product into the update when possible."""
        lr, method, rule = group["lr"], group["method"], group["step_rule"]
        # Thin factors and no dense gradient to check them against (a host sync): factor space.
        thin = factors is not None and param.grad is None and factors_pay_off(param, factors)
        if method == "newton-schulz" and thin:
            polar = polar_newton_schulz_factors(*factors)
            apply_factored_(param, _with_rule(polar, rule, None, factors), lr)
            return
        if method == "lowrank":
            if factors is not None and not factors_pay_off(param, factors):
                # Both routes are exact; the dense Gram matrix is the smaller eigenproblem here.
                grad = _dense(param, factors)
                apply_factored_(param, _with_rule(polar_gram_factors(grad), rule, grad), lr)
                return
            if factors is not None and _factors_describe(param, factors):
                polar = polar_lowrank_factors(*factors)
                apply_factored_(param, _with_rule(polar, rule, param.grad, factors), lr)
                return
            if id(param) not in self._fallback_logged:
                logger.info(
                    "parameter of shape %s has no usable grad_factors; lowrank uses the dense "
                    "gradient's Gram matrix",
                    tuple(param.shape),
                )
                self._fallback_logged.add(id(param))
        grad = _dense(param, factors)
        polar = _with_rule(self._polar(grad, method, factors, state, group), rule, grad, factors)
        apply_polar_(param, polar, -lr)

    def _polar(
        self,
        grad: Tensor,
        method: str,
        factors: tuple[Tensor, Tensor] | None,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> Polar:
        """Dispatch to the polar method of a dense matrix gradient."""
        if method == "newton-schulz":
            return polar_newton_schulz(grad)
        if method == "randomized":
            rank = group["rank"] or min(
                DEFAULT_SKETCH_RANK, factors[0].shape[1] if factors is not None else grad.shape[0]
            )
            generator = self._sketch_generator(grad.device)
            generator.manual_seed(SKETCH_SEED + state["step"])
            return polar_randomized(grad, min(rank, *grad.shape), generator=generator)
        if method == "lowrank":
            return polar_gram(grad)
        return polar_svd(grad)

    def _sketch_generator(self, device: torch.device) -> torch.Generator:
        generator = self._sketch_generators.get(device)
        if generator is None:
            generator = self._sketch_generators[device] = torch.Generator(device=device)
        return generator

    def _linf_step_(self, param: Tensor, grad: Tensor, lr: float, rule: str) -> None:
        """l∞ step ``x -= lr * ‖g‖₁ * sign(g)`` (or the rule's length), with a scratch buffer
        kept out of the state."""
        sign = self._sign_buffers.get(param)
        if sign is None or sign.shape != grad.shape:
            sign = self._sign_buffers[param] = torch.empty_like(grad)
        linf_step_(param, grad, -lr, rule, sign=sign)

    def _preconditioned_step(
        self, param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Spectral / l∞ step in the diagonally rescaled geometry (see PreconditionedSSD)."""
        beta1, beta2 = group["betas"]
        step = state["step"]
        second = state.get("exp_avg_sq")
        if second is None:
            second = state["exp_avg_sq"] = torch.zeros_like(param)
        second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["preconditioner"] == "adam":
            first = state.get("exp_avg")
            if first is None:
                first = state["exp_avg"] = torch.zeros_like(param)
            first.lerp_(grad, 1 - beta1)
            grad = first / (1 - beta1**step)
        # D = max(sqrt(v̂), damping·mean sqrt(v̂)) + eps; the step is D^{-1/2} ⊙ #(D^{-1/2} ⊙ g),
        # with # the S∞ / l∞ step. The relative floor matters: # moves every coordinate by the
        # same norm, so without it a coordinate whose gradient is almost always zero (a pixel that
        # is never on) gets D ≈ eps and a step D^{-1/2} times larger than the rest — its bias ran
        # off to thousands on MNIST. The floor caps that ratio at damping^{-1/2}.
        root = (second / (1 - beta2**step)).sqrt_()
        if group["damping"] > 0:
            root.clamp_min_(group["damping"] * float(root.mean()))
        scale = root.add_(group["eps"]).rsqrt_()
        scaled_grad = grad * scale
        lr, rule = group["lr"], group["step_rule"]
        if param.ndim == 2:
            polar = _with_rule(
                self._polar(scaled_grad, group["method"], None, state, group), rule, scaled_grad
            )
            length = polar.nuclear_norm
            param.addcmul_(polar.direction.mul_(scale), length, value=-lr)
        else:
            length = linf_length(scaled_grad, rule)
            param.addcmul_(scaled_grad.sign_().mul_(scale), length, value=-lr)


def _counts_steps(group: dict[str, Any]) -> bool:
    """Whether the group's step reads a step counter (sketch seeds, bias corrections); others
    keep none, so that a step replayed from a CUDA graph leaves no stale count behind."""
    return group["method"] == "randomized" or group["preconditioner"] is not None


def _group_capturable(group: dict[str, Any]) -> bool:
    """See :meth:`SSD.capturable`."""
    if group["max_spectral_norm"] is not None or group["preconditioner"] is not None:
        return False
    if group["geometry"] == "euclidean":
        return True
    matrices = any(param.ndim == 2 for param in group["params"])
    return not matrices or group["method"] == "newton-schulz"


def _take_factors(param: Tensor) -> tuple[Tensor, Tensor] | None:
    """Read and clear ``param.grad_factors`` so they can only ever serve this step."""
    factors = getattr(param, "grad_factors", None)
    if factors is None:
        return None
    param.grad_factors = None
    left, right = factors
    rank = left.shape[-1]
    if (
        left.ndim != 2
        or right.ndim != 2
        or left.shape[0] != param.shape[0]
        or right.shape != (rank, param.shape[-1])
    ):
        raise ValueError(
            f"grad_factors of shapes {tuple(left.shape)} and {tuple(right.shape)} do not "
            f"multiply to the parameter's shape {tuple(param.shape)}"
        )
    return left, right


def takes_factors_only(method: str, shape: tuple[int, ...], rank: int) -> bool:
    """Whether the spectral step by ``method`` of a matrix of ``shape`` needs only the gradient's
    factors of rank ``rank`` (thinner than the matrix), so its producer may skip the dense
    gradient (the solo SSD's rule, which a pack follows)."""
    return method in FACTORED_METHODS and rank < min(shape[-2:])


def factors_pay_off(param: Tensor, factors: tuple[Tensor, Tensor]) -> bool:
    """Whether the factors' r×r eigenproblem is smaller than the dense gradient's Gram matrix. The
    factored route costs O((m + n) r²) and an r×r eigendecomposition, the dense one O(m n min(m, n))
    and a min(m, n)-sized one; with r ≥ min(m, n) (small models, large batches) the dense Gram
    matrix is the cheaper exact route. (Mirrored by needs_dense_gradient.)"""
    return factors[0].shape[1] < min(param.shape)


def _with_rule(
    polar: FactoredPolar | Polar,
    rule: str,
    grad: Tensor | None,
    factors: tuple[Tensor, Tensor] | None = None,
) -> FactoredPolar | Polar:
    """``polar`` with its nuclear norm replaced by the step rule's length (the same for
    ``"paper"``); see :mod:`ssdcore.optim.step_rules`."""
    if rule == "paper":
        return polar
    shape = (
        (polar.left.shape[0], polar.right.shape[1])
        if isinstance(polar, FactoredPolar)
        else tuple(polar.direction.shape)
    )
    length = spectral_length(polar.nuclear_norm, rule, grad, factors, shape)
    return polar._replace(nuclear_norm=length)


def apply_factored_(param: Tensor, polar: FactoredPolar, lr: float | Sequence[float]) -> None:
    """``W -= lr * ‖σ‖₁ * left @ right`` in one addmm, without an (m, n) temporary (for a stack
    of M runs' matrices: ``lr`` per run, one addmm each, :func:`ssdcore.batched.add_product_`).

    The norm scales the small right factor on the device rather than passing through a Python
    float, which would wait for the GPU and keep the step out of a CUDA graph.
    """
    alpha = -lr if isinstance(lr, float | int) else [-run_lr for run_lr in lr]
    add_product_(param, polar.left, polar.right * per_matrix_scalar(polar.nuclear_norm), alpha)


def apply_polar_(param: Tensor, polar: Polar, neg_lr: float | Tensor) -> None:
    """``W -= lr * ‖σ‖₁ * D`` for a dense polar factor D (for a stack of M runs' matrices,
    ``neg_lr`` per run: :func:`ssdcore.batched.add_scaled_product_`)."""
    add_scaled_product_(param, polar.direction, per_matrix_scalar(polar.nuclear_norm), neg_lr)


def linf_step_(
    param: Tensor, grad: Tensor, neg_lr: float | Tensor, rule: str, *, sign: Tensor | None = None
) -> None:
    """l∞ step ``x -= lr·length·sign(g)`` (length by the step rule), into the scratch ``sign``
    when given; for a vector or a stack of M runs' (``neg_lr`` per run, shaped ``(M, 1)``).
    ``(-lr)·sign`` is exact, so the two forms give the same bits."""
    sign = torch.sign(grad) if sign is None else torch.sign(grad, out=sign)
    add_scaled_product_(param, sign, linf_length(grad, rule), neg_lr)


def _factors_describe(param: Tensor, factors: tuple[Tensor, Tensor]) -> bool:
    """Whether ``left @ right`` still equals ``param.grad`` (probe with one vector, O(m n))."""
    if param.grad is None:
        return True
    left, right = factors
    probe = torch.ones(param.shape[1], 1, dtype=param.dtype, device=param.device)
    through_factors = right @ probe  # (r, 1)
    mismatch = torch.linalg.vector_norm(param.grad @ probe - left @ through_factors)
    reference = torch.linalg.matrix_norm(left) * torch.linalg.vector_norm(through_factors)
    return bool(mismatch <= STALE_FACTOR_TOLERANCE * reference)


def _dense(param: Tensor, factors: tuple[Tensor, Tensor] | None) -> Tensor:
    """The dense gradient: ``param.grad``, or the product of its factors."""
    if param.grad is not None:
        return param.grad
    if factors is None:
        raise RuntimeError("parameter has neither a gradient nor gradient factors")
    return factors[0] @ factors[1]


def _check_group(group: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first invalid setting of a parameter group."""
    check_hyperparameters(group)
    if group["method"] not in METHODS:
        raise ValueError(f"Invalid method: {group['method']!r} (choose one of {METHODS})")
    if group["geometry"] not in GEOMETRIES:
        raise ValueError(f"Invalid geometry: {group['geometry']!r} (choose one of {GEOMETRIES})")
    if group["preconditioner"] not in PRECONDITIONERS:
        raise ValueError(
            f"Invalid preconditioner: {group['preconditioner']!r} (choose one of {PRECONDITIONERS})"
        )
    if group["geometry"] == "spectral" and group["momentum"] != 0:
        raise ValueError(
            f"Invalid momentum value: {group['momentum']!r} for a spectral group; momentum "
            "applies to geometry='euclidean' groups only"
        )
    if group["geometry"] == "euclidean" and group["preconditioner"] is not None:
        raise ValueError("preconditioner applies to geometry='spectral' groups only")
    if group["preconditioner"] is not None and group["method"] == "lowrank":
        raise ValueError(
            "Invalid method: 'lowrank' with a preconditioner; the rescaled gradient is no "
            "longer low-rank, use 'svd', 'randomized' or 'newton-schulz'"
        )
    if not (isinstance(group["rank"], int) and group["rank"] >= 0):
        raise ValueError(f"Invalid rank value: {group['rank']!r} (must be an integer >= 0)")
    beta1, beta2 = group["betas"]
    if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"Invalid betas: {group['betas']!r} (each must be in [0, 1))")
    if not 0 <= group["damping"] <= 1:
        raise ValueError(f"Invalid damping value: {group['damping']!r} (must be in [0, 1])")
    if not group["eps"] > 0:
        raise ValueError(f"Invalid eps value: {group['eps']!r} (must be > 0)")
    check_step_rule(group["step_rule"])
