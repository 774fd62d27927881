"""One declarative optimizer configuration and the factory that turns it into parameter groups."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ssdcore.optim.preconditioned import PreconditionedSSD
from ssdcore.optim.sgd import SGD
from ssdcore.optim.ssd import METHODS, SSD
from ssdcore.optim.step_rules import DEFAULT_STEP_RULE, STEP_RULES
from ssdcore.schedules import DictForm, Schedule
from ssdcore.step_sizes import default_lr, model_key

OPTIMIZER_NAMES = ("sgd", "nesterov", "ssd", "ssd-preconditioned")
CONFIG_METHODS = ("auto", *METHODS)
CONFIG_PRECONDITIONERS = ("rmsprop", "adam")
# Nesterov without an explicit momentum uses the customary 0.9 (as the service contract says).
DEFAULT_NESTEROV_MOMENTUM = 0.9
# Weight decay and the ‖W‖₂ bound concern the interaction matrix only: decaying biases or the
# (log-)variances towards zero has no regularizing meaning.
WEIGHT_NAME = "W"


@dataclass
class OptimizerConfig(DictForm):
    """How to optimize an RBM; ``per_parameter`` turns it into one of the paper's hybrids.

    ``OptimizerConfig("sgd", per_parameter={"W": "ssd"})`` is SSD_W/SGD and
    ``OptimizerConfig("ssd", per_parameter={"W": "sgd"})`` is SGD_W/SSD. The two geometries'
    steps differ in scale by orders of magnitude, so each parameter whose optimizer differs from
    ``name`` takes its own step size: ``per_parameter_lr`` when given, else the table's default
    for its optimizer (:mod:`ssdcore.step_sizes`), never ``lr``.

    ``lr=None`` means the table's default for the model the config is applied to; it is resolved
    by :func:`build_optimizer` (or :meth:`resolved`, for callers that know only the model kind).
    """

    name: str = "ssd"  # sgd | nesterov | ssd | ssd-preconditioned
    lr: float | None = None  # step size, > 0; None: the step-size table's default for the model
    momentum: float | None = None  # sgd / nesterov groups; None: 0 for sgd, 0.9 for nesterov
    # polar method; auto: on the CPU lowrank for ssd, svd for ssd-preconditioned (whose
    # rescaled gradient has no low-rank factors, so lowrank there means its exact equivalent,
    # svd); on a CUDA device newton-schulz for both, since GPU eigen- and singular-value solvers
    # are slow at these sizes and need host syncs (measured on an H100 at 784x500 CD-10:
    # lowrank 4.1 ms, newton-schulz 0.88 ms per iteration; see docs/PERFORMANCE.md)
    method: str = "auto"
    preconditioner: str = "rmsprop"  # ssd-preconditioned: rmsprop | adam
    weight_decay: float = 0.0  # decoupled decay of W, >= 0
    max_spectral_norm: float | None = None  # the paper's R: keep ‖W‖₂ ≤ R; None or 0: unbounded
    rank: int = 0  # randomized sketch rank; 0 = automatic
    per_parameter: dict[str, str] = field(default_factory=dict)  # parameter name -> name
    # parameter name -> step size: hybrids need one per geometry (the steps differ in scale)
    per_parameter_lr: dict[str, float] = field(default_factory=dict)
    # SSD groups: "paper" (lr·‖σ(G)‖₁·UVᵀ) or "normalized" (UVᵀ at the SGD step's Euclidean
    # length lr·‖G‖_F), whose one lr holds across model sizes (ssdcore.optim.step_rules); each
    # rule has its own default lr in the step-size table
    step_rule: str = DEFAULT_STEP_RULE
    # step-size schedule the Trainer applies (ssdcore.schedules); constant by default
    schedule: Schedule = field(default_factory=Schedule)

    def __post_init__(self) -> None:
        if isinstance(self.schedule, dict):
            self.schedule = Schedule.from_dict(self.schedule)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first invalid field and how to fix it."""
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(
                f"OptimizerConfig.name: unknown optimizer {self.name!r}; "
                f"choose one of {OPTIMIZER_NAMES}"
            )
        if self.lr is not None and not _valid_lr(self.lr):
            raise ValueError(
                f"OptimizerConfig.lr must be a finite number > 0 (or None for the default), "
                f"got {self.lr!r}"
            )
        if self.momentum is not None and not 0 <= self.momentum < 1:
            raise ValueError(
                f"OptimizerConfig.momentum must be in [0, 1) or None, got {self.momentum!r}"
            )
        if self.method not in CONFIG_METHODS:
            raise ValueError(
                f"OptimizerConfig.method: unknown polar method {self.method!r}; "
                f"choose one of {CONFIG_METHODS}"
            )
        if self.preconditioner not in CONFIG_PRECONDITIONERS:
            raise ValueError(
                f"OptimizerConfig.preconditioner: unknown {self.preconditioner!r}; "
                f"choose one of {CONFIG_PRECONDITIONERS}"
            )
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay!r}"
            )
        if self.max_spectral_norm is not None and not (
            math.isfinite(self.max_spectral_norm) and self.max_spectral_norm >= 0
        ):
            raise ValueError(
                "OptimizerConfig.max_spectral_norm must be > 0 (or 0 / None for no bound), "
                f"got {self.max_spectral_norm!r}"
            )
        if not (isinstance(self.rank, int) and self.rank >= 0):
            raise ValueError(f"OptimizerConfig.rank must be an integer >= 0, got {self.rank!r}")
        for parameter, name in self.per_parameter.items():
            if name not in OPTIMIZER_NAMES:
                raise ValueError(
                    f"OptimizerConfig.per_parameter[{parameter!r}]: unknown optimizer {name!r}; "
                    f"choose one of {OPTIMIZER_NAMES}"
                )
        for parameter, lr in self.per_parameter_lr.items():
            if not _valid_lr(lr):
                raise ValueError(
                    f"OptimizerConfig.per_parameter_lr[{parameter!r}] must be a finite number > 0, "
                    f"got {lr!r}"
                )
        if self.step_rule not in STEP_RULES:
            raise ValueError(
                f"OptimizerConfig.step_rule: unknown step rule {self.step_rule!r}; "
                f"choose one of {STEP_RULES}"
            )
        if not isinstance(self.schedule, Schedule):
            raise ValueError(
                f"OptimizerConfig.schedule must be an ssdcore.schedules.Schedule (or its dict), "
                f"got {self.schedule!r}"
            )

    @property
    def is_resolved(self) -> bool:
        """Whether every step size is explicit (nothing left for the step-size table)."""
        return self.lr is not None and all(
            name == self.name or parameter in self.per_parameter_lr
            for parameter, name in self.per_parameter.items()
        )

    def resolved(
        self, model_kind: str, variance: str | None = None, steps: int | None = None
    ) -> OptimizerConfig:
        """A copy with every step size explicit, defaults taken from the step-size table.

        ``lr`` (when None) becomes the table's value for ``name``; each ``per_parameter``
        override with another optimizer and no ``per_parameter_lr`` gets the table's value for
        its own optimizer. ``model_kind`` / ``variance`` / ``steps`` (the run's length, None
        when unknown) are the arguments of :func:`ssdcore.step_sizes.default_lr`
        (``ValueError`` names an unknown one).
        """

        def table(name: str) -> float:
            return default_lr(model_kind, name, variance, self.step_rule, steps)

        lr = self.lr if self.lr is not None else table(self.name)
        per_parameter_lr = dict(self.per_parameter_lr)
        for parameter, name in self.per_parameter.items():
            if name != self.name and parameter not in per_parameter_lr:
                per_parameter_lr[parameter] = table(name)
        return dataclasses.replace(self, lr=lr, per_parameter_lr=per_parameter_lr)


