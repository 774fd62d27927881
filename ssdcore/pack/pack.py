"""A pack: M RBMs of one kind and shape trained as one batched computation.

Each run keeps its own model, optimizer settings and step size, data order, random source and
step count; the pack stacks the parameters (W (M, V, H), b (M, V), a (M, H), and a Gaussian
model's variance parameter, clamped to each run's own bounds as ``constrain_`` does) and runs
every step's sweeps, gradients and updates as batched products. What holds run by run:

- *Solo equivalence.* A run's batches and draws come from its own seeded streams, the solo
  :class:`~ssdcore.Trainer`'s for the same seed, and every batched kernel computes each run's
  slice as the solo kernel does: on the CPU a packed run's trajectory is its solo trajectory bit
  for bit, whatever else shares the pack (``tests/test_pack.py``); on CUDA, within float32
  rounding.
- *Schedules are per run*, at the run's own step count, with the solo Trainer's step size (base
  × factor(step) × backoff scale). A pack with any non-constant schedule is not CUDA-graphed.
- *Divergence is per run.* Every ``check_every`` steps one reduction per run (one host sync)
  checks its parameters; a run that fails is put back to its last finite parameters and frozen,
  a :class:`RunDivergence` reports it and the others carry on. The caller decides what follows
  (:func:`ssdcore.pack.fit_pack` applies fit's backoff per run).
- *Interchangeable state.* :meth:`TrainingPack.run_state` / :meth:`TrainingPack.load_run_state`
  move one run out and in; :mod:`ssdcore.pack.exchange` turns that into a solo Trainer and its
  checkpoint bytes, and back.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ssdcore.batched import stacked_copy
from ssdcore.cuda_graph import GraphedStep, use_cuda_graph
from ssdcore.models.base import RBM
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.factory import model_from_config
from ssdcore.models.gaussian import GaussianRBM, log_variance_bounds
from ssdcore.optim.config import OptimizerConfig, resolve_for
from ssdcore.optim.ssd import takes_factors_only
from ssdcore.order import RunOrder, gather_batches
from ssdcore.pack.gaussian import PackedGaussianCD
from ssdcore.pack.gradients import PackedCD
from ssdcore.pack.models import (
    model_signature,
    parameter_names,
    template_model,
    variance_parameter,
)
from ssdcore.pack.optim import (
    PackedOptimizer,
    ParameterRule,
    RunSettings,
    needs_dense_weight_gradient,
    parameter_groups,
    rule_and_settings,
)
from ssdcore.pack.random import PackedRandom
from ssdcore.pack.state import RunState
from ssdcore.sampling import RandomSource
from ssdcore.schedules import step_size
from ssdcore.training import (
    _ESTIMATOR_SEED_OFFSET,
    DEFAULT_BATCH_SIZE,
    DEFAULT_CD_K,
    as_optimizer_config,
    check_data,
    check_loop_settings,
    non_finite_what,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackRun:
    """One run to pack: its starting model, optimizer configuration and seed (as a Trainer's)."""

    model: RBM  # a BernoulliRBM, or a GaussianRBM of a packable variance form
    optimizer: OptimizerConfig | str = "ssd"
    seed: int = 0


@dataclass(frozen=True)
class RunDivergence:
    """Run ``run`` stopped: ``what`` went wrong by ``step``; it was put back to
    ``restored_step``'s parameters and frozen."""

    run: int
    step: int
    restored_step: int
    what: str


def run_rules(
    config: OptimizerConfig, model_config: dict, device: torch.device | str = "cpu"
) -> tuple[dict[str, ParameterRule], dict[str, RunSettings]]:
    """The per-parameter rules and numbers of a run with ``config`` (resolved for its model)
    on a model of ``model_config`` (:meth:`RBM.config`): the solo optimizer's groups, the
    variance parameter's included."""
    groups = parameter_groups(config, template_model(model_config, torch.device(device)))
    rules, settings = {}, {}
    for name in parameter_names(model_config):
        rules[name], settings[name] = rule_and_settings(name, groups[name])
    return rules, settings


def pack_key(
    model_config: dict,
    optimizer: OptimizerConfig | str,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    cd_k: int = DEFAULT_CD_K,
    persistent: bool = False,
    device: torch.device | str = "cpu",
) -> tuple:
    """A hashable key: runs (and jobs) with equal keys can share a pack (on the same data and
    ``device``, which decides what ``method="auto"`` means). ``model_config`` is
    :meth:`RBM.config` output: its kind, Gaussian variance form and shape are part of the key.
    ValueError says why a run cannot be packed at all (a full-covariance Gaussian model, an
    optimizer setting packs do not run)."""
    config = resolve_for(template_model(model_config), as_optimizer_config(optimizer))
    rules, _ = run_rules(config, model_config, device)
    return (
        *model_signature(model_config),
        int(batch_size),
        int(cd_k),
        bool(persistent),
        tuple(sorted(rules.items())),
    )


class TrainingPack:
    """Trains M RBMs of one kind and shape together on one (N, V) data set (Bernoulli, or
    Gaussian of one packable variance form: :mod:`ssdcore.pack.models`).

    Args:
        runs: the runs, each a :class:`PackRun` (model copied in; the model objects are not
            updated — read results with :meth:`model`).
        train_data: (N, V) float tensor shared by every run (each run has its own order).
        batch_size, cd_k, persistent, check_every: as the solo Trainer's, for every run.
        independent_streams: True (default) gives each run its own random streams, the solo
            Trainer's; False shares one generator across the pack (fewer kernels on CUDA,
            but a run's draws then depend on its pack).
        cuda_graph: replay the batched step as one CUDA graph (None: when the device is CUDA
            and every rule is capturable — SGD/Nesterov and Newton–Schulz SSD).
    """

    def __init__(
        self,
        runs: Sequence[PackRun],
        train_data: Tensor,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        cd_k: int = DEFAULT_CD_K,
        persistent: bool = False,
        check_every: int = 1,
        independent_streams: bool = True,
        cuda_graph: bool | None = None,
    ) -> None:
        if not runs:
            raise ValueError("runs must hold at least one PackRun")
        first = runs[0].model
        signature = self._checked_signature(first, 0)
        for index, run in enumerate(runs):
            if self._checked_signature(run.model, index) != signature:
                raise ValueError(
                    f"runs[{index}].model is a {_describe(run.model)}, runs[0].model a "
                    f"{_describe(first)}: a pack holds one shape of one model kind and "
                    "variance form"
                )
            if run.model.W.device != first.W.device:
                raise ValueError(f"runs[{index}].model is on another device than runs[0].model")
        check_data(train_data, first.n_visible, "train_data")
        check_loop_settings(train_data.shape[0], batch_size, check_every)
        if not (isinstance(cd_k, int) and cd_k >= 1):
            raise ValueError(f"cd_k must be an integer >= 1, got {cd_k!r}")
        self.device = first.W.device
        self.n_visible, self.n_hidden = first.n_visible, first.n_hidden
        self.n_runs = len(runs)
        self.batch_size, self.cd_k, self.persistent = batch_size, cd_k, bool(persistent)
        self.check_every = check_every
        self.train_data = train_data.to(self.device, torch.float32)
        self.model_configs = [run.model.config() for run in runs]
        self.parameter_names = parameter_names(self.model_configs[0])
        self.variance_name = variance_parameter(self.model_configs[0])
        self.variance_form = getattr(first, "variance", None)
        self.configs = [resolve_for(run.model, as_optimizer_config(run.optimizer)) for run in runs]
        self.seeds = [int(run.seed) for run in runs]
        for index, config in enumerate(self.configs):
            config.schedule.require_horizon(f"runs[{index}].optimizer.schedule")
        self.schedules = [config.schedule for config in self.configs]
        rules, settings = self._rules_of_runs()
        self.rules = rules
        with torch.no_grad():
            self.parameters = {
                name: stacked_copy(torch.stack([getattr(run.model, name).detach() for run in runs]))
                for name in self.parameter_names
            }
        self._variance_bounds = self._bounds_of_runs()
        shapes = {name: tuple(t.shape[1:]) for name, t in self.parameters.items()}
        self.optimizer = PackedOptimizer(rules, settings, shapes, self.device)
        self.sources = [RandomSource(self.device, s + _ESTIMATOR_SEED_OFFSET) for s in self.seeds]
        self.random = PackedRandom(
            self.sources, self.device, independent=independent_streams, shared_seed=self.seeds[0]
        )
        self.estimator = self._estimator(rules["W"])
        n_rows = self.train_data.shape[0]
        self.orders = [RunOrder(n_rows, batch_size, s, self.device) for s in self.seeds]
        self._batch = torch.empty(self.n_runs, batch_size, self.n_visible, device=self.device)
        self.step_counts = [0] * self.n_runs
        self.wall_times = [0.0] * self.n_runs
        self.active = [True] * self.n_runs
        self.divergences: list[RunDivergence] = []
        self._pack_steps = 0
        self._last_good = {name: stacked_copy(t) for name, t in self.parameters.items()}
        self._last_good_steps = [0] * self.n_runs
        self._scheduled = any(not schedule.is_constant for schedule in self.schedules)
        self.cuda_graph = use_cuda_graph(cuda_graph, self._cuda_graph_obstacle())
        self._graphed_step: GraphedStep | None = None

    @staticmethod
    def _checked_signature(model: RBM, index: int) -> tuple:
        if type(model) not in (BernoulliRBM, GaussianRBM):
            raise ValueError(
                f"runs[{index}].model is a {type(model).__name__}; packs train BernoulliRBM and "
                "GaussianRBM models"
            )
        try:
            return model_signature(model.config())
        except ValueError as error:
            raise ValueError(f"runs[{index}].model: {error}") from None

    def _estimator(self, weight_rule: ParameterRule) -> PackedCD:
        shape, rank = (self.n_visible, self.n_hidden), 2 * self.batch_size
        common = {
            "k": self.cd_k,
            "persistent": self.persistent,
            "random": self.random,
            "device": self.device,
            "dense_weight_grad": needs_dense_weight_gradient(weight_rule, shape, rank),
        }
        sizes = (self.n_runs, self.n_visible, self.n_hidden, self.batch_size)
        if self.variance_form is None:
            return PackedCD(*sizes, **common)
        # The solo estimator takes the variance gradient's row sums from the dense weight
        # gradient when it forms one, else from the factors; the pack follows it.
        dense_row_sums = not takes_factors_only(weight_rule.method, shape, rank)
        return PackedGaussianCD(
            *sizes, variance=self.variance_form, dense_row_sums=dense_row_sums, **common
        )

    def _bounds_of_runs(self) -> tuple[Tensor, Tensor] | None:
        """Per-run (M, 1) float32 clamp bounds of the variance parameter (log variances), as
        :meth:`GaussianRBM.constrain_` clamps them (its Python bounds become float32)."""
        if self.variance_name is None:
            return None
        bounds = [
            log_variance_bounds(config["min_variance"], config["max_variance"])
            for config in self.model_configs
        ]
        low, high = zip(*bounds, strict=True)
        f32 = {"dtype": torch.float32, "device": self.device}
        return torch.tensor(low, **f32).view(-1, 1), torch.tensor(high, **f32).view(-1, 1)

    @torch.no_grad()
    def _constrain(self) -> None:
        """Every run's ``constrain_``: its log variances clamped to its bounds."""
        if self._variance_bounds is not None and self.variance_name is not None:
            self.parameters[self.variance_name].clamp_(*self._variance_bounds)

    def _rules_of_runs(self) -> tuple[dict[str, ParameterRule], list[dict[str, RunSettings]]]:
        rules: dict[str, ParameterRule] | None = None
        settings = []
        for index, config in enumerate(self.configs):
            run_rule, run_settings = run_rules(config, self.model_configs[0], self.device)
            if rules is None:
                rules = run_rule
            elif run_rule != rules:
                raise ValueError(
                    f"runs[{index}]'s optimizer updates its parameters as {run_rule}, runs[0]'s "
                    f"as {rules}; a pack needs one rule per parameter (group runs by pack_key)"
                )
            settings.append(run_settings)
        assert rules is not None
        return rules, settings

    # --- CUDA graphs ------------------------------------------------------------------------

    def _cuda_graph_obstacle(self) -> str | None:
        if self.device.type != "cuda":
            return f"the pack is on {self.device}, not a CUDA device"
        if not all(
            rule.geometry == "euclidean" or rule.method in ("", "newton-schulz")
            for rule in self.rules.values()
        ):
            return "exact polar steps synchronize with the host (use newton-schulz)"
        if self._scheduled:
            return "a step-size schedule changes the step sizes every step"
        return None

    # --- training -------------------------------------------------------------------------

    def _step(self) -> None:
        """Estimate and update every run on ``self._batch``: the unit a CUDA graph captures."""
        W, b, a = (self.parameters[name] for name in ("W", "b", "a"))
        estimator, variance_name = self.estimator, self.variance_name
        self._constrain()  # the solo estimate constrains the model first
        variance = None if variance_name is None else self.parameters[variance_name]
        estimator.estimate(W, b, a, self._batch, variance)
        gradients = {
            "W": estimator.grad_W if estimator.dense_weight_grad else None,
            "b": estimator.grad_b,
            "a": estimator.grad_a,
        }
        if variance_name is not None:
            gradients[variance_name] = estimator.grad_variance
        self.optimizer.step(self.parameters, gradients, estimator.factors)
        self._constrain()

    def _run_step(self) -> None:
        if not self.cuda_graph:
            self._step()
            return
        if self._graphed_step is None:
            self._graphed_step = GraphedStep(self._step, self.random.generators, self.device)
        self._graphed_step()

    def train_steps(self, n: int) -> list[RunDivergence]:
        """Run ``n`` steps of every active run; returns the runs that diverged meanwhile."""
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"n (number of steps) must be an integer >= 0, got {n!r}")
        found: list[RunDivergence] = []
        started = time.perf_counter()
        frozen = [run for run, active in enumerate(self.active) if not active]
        try:
            for _ in range(n):
                gather_batches(self.orders, self.train_data, self._batch)
                if self._scheduled:
                    self._apply_schedules()
                self._run_step()
                if frozen:
                    self._hold_frozen(frozen)
                self._pack_steps += 1
                for run in range(self.n_runs):
                    if self.active[run]:
                        self.step_counts[run] += 1
                if self._pack_steps % self.check_every == 0:
                    new = self._check_finite()
                    found += new
                    frozen = [run for run, active in enumerate(self.active) if not active]
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - started
            for run in range(self.n_runs):
                if self.active[run]:
                    self.wall_times[run] += elapsed
        return found

    @torch.no_grad()
    def _hold_frozen(self, frozen: list[int]) -> None:
        """Put frozen runs' parameters back: they are computed along but must not move."""
        index = torch.tensor(frozen, device=self.device)
        for name, parameter in self.parameters.items():
            parameter.index_copy_(0, index, self._last_good[name].index_select(0, index))

    @torch.no_grad()
    def _check_finite(self) -> list[RunDivergence]:
        """One reduction per run, one host sync; freeze the runs that are not finite."""
        totals = sum(t.sum(dim=tuple(range(1, t.ndim))) for t in self.parameters.values())
        finite = torch.isfinite(totals).tolist()
        if all(finite):
            for name, parameter in self.parameters.items():
                self._last_good[name].copy_(parameter)
            self._last_good_steps = list(self.step_counts)
            return []
        found = []
        for run, ok in enumerate(finite):
            if ok:
                self._mark_good(run)
            elif self.active[run]:
                what = non_finite_what((name, t[run]) for name, t in self.parameters.items())
                found.append(self._freeze(run, what))
        return found

    @torch.no_grad()
    def _mark_good(self, run: int) -> None:
        """Run ``run``'s parameters now are its last good ones."""
        for name, parameter in self.parameters.items():
            self._last_good[name][run].copy_(parameter[run])
        self._last_good_steps[run] = self.step_counts[run]

    def _freeze(self, run: int, what: str) -> RunDivergence:
        failed = self.step_counts[run]
        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter[run].copy_(self._last_good[name][run])
        self.optimizer.load_run_buffers(run, {})  # a diverged run's may hold NaN
        self.step_counts[run] = self._last_good_steps[run]
        self.active[run] = False
        event = RunDivergence(run, failed, self.step_counts[run], what)
        self.divergences.append(event)
        logger.warning(
            "pack run %d: %s by step %d; frozen at step %d", run, what, failed, event.restored_step
        )
        return event

    def hold(self, run: int) -> None:
        """Stop stepping run ``run`` (e.g. it has finished) without reporting a divergence;
        :meth:`release` or :meth:`load_run_state` lets it go on."""
        self._check_run(run)
        self._mark_good(run)
        self.active[run] = False

    def release(self, run: int) -> None:
        """Let a held or frozen run step again from where it stands."""
        self._check_run(run)
        self.active[run] = True

    def freeze(self, run: int, why: str) -> RunDivergence:
        """Stop run ``run`` where it is (e.g. the blow-up detector fired for it)."""
        self.hold(run)
        return self._freeze(run, why)

    # --- step sizes -------------------------------------------------------------------------

    def lr(self, run: int) -> float:
        """Run ``run``'s step size now: its configuration's ``lr`` × its schedule's factor at its
        step × its ``lr_scale`` (:attr:`Trainer.lr`'s expression)."""
        factor = self.schedules[run].factor(self.step_counts[run])
        return step_size(float(self.configs[run].lr), factor, self.optimizer.lr_scales[run])

    def _apply_schedules(self) -> None:
        """Every run's schedule factor at its own step, for the step about to be taken."""
        factors = [s.factor(step) for s, step in zip(self.schedules, self.step_counts, strict=True)]
        self.optimizer.set_schedule_factors(factors)

    def set_lr_scale(self, run: int, scale: float) -> None:
        """Every step size of run ``run`` = its configured value × ``scale`` (× its schedule's
        factor at its step; absolute, as :meth:`Trainer.set_lr_scale`)."""
        self._check_run(run)
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        self.optimizer.set_lr_scale(run, float(scale))
        self._graphed_step = None  # the per-run addmm steps baked the old step sizes in

    # --- per-run state ----------------------------------------------------------------------

    def _check_run(self, run: int) -> None:
        if not (isinstance(run, int) and 0 <= run < self.n_runs):
            raise ValueError(f"run must be an integer in [0, {self.n_runs}), got {run!r}")

    def model(self, run: int) -> RBM:
        """A new model (the run's kind) holding run ``run``'s current parameters."""
        self._check_run(run)
        model = model_from_config(self.model_configs[run], device=self.device)
        with torch.no_grad():
            for name, parameter in self.parameters.items():
                getattr(model, name).copy_(parameter[run])
        return model

    def run_state(self, run: int) -> RunState:
        """Run ``run``'s complete state (own copies): a snapshot, or a solo checkpoint's content."""
        self._check_run(run)
        order = self.orders[run]
        return RunState(
            model_config=dict(self.model_configs[run]),
            parameters={name: t[run].detach().clone() for name, t in self.parameters.items()},
            optimizer=self.configs[run],
            seed=self.seeds[run],
            step=self.step_counts[run],
            epoch=order.epoch,
            position=order.position,
            permutation=order.permutation.detach().cpu().clone(),
            order_generator=order.generator.get_state().clone(),
            random=self.sources[run].state_dict(),
            chains=(
                self.estimator.chains[run].detach().cpu().clone()
                if self.persistent and self.estimator.has_chains[run]
                else None
            ),
            momentum={n: t.cpu() for n, t in self.optimizer.run_buffers(run).items()},
            lr_scale=self.optimizer.lr_scales[run],
            wall_time_s=self.wall_times[run],
        )

    def load_run_state(self, run: int, state: RunState) -> None:
        """Put ``state`` into slot ``run`` (a snapshot of it, or another compatible run); the
        run is active again from ``state.step``."""
        self._check_run(run)
        config = state.model_config
        ours = model_signature(self.model_configs[0])
        try:
            theirs = model_signature(config)
        except ValueError as error:
            raise ValueError(f"the run's model cannot be packed: {error}") from None
        if theirs != ours:
            raise ValueError(
                f"the run's model is {config}; this pack holds {_signature_text(ours)} RBMs"
            )
        rules, settings = run_rules(state.optimizer, config, self.device)
        if rules != self.rules:
            raise ValueError(
                f"the run's optimizer updates its parameters as {rules}, this pack's runs as "
                f"{self.rules}; put it in a pack with its pack_key"
            )
        state.optimizer.schedule.require_horizon(f"runs[{run}].optimizer.schedule")
        self.orders[run].check_permutation(state.permutation)
        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter[run].copy_(state.parameters[name])
                self._last_good[name][run].copy_(state.parameters[name])
        self.configs[run], self.seeds[run] = state.optimizer, int(state.seed)
        self.schedules[run] = state.optimizer.schedule
        self.model_configs[run] = dict(config)
        self._variance_bounds = self._bounds_of_runs()
        self.optimizer.set_run(run, settings, state.lr_scale)
        self.optimizer.load_run_buffers(
            run, {n: t.to(self.device) for n, t in state.momentum.items()}
        )
        self.orders[run].restore(
            state.epoch, state.position, state.permutation, state.order_generator
        )
        self.sources[run].load_state_dict(state.random)
        if self.persistent:
            if state.chains is None:
                self.estimator.reset_chains(run)
            else:
                self.estimator.chains[run].copy_(state.chains)
                self.estimator.has_chains[run] = True
        self.step_counts[run] = int(state.step)
        self._last_good_steps[run] = int(state.step)
        self.wall_times[run] = float(state.wall_time_s)
        self.active[run] = True
        self._scheduled = any(not s.is_constant for s in self.schedules)
        self._apply_schedules()  # also puts a constant run's factor back to 1
        if self.cuda_graph and self._scheduled:
            logger.info("pack: run %d has a step-size schedule; the pack runs uncaptured", run)
            self.cuda_graph = False
        self._graphed_step = None


def _signature_text(signature: tuple) -> str:
    kind, variance, n_visible, n_hidden = signature
    form = "" if variance is None else f" (variance={variance!r})"
    return f"{kind}{form} {n_visible}x{n_hidden}"


def _describe(model: RBM) -> str:
    return _signature_text(model_signature(model.config()))
