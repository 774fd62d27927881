"""The training loop: minibatches, CD/PCD gradients, an optimizer step, divergence checks, metrics.

:class:`Trainer` owns everything a run needs to resume exactly (model, CD estimator with its
chains and random state, optimizer state, data order); :func:`fit` is the one-call entry point.

Divergence: every ``check_every`` steps one reduction over all parameters (one host sync) must
be finite; the trainer keeps a copy of the parameters that passed, and when a check fails puts
the model back to them and raises :class:`~ssdcore.DivergenceError` (optimizer state and chains
are not rolled back: treat the run as ended). Blow-ups that stay finite are caught between
evaluations by :class:`~ssdcore.blowup.BlowUpDetector`; :func:`fit` answers them with
:class:`~ssdcore.blowup.Recovery`, the service's rule too.

On a CUDA device each step is replayed as one CUDA graph when it can be captured
(:mod:`ssdcore.cuda_graph`); the batch is gathered into a fixed buffer before each replay, and
the divergence check stays outside the graph.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ssdcore.blowup import (
    BACKOFF_FACTOR,
    DEFAULT_MAX_BACKOFFS,
    BlowUp,
    BlowUpError,
    Recovery,
    blowup_from_error,
)
from ssdcore.centering import Centering, CenteringConfig
from ssdcore.cuda_graph import GraphedStep, use_cuda_graph
from ssdcore.errors import DivergenceError
from ssdcore.evaluation import (
    certified_log_likelihood,
    exact_log_partition,
    free_energy_gap,
    pseudo_log_likelihood,
    reconstruction_error,
    saturated_hidden_fraction,
    spectral_norm,
)
from ssdcore.evaluation import log_likelihood as mean_log_likelihood
from ssdcore.evaluation.ais import DEFAULT_AIS_BETAS, DEFAULT_AIS_CHAINS
from ssdcore.gradients import CDEstimator
from ssdcore.models.base import RBM
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.gaussian import GaussianRBM
from ssdcore.optim.config import OptimizerConfig, build_optimizer, resolve_for
from ssdcore.order import RunOrder
from ssdcore.schedules import step_size
from ssdcore.tempering import TemperingConfig

logger = logging.getLogger(__name__)

LOG_LIKELIHOOD_METHODS = ("none", "exact", "ais")
# Evaluation looks at most this many training rows, so metrics stay cheap on large data sets.
DEFAULT_EVAL_EXAMPLES = 10_000
# Mini-batch size and Gibbs steps per gradient when the caller gives none (the service's too).
DEFAULT_BATCH_SIZE = 100
DEFAULT_CD_K = 1
EXACT_PLL_MAX_VISIBLE = 256
# Offsets the estimator's seed from the shuffling seed so the two streams never coincide.
_ESTIMATOR_SEED_OFFSET = 0x5EED


def as_optimizer_config(optimizer: OptimizerConfig | str) -> OptimizerConfig:
    """``optimizer`` as a config (a name stands for the config of that name)."""
    if isinstance(optimizer, str):
        return OptimizerConfig(name=optimizer)
    if not isinstance(optimizer, OptimizerConfig):
        raise ValueError(f"optimizer must be an OptimizerConfig or a name, got {optimizer!r}")
    return optimizer


def check_data(data: Tensor, n_visible: int, name: str) -> None:
    """Raise ``ValueError`` for data that is not a finite (N, n_visible) tensor."""
    if not isinstance(data, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (N, {n_visible})")
    if data.ndim != 2 or data.shape[1] != n_visible or data.shape[0] == 0:
        raise ValueError(
            f"{name} has shape {tuple(data.shape)}; expected (N, {n_visible}) with N >= 1"
        )
    if not data.is_floating_point():
        raise ValueError(f"{name} has dtype {data.dtype}; convert it to float32")
    finite = torch.isfinite(data).all(dim=1)
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0, 0])
        raise ValueError(
            f"{name} contains NaN or Inf (first at row {row}); clean or drop those rows"
        )


@torch.no_grad()
def run_metrics(
    model: RBM, train: Tensor, valid: Tensor, step: int, wall_time_s: float
) -> dict[str, Any]:
    """The metrics every evaluation has (and the blow-up detector reads), of a run's model on
    its training and validation rows: a solo :meth:`Trainer.evaluate`'s, and a pack's run's
    (:func:`ssdcore.pack.evaluate_run`)."""
    return {
        "step": step,
        "reconstruction_error": float(reconstruction_error(model, valid)),
        "train_reconstruction_error": float(reconstruction_error(model, train)),
        "spectral_norm": float(spectral_norm(model.W)),
        "saturated_hidden_fraction": saturated_hidden_fraction(model, valid),
        "wall_time_s": wall_time_s,
    }


def check_loop_settings(n_rows: int, batch_size: object, check_every: object) -> None:
    """ValueError naming ``batch_size`` or ``check_every`` when out of range, for a training
    loop over ``n_rows`` examples (a Trainer's, or a pack's for every run)."""
    if not (isinstance(batch_size, int) and 1 <= batch_size <= n_rows):
        raise ValueError(
            f"batch_size must be an integer in [1, {n_rows}] (the number of training "
            f"examples), got {batch_size!r}"
        )
    if not (isinstance(check_every, int) and check_every >= 1):
        raise ValueError(f"check_every must be an integer >= 1, got {check_every!r}")


def non_finite_what(named_parameters: Iterable[tuple[str, Tensor]]) -> str:
    """What a failed finiteness check found: the parameters holding NaN or Inf (or none, when
    only their sum overflowed)."""
    bad = [name for name, p in named_parameters if not bool(torch.isfinite(p).all())]
    return f"parameters {bad or '(overflowing sum)'} became NaN or Inf"


def evaluation_spacing(steps: object, eval_every: object) -> int:
    """Steps between the evaluations of a fit over ``steps`` (default: ten points over the
    run); ValueError naming ``steps`` or ``eval_every`` when out of range."""
    if not (isinstance(steps, int) and steps >= 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    every = eval_every if eval_every is not None else max(1, math.ceil(steps / 10))
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"eval_every must be an integer >= 1, got {eval_every!r}")
    return every


def steps_per_epoch(n_train: int, batch_size: int) -> int:
    """Steps in one epoch of `n_train` examples: whole batches only, as the Trainer drops an
    epoch's last partial batch."""
    return max(1, n_train // batch_size)


class Trainer:
    """Trains ``model`` on ``train_data`` with CD-k / PCD-k and an optimizer from a config.

    Args:
        model: the RBM; parameters are updated in place.
        train_data: (N, V) float tensor; moved to the model's device as float32.
        optimizer: an :class:`~ssdcore.optim.OptimizerConfig` (or its name); unset step sizes
            come from the step-size table (:mod:`ssdcore.step_sizes`), resolved into
            ``optimizer_config``.
        batch_size: examples per step; each epoch is a fresh permutation, the last partial
            batch of an epoch is dropped.
        cd_k: Gibbs sweeps per gradient estimate.
        persistent: PCD-k (persistent chains) instead of CD-k.
        tempering: parallel tempering of the persistent chains over this ladder
            (:mod:`ssdcore.tempering`; needs ``persistent=True``); the metrics then carry
            ``pt_swap_rate_min``, ``pt_swap_rate_mean`` and ``pt_swap_rates``.
        seed: seeds the shuffling and the estimator's random draws.
        valid_data: optional (M, V) held-out data for the validation metrics.
        check_every: steps between divergence checks (1 = every step).
        cuda_graph: replay each step as one CUDA graph (:mod:`ssdcore.cuda_graph`); None
            (default) whenever the step allows it, True insists (ValueError if it cannot).
        centering: a :class:`~ssdcore.centering.CenteringConfig` trains the model as a
            centered RBM (the stored model stays ordinary; :mod:`ssdcore.centering`).
    """

    def __init__(
        self,
        model: RBM,
        train_data: Tensor,
        *,
        optimizer: OptimizerConfig | str = "ssd",
        batch_size: int = DEFAULT_BATCH_SIZE,
        cd_k: int = DEFAULT_CD_K,
        persistent: bool = False,
        seed: int = 0,
        valid_data: Tensor | None = None,
        check_every: int = 1,
        cuda_graph: bool | None = None,
        tempering: TemperingConfig | None = None,
        centering: CenteringConfig | None = None,
    ) -> None:
        optimizer = as_optimizer_config(optimizer)
        check_data(train_data, model.n_visible, "train_data")
        if valid_data is not None:
            check_data(valid_data, model.n_visible, "valid_data")
        check_loop_settings(train_data.shape[0], batch_size, check_every)
        self.model = model
        self.device = model.W.device
        self.train_data = train_data.to(self.device, torch.float32)
        self.valid_data = None if valid_data is None else valid_data.to(self.device, torch.float32)
        # Resolved, so checkpoints record the step sizes actually used.
        self.optimizer_config = resolve_for(model, optimizer)
        # Step-size schedule (ssdcore.schedules): group lr = base × factor(step) × lr_scale.
        self.schedule = self.optimizer_config.schedule
        self.schedule.require_horizon()
        self.batch_size = batch_size
        self.cd_k = cd_k
        self.persistent = persistent
        self.tempering = tempering
        self.seed = seed
        self.check_every = check_every
        self.optimizer = build_optimizer(model, self.optimizer_config)
        # Each group's configured step size; set_lr_scale multiplies these, never the current
        # values, so scaling is absolute and repeating it changes nothing.
        self._base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.lr_scale = 1.0
        # The CD weight gradient has rank ≤ 2B (B data rows and B chains); an exact low-rank
        # SSD step on W then needs only its factors, so the estimator skips the dense product.
        needs_dense = getattr(self.optimizer, "needs_dense_gradient", None)
        self.estimator = CDEstimator(
            model,
            k=cd_k,
            persistent=persistent,
            seed=seed + _ESTIMATOR_SEED_OFFSET,
            dense_weight_grad=needs_dense is None or needs_dense(model.W, 2 * batch_size),
            tempering=tempering,
        )
        self.centering = None if centering is None else Centering(model, centering, self.train_data)
        self.order = RunOrder(self.train_data.shape[0], batch_size, seed, self.device)
        self.step_count = 0
        self.wall_time_s = 0.0
        self._batch = torch.empty(batch_size, model.n_visible, device=self.device)
        self._named_parameters = list(model.named_parameters())
        self._last_good = [p.detach().clone() for _, p in self._named_parameters]
        self._last_good_step = 0
        self.cuda_graph = use_cuda_graph(cuda_graph, self._cuda_graph_obstacle())
        self._graphed_step: GraphedStep | None = None

    @property
    def epoch(self) -> int:
        """Completed passes over the training data (the data order's epoch)."""
        return self.order.epoch

    # --- CUDA graphs ------------------------------------------------------------------------

    def _cuda_graph_obstacle(self) -> str | None:
        """Why this trainer's step cannot be captured as a CUDA graph, or None if it can."""
        if self.device.type != "cuda":
            return f"the model is on {self.device}, not a CUDA device"
        if isinstance(self.model, GaussianRBM) and self.model.variance == "full":
            return "the full-covariance projection decides on the host (eigenvalue clipping)"
        if self.tempering is not None:
            return "parallel tempering runs eagerly (its capture is not verified)"
        if self.centering is not None:
            return "centered training runs eagerly (its capture is not verified)"
        if not self.schedule.is_constant:
            return "a step-size schedule changes the step sizes every step"
        capturable = getattr(self.optimizer, "capturable", None)
        if capturable is None or not capturable():
            return (
                f"optimizer {self.optimizer_config.name!r} with these settings synchronizes "
                "with the host (use SGD/Nesterov, or SSD with method='newton-schulz', and no "
                "max_spectral_norm)"
            )
        return None

    def _step(self) -> None:
        """One estimate-and-update on ``self._batch``: the unit a CUDA graph captures."""
        stats = self.estimator.estimate(self._batch)
        if self.centering is None:
            self.optimizer.step()
        else:
            self.centering.step(stats, self.optimizer)
        self.model.constrain_()

    def _run_step(self) -> None:
        if self.cuda_graph:
            if self._graphed_step is None:
                self._graphed_step = GraphedStep(
                    self._step, [self.estimator.source.generator], self.device
                )
            self._graphed_step()
            return
        try:
            self._step()
        except torch.linalg.LinAlgError as error:
            # A non-finite gradient makes the spectral step's factorization fail before the
            # parameters can show it: the same divergence, seen earlier.
            self._diverged(f"the optimizer step failed ({error})", self.step_count + 1)

    # --- step sizes -----------------------------------------------------------------------

    @property
    def lr(self) -> float:
        """The configuration's ``lr`` × the schedule's factor at this step × ``lr_scale`` (a
        hybrid's per-parameter step sizes are scaled alike)."""
        return self._step_size(float(self.optimizer_config.lr))

    def _step_size(self, base: float) -> float:
        """A configured step size now: × the schedule's factor × the backoff scale."""
        return step_size(base, self.schedule.factor(self.step_count), self.lr_scale)

    def _apply_step_sizes(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
            group["lr"] = self._step_size(base)

    def set_lr_scale(self, scale: float) -> None:
        """Set every group's step size to its configured value × ``scale`` (× the schedule's
        factor). Absolute, not cumulative: the same step sizes however often it is called,
        before or after loading a checkpoint (which restores the scale it was saved with)."""
        if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        self.lr_scale = float(scale)
        self._apply_step_sizes()
        # A captured CUDA graph baked the old step sizes in: capture again.
        self._graphed_step = None

    @property
    def graph_replays(self) -> int:
        """Steps replayed from the current CUDA graph (0 when none is in use)."""
        return 0 if self._graphed_step is None else self._graphed_step.replays

    # --- training -------------------------------------------------------------------------

    def train_steps(self, n: int) -> None:
        """Run ``n`` optimizer steps; raises DivergenceError when parameters become non-finite."""
        if not (isinstance(n, int) and n >= 0):
            raise ValueError(f"n (number of steps) must be an integer >= 0, got {n!r}")
        started = time.perf_counter()
        try:
            for _ in range(n):
                if not self.schedule.is_constant:
                    self._apply_step_sizes()
                # into self._batch, the buffer a captured step reads
                torch.index_select(self.train_data, 0, self.order.next_indices(), out=self._batch)
                self._run_step()
                self.step_count += 1
                if self.step_count % self.check_every == 0:
                    self._check_finite()
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.wall_time_s += time.perf_counter() - started

    @torch.no_grad()
    def _check_finite(self) -> None:
        """One reduction over all parameters; restore the last good ones when it is not finite."""
        parameters = [p for _, p in self._named_parameters]
        total = torch.stack([p.sum() for p in parameters]).sum()
        if bool(torch.isfinite(total)):
            for good, parameter in zip(self._last_good, parameters, strict=True):
                good.copy_(parameter)
            self._last_good_step = self.step_count
            return
        self._diverged(non_finite_what(self._named_parameters), self.step_count)

    def _pseudo_log_likelihood(self, valid: Tensor) -> float:
        """Exact PLL for small models; above EXACT_PLL_MAX_VISIBLE the exact sum costs V times
        a forward pass (seconds per evaluation at 784×500), so take the one-bit estimate with a
        fixed seed: unbiased, and the same model always gets the same figure."""
        if self.model.n_visible <= EXACT_PLL_MAX_VISIBLE:
            return float(pseudo_log_likelihood(self.model, valid))
        generator = torch.Generator(device=valid.device).manual_seed(0)
        return float(pseudo_log_likelihood(self.model, valid, bits="random", generator=generator))

    @torch.no_grad()
    def _diverged(self, what: str, failed_step: int) -> None:
        """Restore the last good parameters and raise DivergenceError saying `what` happened."""
        for parameter, good in zip(
            (p for _, p in self._named_parameters), self._last_good, strict=True
        ):
            parameter.copy_(good)
        self.step_count = self._last_good_step
        self._graphed_step = None
        raise DivergenceError(
            f"{what} by step {failed_step}; the model was restored to step "
            f"{self._last_good_step}. Lower the learning rate (lr={self.lr:.3g}) "
            "or bound ‖W‖₂ with max_spectral_norm",
            step=failed_step,
            what=what,
        )

    # --- evaluation -----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(
        self,
        log_likelihood: str = "none",
        *,
        ais_chains: int = DEFAULT_AIS_CHAINS,
        ais_betas: int = DEFAULT_AIS_BETAS,
        ais_seed: int = 0,
        max_examples: int = DEFAULT_EVAL_EXAMPLES,
    ) -> dict[str, Any]:
        """Metrics of the current model, keyed as the service's ``Metrics`` message.

        Validation metrics use ``valid_data`` when given, else the training data, at most
        ``max_examples`` rows of each. ``log_likelihood`` is ``"none"``, ``"exact"``
        (enumerates hidden states) or ``"ais"``. Always present: :func:`run_metrics`' keys,
        ``lr``, ``samples_per_second``, ``log_likelihood_method``. With validation data:
        ``free_energy_gap``; for a Bernoulli RBM: ``pseudo_log_likelihood``; with a method:
        ``log_likelihood`` and ``log_likelihood_stderr``, and for ``"ais"`` the certified pair
        (:func:`~ssdcore.evaluation.certified_log_likelihood`): AIS's optimistic estimate as
        ``log_likelihood``, reverse AIS's conservative one as ``log_likelihood_lower`` (with
        ``log_likelihood_lower_stderr``).
        """
        if log_likelihood not in LOG_LIKELIHOOD_METHODS:
            raise ValueError(
                f"log_likelihood must be one of {LOG_LIKELIHOOD_METHODS}, got {log_likelihood!r}"
            )
        model = self.model
        train = self.train_data[:max_examples]
        valid = train if self.valid_data is None else self.valid_data[:max_examples]
        metrics: dict[str, Any] = {
            **run_metrics(model, train, valid, self.step_count, self.wall_time_s),
            "samples_per_second": (
                self.step_count * self.batch_size / self.wall_time_s if self.wall_time_s else 0.0
            ),
            "log_likelihood_method": log_likelihood,
            "lr": self.lr,
        }
        if self.estimator.tempering is not None:
            metrics.update(self.estimator.tempering.metrics())
        if self.valid_data is not None:
            metrics["free_energy_gap"] = float(free_energy_gap(model, train, valid))
        if isinstance(model, BernoulliRBM):
            metrics["pseudo_log_likelihood"] = self._pseudo_log_likelihood(valid)
        if log_likelihood == "exact":
            log_z = float(exact_log_partition(model))
            metrics["log_likelihood"] = float(mean_log_likelihood(model, valid, log_z))
            metrics["log_likelihood_stderr"] = 0.0
        elif log_likelihood == "ais":
            bounds = certified_log_likelihood(
                model, valid, data=train, n_betas=ais_betas, ais_chains=ais_chains, seed=ais_seed
            )
            metrics["log_likelihood"] = float(bounds.upper)
            metrics["log_likelihood_stderr"] = float(bounds.upper_stderr)
            metrics["log_likelihood_lower"] = float(bounds.lower)
            metrics["log_likelihood_lower_stderr"] = float(bounds.lower_stderr)
        return metrics

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything but the model and the data needed to continue exactly where this stopped."""
        state = {
            "step": self.step_count,
            "epoch": self.order.epoch,
            "position": self.order.position,
            "wall_time_s": self.wall_time_s,
            "permutation": self.order.permutation.detach().cpu().clone(),
            "generator": self.order.generator.get_state().clone(),
            "estimator": self.estimator.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scale": self.lr_scale,
            "schedule": self.schedule.to_dict(),
        }
        if self.centering is not None:
            state["centering"] = self.centering.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into this trainer (same model and settings)."""
        saved_schedule = state.get("schedule")  # absent from states saved before schedules
        if saved_schedule is not None and saved_schedule != self.schedule.to_dict():
            raise ValueError(
                f"saved state ran the step-size schedule {saved_schedule} but this trainer has "
                f"{self.schedule.to_dict()}; resume with the same optimizer.schedule"
            )
        self.order.restore(
            state["epoch"], state["position"], state["permutation"], state["generator"]
        )
        self.step_count = int(state["step"])
        self.wall_time_s = float(state["wall_time_s"])
        self.estimator.load_state_dict(state["estimator"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.centering is not None:
            self.centering.load_state_dict(state["centering"])
        # States saved before step-size scaling existed ran at scale 1.
        self.set_lr_scale(float(state.get("lr_scale", 1.0)))
        # Loading replaced the optimizer's buffers and the chains with new tensors, which a
        # captured graph would not see: capture again from the restored state.
        self._graphed_step = None
        self._last_good = [p.detach().clone() for _, p in self._named_parameters]
        self._last_good_step = self.step_count

    def snapshot(self) -> dict[str, Any]:
        """An in-memory copy of the model and of :meth:`state_dict`: what a rollback restores."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "trainer": copy.deepcopy(self.state_dict()),
        }

    @torch.no_grad()
    def restore(self, snapshot: dict[str, Any]) -> None:
        """Go back to a :meth:`snapshot` of this trainer; the snapshot stays usable."""
        self.model.load_state_dict(snapshot["model"])
        # A copy again: loading may adopt the tensors it is given (optimizer buffers, chains),
        # and the snapshot must survive for a second rollback to the same point.
        self.load_state_dict(copy.deepcopy(snapshot["trainer"]))


def fit(
    model: RBM,
    data: Tensor,
    *,
    steps: int,
    batch_size: int = DEFAULT_BATCH_SIZE,
    cd_k: int = DEFAULT_CD_K,
    optimizer: OptimizerConfig | str = "ssd",
    lr: float | None = None,
    persistent: bool = False,
    tempering: TemperingConfig | None = None,
    seed: int = 0,
    callback: Callable[[dict[str, Any]], bool | None] | None = None,
    eval_every: int | None = None,
    valid_data: Tensor | None = None,
    log_likelihood: str = "none",
    max_backoffs: int = DEFAULT_MAX_BACKOFFS,
    backoff_factor: float = BACKOFF_FACTOR,
) -> list[dict[str, Any]]:
    """Train ``model`` for ``steps`` steps and return the metric history.

    Metrics are taken at step 0, every ``eval_every`` steps (default: ten points over the run)
    and at the end; each dict also carries ``total_steps``. ``callback`` receives each metric
    dict; returning ``False`` stops training early. ``lr`` overrides the config's step size;
    with neither, the step-size table's value for a run of ``steps`` steps is taken
    (:meth:`ssdcore.step_sizes.StepSize.lr_for`: a short run takes a longer step).

    Blow-ups follow :class:`~ssdcore.blowup.Recovery`'s rule: on a blow-up (or a
    :class:`~ssdcore.DivergenceError` from a step) the trainer goes back to its last healthy
    evaluation, every step size is divided by ``backoff_factor`` once more, and the history
    gets the :meth:`~ssdcore.blowup.BackoffEvent.history_entry` (not passed to ``callback``).
    Once ``max_backoffs`` are spent the next blow-up raises
    :class:`~ssdcore.blowup.BlowUpError`, with ``model`` left at its last healthy state. A run
    that ends well above its best error without blowing up is logged as a warning
    (:meth:`~ssdcore.blowup.Recovery.drift`).
    """
    every = evaluation_spacing(steps, eval_every)
    recovery = Recovery(max_backoffs=max_backoffs, factor=backoff_factor)
    config = as_optimizer_config(optimizer)
    if lr is not None:
        config = OptimizerConfig(**{**config.to_dict(), "lr": lr})
    if config.schedule.needs_horizon:
        config = OptimizerConfig(**{**config.to_dict(), "schedule": config.schedule.for_run(steps)})
    config = resolve_for(model, config, steps)  # an unset step size suits the run's length
    trainer = Trainer(
        model,
        data,
        optimizer=config,
        batch_size=batch_size,
        cd_k=cd_k,
        persistent=persistent,
        seed=seed,
        valid_data=valid_data,
        tempering=tempering,
    )
    history: list[dict[str, Any]] = []
    metrics, blowup = _checked_metrics(trainer, recovery, log_likelihood, steps)
    while True:
        if blowup is not None:
            try:
                history.append(recovery.recover(blowup, trainer).history_entry())
            except BlowUpError as error:
                error.history = history
                raise
        else:
            history.append(metrics)
            if callback is not None and callback(metrics) is False:
                break
            if trainer.step_count >= steps:
                break
        try:
            trainer.train_steps(min(every, steps - trainer.step_count))
        except DivergenceError as error:
            blowup = blowup_from_error(error, trainer.step_count)
            continue
        metrics, blowup = _checked_metrics(trainer, recovery, log_likelihood, steps)
    drift = recovery.drift(metrics)
    if drift is not None:
        logger.warning("%s", drift)
    return history


def _checked_metrics(
    trainer: Trainer, recovery: Recovery, log_likelihood: str, total_steps: int
) -> tuple[dict[str, Any], BlowUp | None]:
    """The trainer's metrics now, and the blow-up they show (or None)."""
    metrics = {**trainer.evaluate(log_likelihood), "total_steps": total_steps}
    logger.debug("step %d: %s", trainer.step_count, metrics)
    return metrics, recovery.check(metrics, trainer)
