"""Stochastic gradient descent with momentum or Nesterov momentum: the paper's baseline."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ssdcore.batched import add_scaled_
from ssdcore.optim.projection import project_spectral_norm_

# The optimizer state's key of a parameter's momentum buffer (torch.optim.SGD's name).
MOMENTUM_BUFFER = "momentum_buffer"


def check_hyperparameters(group: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the first invalid hyperparameter of a parameter group (or of
    an optimizer's defaults); the settings every optimizer here shares."""
    lr, momentum, nesterov = group["lr"], group["momentum"], group["nesterov"]
    weight_decay, max_spectral_norm = group["weight_decay"], group["max_spectral_norm"]
    if not (isinstance(lr, int | float) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"Invalid learning rate: {lr!r} (must be a finite number > 0)")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"Invalid momentum value: {momentum!r} (must be in [0, 1))")
    if nesterov and momentum <= 0:
        raise ValueError(f"Nesterov momentum requires momentum > 0, got momentum={momentum!r}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be >= 0)")
    if max_spectral_norm is not None and not (
        math.isfinite(max_spectral_norm) and max_spectral_norm > 0
    ):
        raise ValueError(
            f"Invalid max_spectral_norm value: {max_spectral_norm!r} (must be > 0, or None)"
        )


def check_parameter(param: Tensor) -> None:
    """Refuse what the update rules do not cover: sparse gradients and tensors beyond 2-D."""
    if param.grad is not None and param.grad.is_sparse:
        raise RuntimeError("sparse gradients are not supported; use a dense gradient")
    if param.ndim > 2:
        raise ValueError(
            f"parameters must be scalars, vectors or matrices, got shape {tuple(param.shape)}"
        )


def euclidean_update_(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> None:
    """One (heavy-ball or Nesterov) SGD step in place, with the buffer kept in ``state``. Momentum
    follows PyTorch's convention ``buf = momentum * buf + grad``; Nesterov steps along
    ``grad + momentum * buf``."""
    if momentum == 0:
        add_scaled_(param, grad, -lr)
        return
    buffer = state.get(MOMENTUM_BUFFER)
    if buffer is None:
        buffer = state[MOMENTUM_BUFFER] = grad.clone()
    else:
        buffer.mul_(momentum).add_(grad)
    momentum_step_(
        param, grad, buffer, neg_lr=-lr, neg_lr_momentum=-lr * momentum, nesterov=nesterov
    )


def momentum_step_(
    param: Tensor,
    grad: Tensor,
    buffer: Tensor,
    *,
    neg_lr: float | Tensor,
    neg_lr_momentum: float | Tensor,
    nesterov: bool,
) -> None:
    """The step along an updated momentum buffer: ``p -= lr·buf``, Nesterov's
    ``p -= lr·grad + lr·momentum·buf``. For one parameter (numbers) or a stack of M runs'
    (per-run values shaped to broadcast, :func:`ssdcore.batched.add_scaled_`)."""
    if nesterov:
        add_scaled_(param, grad, neg_lr)
        add_scaled_(param, buffer, neg_lr_momentum)
    else:
        add_scaled_(param, buffer, neg_lr)


class OptimizerBase(Optimizer):
    """What every optimizer here shares: the defaults and every parameter group (those added
    later included) pass :meth:`check_group`, and a step runs the closure, then for each
    parameter with a gradient checks it, applies the decoupled decay, the optimizer's own
    :meth:`update_` and the ‖W‖₂ projection."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict) -> None:
        self.check_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.check_group(self.param_groups[-1])

    def check_group(self, group: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` naming the group's first invalid setting."""
        check_hyperparameters(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Take one step for every parameter with a gradient (or gradient factors)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():  # a step runs under no_grad; its closure needs gradients
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                gradient = self.take_gradient(param)
                if gradient is None:
                    continue
                check_parameter(param)
                # Decoupled weight decay, kept out of the gradient (which stays low-rank).
                if group["weight_decay"] != 0:
                    param.mul_(1 - group["lr"] * group["weight_decay"])
                self.update_(param, gradient, group)
                if group["max_spectral_norm"] is not None and param.ndim == 2:
                    project_spectral_norm_(param, group["max_spectral_norm"])
        return loss

    def take_gradient(self, param: Tensor) -> Any:
        """What :meth:`update_` steps along; None when ``param`` has no gradient this step."""
        return dense_gradient(param)

    def update_(self, param: Tensor, gradient: Any, group: dict[str, Any]) -> None:
        """The optimizer's own update of ``param`` (between the decay and the projection)."""
        raise NotImplementedError


class SGD(OptimizerBase):
    """SGD with optional momentum / Nesterov momentum, decoupled weight decay and a ‖W‖₂ bound.

    Args:
        params: parameters or parameter groups (dicts may override any keyword below).
        lr: step size, > 0.
        momentum: heavy-ball momentum in [0, 1).
        nesterov: use Nesterov momentum (needs momentum > 0).
        weight_decay: decoupled decay, ``p *= 1 - lr * weight_decay`` before each step.
        max_spectral_norm: project matrices onto ‖W‖₂ ≤ R after each step (the paper's R).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.0,
        *,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        max_spectral_norm: float | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "max_spectral_norm": max_spectral_norm,
        }
        super().__init__(params, defaults)

    def update_(self, param: Tensor, gradient: Tensor, group: dict[str, Any]) -> None:
        euclidean_update_(
            param,
            gradient,
            self.state[param],
            lr=group["lr"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
        )

    def capturable(self) -> bool:
        """Whether :meth:`step` can be captured in a CUDA graph (see :mod:`ssdcore.cuda_graph`). The
        ‖W‖₂ projection decides on the host whether to take an SVD, which needs a sync."""
        return all(group["max_spectral_norm"] is None for group in self.param_groups)


def dense_gradient(param: Tensor) -> Tensor | None:
    """``param.grad``, or the product of its low-rank factors when only those were given. Consumes
    ``param.grad_factors`` (see :mod:`ssdcore.optim.ssd`) so stale factors never outlive the step
    they were computed for."""
    factors = getattr(param, "grad_factors", None)
    if factors is not None:
        param.grad_factors = None
    if param.grad is not None:
        return param.grad
    if factors is not None:
        left, right = factors
        return left @ right
    return None
