"""Per-run optimizer steps for a pack: SGD, Nesterov, SSD (both step rules) and the hybrids.

The pack reads the parameter groups :func:`ssdcore.optim.build_optimizer` would build for each
run's :class:`~ssdcore.optim.OptimizerConfig` and takes the solo optimizer's own steps
(:mod:`ssdcore.optim.sgd`, :mod:`ssdcore.optim.ssd`, :mod:`ssdcore.optim.polar`) on the stack,
with per-run scalars as (M, 1) / (M, 1, 1) columns (:mod:`ssdcore.batched`). Runs may differ in
step size, momentum, weight decay and schedule; the *rule* of each parameter
(:class:`ParameterRule`) must be the same for every run of a pack: it decides which batched
kernels run. Not supported (ValueError naming the setting): ``ssd-preconditioned``, the
``randomized`` polar method and ``max_spectral_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ssdcore.batched import add_scaled_, stacked_empty
from ssdcore.models.base import RBM
from ssdcore.optim.config import OptimizerConfig, build_optimizer
from ssdcore.optim.polar import (
    FactoredPolar,
    polar_gram_factors,
    polar_newton_schulz,
    polar_newton_schulz_factors,
    polar_svd,
)
from ssdcore.optim.sgd import momentum_step_
from ssdcore.optim.ssd import apply_factored_, apply_polar_, linf_step_, takes_factors_only
from ssdcore.optim.step_rules import DEFAULT_STEP_RULE, spectral_length
from ssdcore.schedules import step_size

PACKED_POLAR_METHODS = ("lowrank", "svd", "newton-schulz")


@dataclass(frozen=True)
class ParameterRule:
    """How one parameter is updated; equal across the runs of a pack."""

    geometry: str  # "euclidean" | "spectral"
    nesterov: bool = False  # euclidean
    method: str = ""  # spectral matrices: lowrank | svd | newton-schulz ("" for vectors)
    step_rule: str = DEFAULT_STEP_RULE  # spectral: paper | normalized (ssdcore.optim.step_rules)


@dataclass(frozen=True)
class RunSettings:
    """One run's numbers for one parameter (what may differ between runs)."""

    lr: float
    momentum: float
    weight_decay: float


def parameter_groups(config: OptimizerConfig, template: RBM) -> dict:
    """``{name: group}`` of the optimizer the solo trainer would build for ``config`` on a
    model like ``template`` (its kind, variance form, shape and device)."""
    optimizer = build_optimizer(template, config)
    return {group["name"]: group for group in optimizer.param_groups}


def rule_and_settings(name: str, group: dict[str, Any]) -> tuple[ParameterRule, RunSettings]:
    """The rule and numbers of a solo parameter group; ValueError for what packs do not run."""
    if group.get("max_spectral_norm") is not None:
        raise ValueError(
            f"OptimizerConfig.max_spectral_norm is not supported in a pack (parameter {name}); "
            "train this run with the solo Trainer, or drop the bound"
        )
    if group.get("preconditioner") is not None:
        raise ValueError(
            "OptimizerConfig.name 'ssd-preconditioned' is not supported in a pack; train this "
            "run with the solo Trainer"
        )
    settings = RunSettings(
        float(group["lr"]), float(group.get("momentum", 0.0)), float(group["weight_decay"])
    )
    if group.get("geometry", "euclidean") == "euclidean":
        return ParameterRule("euclidean", nesterov=bool(group["nesterov"])), settings
    step_rule = group["step_rule"]
    if name != "W":
        return ParameterRule("spectral", step_rule=step_rule), settings
    if group["method"] not in PACKED_POLAR_METHODS:
        raise ValueError(
            f"OptimizerConfig.method {group['method']!r} is not supported in a pack; choose one "
            f"of {PACKED_POLAR_METHODS}"
        )
    return ParameterRule("spectral", method=group["method"], step_rule=step_rule), settings