def _valid_lr(lr: object) -> bool:
    return isinstance(lr, int | float) and math.isfinite(lr) and lr > 0


def resolve_for(
    model: nn.Module, config: OptimizerConfig, steps: int | None = None
) -> OptimizerConfig:
    """``config`` with every step size explicit for ``model`` and a run of ``steps`` steps
    (None: of unknown length), unchanged when already so.

    ``ValueError`` when a default is needed but ``model`` is not an RBM the table covers.
    """
    if config.is_resolved:
        return config
    return config.resolved(*model_key(model), steps)


def _auto_method(preconditioned: bool, device: torch.device) -> str:
    """The polar method ``method="auto"`` stands for (see OptimizerConfig.method)."""
    if device.type == "cuda":
        return "newton-schulz"
    return "svd" if preconditioned else "lowrank"


def _group_for(
    name: str, parameter_name: str, config: OptimizerConfig, device: torch.device
) -> dict[str, Any]:
    """The parameter-group settings that make ``parameter_name`` follow optimizer ``name``."""
    is_weight = parameter_name == WEIGHT_NAME
    group: dict[str, Any] = {
        "name": parameter_name,
        "lr": config.per_parameter_lr.get(parameter_name, config.lr),
        "weight_decay": config.weight_decay if is_weight else 0.0,
        "max_spectral_norm": (config.max_spectral_norm or None) if is_weight else None,
    }
    if name in ("sgd", "nesterov"):
        default_momentum = DEFAULT_NESTEROV_MOMENTUM if name == "nesterov" else 0.0
        group.update(
            geometry="euclidean",
            momentum=default_momentum if config.momentum is None else config.momentum,
            nesterov=name == "nesterov",
        )
    else:
        preconditioned = name == "ssd-preconditioned"
        method = config.method
        if method == "auto":
            method = _auto_method(preconditioned, device)
        elif preconditioned and method == "lowrank":
            method = "svd"
        group.update(
            geometry="spectral",
            momentum=0.0,
            nesterov=False,
            method=method,
            rank=config.rank,
            preconditioner=config.preconditioner if preconditioned else None,
            step_rule=config.step_rule,
        )
    return group


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> Optimizer:
    """One optimizer with a parameter group per named parameter of ``model``.

    Groups carry their parameter's name (``group["name"]``). All-Euclidean configurations give
    :class:`~ssdcore.optim.SGD`; any spectral group gives :class:`~ssdcore.optim.SSD` (or
    :class:`~ssdcore.optim.PreconditionedSSD`), whose Euclidean groups take SGD steps. Step sizes
    left unset come from the step-size table for ``model`` (see :func:`resolve_for`).
    """
    config.validate()
    parameters = dict(model.named_parameters())
    for field_name in ("per_parameter", "per_parameter_lr"):
        unknown = sorted(set(getattr(config, field_name)) - set(parameters))
        if unknown:
            raise ValueError(
                f"OptimizerConfig.{field_name}: unknown parameter names {unknown}; "
                f"this model has {sorted(parameters)}"
            )
    config = resolve_for(model, config)
    names = {p: config.per_parameter.get(p, config.name) for p in parameters}
    device = next(iter(parameters.values())).device
    groups = [
        {"params": [tensor], **_group_for(names[p], p, config, device)}
        for p, tensor in parameters.items()
    ]
    if all(name in ("sgd", "nesterov") for name in names.values()):
        for group in groups:
            del group["geometry"]
        return SGD(groups, lr=config.lr)
    if "ssd-preconditioned" in names.values():
        return PreconditionedSSD(groups, lr=config.lr, preconditioner=config.preconditioner)
    return SSD(groups, lr=config.lr)