def needs_dense_weight_gradient(rule: ParameterRule, shape: tuple[int, int], rank: int) -> bool:
    """Whether W's step reads the dense gradient (as :meth:`ssdcore.optim.SSD.needs_dense_gradient`:
    only Newton–Schulz in factor space, with factors thinner than W, does without it here)."""
    return not (rule.method == "newton-schulz" and rank < min(shape))


class PackedOptimizer:
    """Steps for parameters stacked over M runs, with per-run step sizes and settings.

    Args:
        rules: ``{parameter name: ParameterRule}``, shared by all runs.
        settings: per run, ``{parameter name: RunSettings}`` (base step sizes, before scaling).
        shapes: ``{parameter name: per-run shape}``.
        device: where the parameters live.
    """

    def __init__(
        self,
        rules: dict[str, ParameterRule],
        settings: list[dict[str, RunSettings]],
        shapes: dict[str, tuple[int, ...]],
        device: torch.device,
    ) -> None:
        self.rules = rules
        self.settings = settings
        self.device = device
        self.lr_scales = [1.0] * len(settings)
        # Each run's schedule factor at its current step (1 for a constant schedule).
        self.schedule_factors = [1.0] * len(settings)
        n = len(settings)
        # Momentum buffers (zero until a run's first step: 0·m + g is g, as the solo clone).
        self.momentum_buffers = {
            name: stacked_empty(n, shapes[name], device=device).zero_()
            for name, rule in rules.items()
            if rule.geometry == "euclidean"
        }
        self.has_buffer = {name: [False] * n for name in self.momentum_buffers}
        self._refresh()

    def lr(self, run: int, name: str) -> float:
        """Run ``run``'s current step size for parameter ``name``: base × (schedule factor ×
        backoff scale), by the solo Trainer's :func:`~ssdcore.schedules.step_size`."""
        return step_size(
            self.settings[run][name].lr, self.schedule_factors[run], self.lr_scales[run]
        )

    def set_lr_scale(self, run: int, scale: float) -> None:
        self.lr_scales[run] = float(scale)
        self._refresh()

    def set_schedule_factors(self, factors: list[float]) -> None:
        """Every run's schedule factor for the coming step; the per-run columns are rebuilt only
        when some factor changed."""
        if factors != self.schedule_factors:
            self.schedule_factors = list(factors)
            self._refresh()

    def set_run(self, run: int, settings: dict[str, RunSettings], lr_scale: float) -> None:
        """Give slot ``run`` another run's settings (same rules) and forget its buffers."""
        self.settings[run] = settings
        self.lr_scales[run] = float(lr_scale)
        self.load_run_buffers(run, {})
        self._refresh()

    def _column(self, values: list[float], name: str) -> Tensor:
        """Per-run float64 values rounded to float32 as a solo kernel rounds its scalar."""
        view = (-1,) + (1,) * (2 if name == "W" else 1)
        return torch.tensor(values, dtype=torch.float32, device=self.device).view(view)

    def _refresh(self) -> None:
        """Rebuild the per-run scalar columns after a step size or run changed."""
        self._neg_lr, self._neg_lr_momentum, self._momentum, self._decay = {}, {}, {}, {}
        self._lrs: dict[str, list[float]] = {}
        for name in self.rules:
            lrs = [self.lr(run, name) for run in range(len(self.settings))]
            momenta = [run[name].momentum for run in self.settings]
            decays = [run[name].weight_decay for run in self.settings]
            self._lrs[name] = lrs
            self._neg_lr[name] = self._column([-lr for lr in lrs], name)
            self._neg_lr_momentum[name] = self._column(
                [-lr * m for lr, m in zip(lrs, momenta, strict=True)], name
            )
            self._momentum[name] = self._column(momenta, name)
            has_decay = any(d != 0 for d in decays)
            self._decay[name] = (
                self._column([1 - lr * d for lr, d in zip(lrs, decays, strict=True)], name)
                if has_decay
                else None
            )

    @torch.no_grad()
    def step(
        self,
        parameters: dict[str, Tensor],
        gradients: dict[str, Tensor | None],
        weight_factors: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """One step of every run; ``gradients["W"]`` may be None when only factors are given."""
        for name, rule in self.rules.items():
            parameter, grad = parameters[name], gradients[name]
            if self._decay[name] is not None:
                parameter.mul_(self._decay[name])
            if rule.geometry == "euclidean":
                if grad is None:
                    assert weight_factors is not None
                    grad = torch.bmm(*weight_factors)
                self._euclidean_(name, parameter, grad, rule)
            elif parameter.ndim == 3:
                self._spectral_matrix_(name, parameter, grad, weight_factors, rule)
            else:
                linf_step_(parameter, grad, self._neg_lr[name], rule.step_rule)

    def _euclidean_(self, name: str, parameter: Tensor, grad: Tensor, rule: ParameterRule) -> None:
        momenta = [run[name].momentum for run in self.settings]
        if not any(m != 0 for m in momenta):
            add_scaled_(parameter, grad, self._neg_lr[name])
            return
        buffer = self.momentum_buffers[name]
        buffer.mul_(self._momentum[name]).add_(grad)
        self.has_buffer[name] = [
            has or m != 0 for has, m in zip(self.has_buffer[name], momenta, strict=True)
        ]
        momentum_step_(
            parameter,
            grad,
            buffer,
            neg_lr=self._neg_lr[name],
            neg_lr_momentum=self._neg_lr_momentum[name],
            nesterov=rule.nesterov,
        )

    def _spectral_matrix_(
        self,
        name: str,
        parameter: Tensor,
        grad: Tensor | None,
        factors: tuple[Tensor, Tensor] | None,
        rule: ParameterRule,
    ) -> None:
        if grad is None:  # Newton–Schulz in factor space (needs_dense_weight_gradient)
            assert factors is not None and rule.method == "newton-schulz"
            polar = polar_newton_schulz_factors(*factors)
        elif rule.method == "lowrank":
            polar = polar_gram_factors(grad)
        elif rule.method == "svd":
            polar = polar_svd(grad)
        else:
            polar = polar_newton_schulz(grad)
        length = self._spectral_length(rule, polar.nuclear_norm, grad, factors, parameter.shape)
        polar = polar._replace(nuclear_norm=length)
        if isinstance(polar, FactoredPolar):
            apply_factored_(parameter, polar, self._lrs[name])
        else:
            apply_polar_(parameter, polar, self._neg_lr[name])

    @staticmethod
    def _spectral_length(
        rule: ParameterRule,
        nuclear_norm: Tensor,
        grad: Tensor | None,
        factors: tuple[Tensor, Tensor] | None,
        stacked_shape: torch.Size,
    ) -> Tensor:
        """(M,) factor on each run's ``-lr·D`` by :func:`ssdcore.optim.step_rules.spectral_length`,
        with what the solo step has: the solo SSD always has the CD factors, and takes
        ``‖G‖_F²`` from them where it has no dense gradient."""
        shape = (stacked_shape[-2], stacked_shape[-1])
        rank = factors[0].shape[-1] if factors is not None else min(shape)
        use_factors = grad is None or takes_factors_only(rule.method, shape, rank)
        dense = None if use_factors else grad
        return spectral_length(nuclear_norm, rule.step_rule, dense, factors, stacked_shape)

    def run_buffers(self, run: int) -> dict[str, Tensor]:
        """Run ``run``'s momentum buffers, as the solo optimizer's state holds them."""
        return {
            name: buffer[run].clone()
            for name, buffer in self.momentum_buffers.items()
            if self.has_buffer[name][run]
        }

    def load_run_buffers(self, run: int, buffers: dict[str, Tensor]) -> None:
        for name, buffer in self.momentum_buffers.items():
            saved = buffers.get(name)
            self.has_buffer[name][run] = saved is not None
            if saved is None:
                buffer[run].zero_()
            else:
                buffer[run].copy_(saved)
