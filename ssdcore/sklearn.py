"""scikit-learn estimators around ssdcore: ``from ssdcore.sklearn import BernoulliRBM`` replaces
``from sklearn.neural_network import BernoulliRBM`` with no other edit.

:class:`BernoulliRBM` takes scikit-learn's constructor parameters with its defaults (read from the
installed scikit-learn), its methods, its fitted attributes with their dtypes and the inputs it
takes (dense or CSR/CSC sparse, any numeric dtype). It trains through :class:`ssdcore.Trainer`,
with ssdcore's optimizers (SSD by default), CD-k / PCD-k and divergence checks chosen by extra
keyword parameters. :class:`GaussianRBM` is the same for real-valued features (standardize them
first). ``SSDBernoulliRBM`` and ``SSDGaussianRBM`` are the earlier names of the two classes.

``learning_rate`` is in scikit-learn's units: the step taken (``learning_rate_``) is the
step-size table's value for the model and optimizer (:mod:`ssdcore.step_sizes`) times
``learning_rate / 0.1``, 0.1 being scikit-learn's default. That default gives the table's tuned
step for whichever optimizer runs (for SSD on the Bernoulli model 0.1 itself would be about 30
times too long); for the Bernoulli model with ``optimizer="sgd"`` the table's value is 0.1, so
the step is ``learning_rate`` itself, scikit-learn's semantics.

Where it differs from scikit-learn's estimator, on purpose:

- CD-k (``persistent=False``) by default; scikit-learn always runs PCD-1.
- An epoch's last partial batch is dropped (:func:`ssdcore.steps_per_epoch`), and a batch
  larger than the data is cut to the data. ``partial_fit`` is one epoch over its rows (one step
  when they fit in one batch, as scikit-learn's) and returns the estimator.
- ``score_samples`` of the Bernoulli model is the exact pseudo-log-likelihood (every unit flipped
  in turn): the expectation of scikit-learn's one-random-unit estimate. The Gaussian model scores
  ``-F(v)``, the log-likelihood up to the constant ``log Z``.
- The model computes in float32; results and fitted attributes come back in scikit-learn's
  dtypes, so a float64 input is rounded to float32 on the way in. Sparse input is made dense.
- ``h_samples_`` holds the persistent chains under PCD; under CD-k, the hidden states of ``cd_k``
  Gibbs sweeps started from the first batch of the training rows.
- Binary visible units given values outside [0, 1] raise a :class:`UnitIntervalWarning` and are
  used as given.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import time
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp
import torch
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
from sklearn.neural_network import BernoulliRBM as SklearnBernoulliRBM
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted, validate_data

# The per-example terms that ssdcore.pseudo_log_likelihood averages.
from ssdcore.evaluation.metrics import _pll_exact
from ssdcore.models import RBM
from ssdcore.models import BernoulliRBM as BernoulliModel
from ssdcore.models import GaussianRBM as GaussianModel
from ssdcore.models.gaussian import DEFAULT_MIN_VARIANCE, DEFAULT_VARIANCE, VARIANCE_KINDS
from ssdcore.optim import OptimizerConfig
from ssdcore.optim.config import CONFIG_METHODS, OPTIMIZER_NAMES, resolve_for
from ssdcore.training import DEFAULT_CD_K, Trainer, steps_per_epoch


def _sklearn_default(parameter: str) -> Any:
    """scikit-learn's BernoulliRBM default for ``parameter``."""
    return inspect.signature(SklearnBernoulliRBM).parameters[parameter].default


SKLEARN_N_COMPONENTS: int = _sklearn_default("n_components")
SKLEARN_LEARNING_RATE: float = _sklearn_default("learning_rate")
SKLEARN_BATCH_SIZE: int = _sklearn_default("batch_size")
SKLEARN_N_ITER: int = _sklearn_default("n_iter")
# The dtypes fit and transform keep, as scikit-learn's estimator: the first is what others become.
KEPT_DTYPES = (np.float64, np.float32)
# Seeds drawn from a RandomState (or numpy's global one, for random_state=None) lie below this.
_SEED_BOUND = 2**31 - 1
# Rows per chunk when scoring, so the exact pseudo-likelihood never holds a huge (B, V, H) block.
_SCORE_ROWS = 256


class UnitIntervalWarning(UserWarning):
    """Binary visible units were given values outside [0, 1]; they are used as given."""


class _RBMEstimator(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """What the Bernoulli and the Gaussian estimator share; see the module docstring."""

    # What verbose output calls the mean of score_samples.
    _score_name: ClassVar[str] = "score"

    def _keep_parameters(self, given: Mapping[str, Any]) -> None:
        """Each ``__init__`` parameter kept as given, under its own name: scikit-learn's rule
        for estimators (get_params and clone read them back; fit checks them)."""
        for name in self._get_param_names():
            setattr(self, name, given[name])

    # --- fitting ----------------------------------------------------------------------------

    def fit(self, X: Any, y: Any = None) -> _RBMEstimator:
        """Train a fresh model for ``n_iter`` epochs over ``X`` (n_samples, n_features)."""
        self._check_training_parameters()
        data, dtype = self._input(X, reset=True, dtype=KEPT_DTYPES)
        seed = self._start(data.shape[1], dtype)
        trainer = self._trainer(data, seed)
        per_epoch = steps_per_epoch(data.shape[0], trainer.batch_size)
        for epoch in range(1, self.n_iter + 1):
            started = time.perf_counter()
            trainer.train_steps(per_epoch)
            self._report(epoch, data, time.perf_counter() - started)
        self._keep_training_state(trainer, data, seed, calls=0)
        return self

    def partial_fit(self, X: Any, y: Any = None) -> _RBMEstimator:
        """One epoch over ``X``, continuing the model (and the optimizer's state and PCD chains)
        of earlier calls; the first call starts a fresh model. With no more rows than
        ``batch_size`` that is one step on all of ``X``, as scikit-learn's ``partial_fit``. The
        fitted attributes are float64, as scikit-learn's ``partial_fit`` keeps them."""
        self._check_training_parameters()
        first = not hasattr(self, "model_")
        data, _ = self._input(X, reset=first, dtype=np.float64)
        if first:
            seed, calls = self._start(data.shape[1], np.dtype(np.float64)), 0
        else:
            seed, calls = self._training_state_["seed"], self._training_state_["calls"] + 1
        # Each call shuffles with its own seed; the CD estimator's random stream and the
        # optimizer's state continue from the last call.
        trainer = self._trainer(data, seed + calls)
        if not first:
            trainer.estimator.load_state_dict(self._training_state_["estimator"])
            trainer.optimizer.load_state_dict(self._training_state_["optimizer"])
        trainer.train_steps(steps_per_epoch(data.shape[0], trainer.batch_size))
        self._keep_training_state(trainer, data, seed, calls)
        return self

    def _start(self, n_features: int, dtype: np.dtype) -> int:
        """A fresh model for ``n_features`` inputs; returns the seed it was drawn with."""
        seed = self._new_seed()
        generator = torch.Generator().manual_seed(seed)
        self.model_ = self._new_model(n_features, generator).to(self.device)
        # What gibbs() draws from, as scikit-learn's estimator keeps it.
        self.random_state_ = check_random_state(seed)
        # The dtype of the fitted attributes and (with the input's) of the results.
        self._fitted_dtype = np.dtype(dtype)
        return seed

    def _trainer(self, data: torch.Tensor, seed: int) -> Trainer:
        return Trainer(
            self.model_,
            data,
            optimizer=self._optimizer_config(),
            batch_size=min(self.batch_size, data.shape[0]),
            cd_k=self.cd_k,
            persistent=self.persistent,
            seed=seed,
        )

    def _keep_training_state(
        self, trainer: Trainer, data: torch.Tensor, seed: int, calls: int
    ) -> None:
        """What a following ``partial_fit`` continues from (tensors only: picklable)."""
        self._training_state_ = {
            "seed": seed,
            "calls": calls,
            "estimator": trainer.estimator.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
        }
        self.learning_rate_ = trainer.lr
        self._n_features_out = self.model_.n_hidden
        chains = trainer.estimator.chains
        if chains is None:  # CD-k keeps none: its negative phase from the first batch
            chains = self._negative_phase(data[: trainer.batch_size], seed)
        self.h_samples_ = chains.cpu().numpy().astype(self._fitted_dtype)

    def _negative_phase(self, rows: torch.Tensor, seed: int) -> torch.Tensor:
        """Hidden states after ``cd_k`` Gibbs sweeps from ``rows``, drawn with ``seed``."""
        generator = torch.Generator(device=rows.device).manual_seed(seed)
        with torch.no_grad():
            hidden = self.model_.sample_hidden(rows, generator)
            for _ in range(self.cd_k):
                visible = self.model_.sample_visible(hidden, generator)
                hidden = self.model_.sample_hidden(visible, generator)
        return hidden

    def _optimizer_config(self) -> OptimizerConfig:
        """The optimizer at the step-size table's steps times learning_rate / scikit-learn's
        default (see the module docstring)."""
        config = resolve_for(
            self.model_,
            OptimizerConfig(
                name=self.optimizer, method=self.method, max_spectral_norm=self.max_spectral_norm
            ),
        )
        # The ratio first, so that scikit-learn's default gives the table's value exactly.
        scale = float(self.learning_rate) / SKLEARN_LEARNING_RATE
        assert config.lr is not None  # resolved
        return dataclasses.replace(
            config,
            lr=config.lr * scale,
            per_parameter_lr={name: lr * scale for name, lr in config.per_parameter_lr.items()},
        )

    def _check_training_parameters(self) -> None:
        """ValueError naming the estimator parameter, before ssdcore names its own field."""
        name = type(self).__name__
        counts = (
            ("n_components", "", 1),
            ("n_iter", " (epochs)", 0),
            ("batch_size", "", 1),
            ("cd_k", " (Gibbs sweeps)", 1),
        )
        for parameter, meaning, minimum in counts:
            value = getattr(self, parameter)
            if not _is_int(value, minimum=minimum):
                raise ValueError(
                    f"{name}: {parameter}{meaning} must be an integer >= {minimum}, got {value!r}"
                )
        for parameter, choices in (("optimizer", OPTIMIZER_NAMES), ("method", CONFIG_METHODS)):
            value = getattr(self, parameter)
            if value not in choices:
                raise ValueError(
                    f"{name}: {parameter} {value!r} is unknown; choose one of {choices}"
                )
        if not (
            isinstance(self.learning_rate, numbers.Real)
            and not isinstance(self.learning_rate, bool)
            and np.isfinite(self.learning_rate)
            and self.learning_rate > 0
        ):
            raise ValueError(
                f"{name}: learning_rate must be a finite number > 0 (scikit-learn's units; "
                f"{SKLEARN_LEARNING_RATE:g}, its default, takes the step-size table's step), "
                f"got {self.learning_rate!r}"
            )

    def _new_seed(self) -> int:
        """random_state as an integer seed: itself for an int, else drawn from it."""
        if _is_int(self.random_state, minimum=0):
            return int(self.random_state)
        return int(check_random_state(self.random_state).randint(_SEED_BOUND))

    def _new_model(self, n_features: int, generator: torch.Generator) -> RBM:
        """A fresh CPU model for ``n_features`` inputs, its weights drawn from ``generator``."""
        raise NotImplementedError

    # --- using the model --------------------------------------------------------------------

    def transform(self, X: Any) -> np.ndarray:
        """Hidden-unit probabilities p(h = 1 | v), (n_samples, n_components), in scikit-learn's
        dtype (float32 for float32 input to a float32 fit, else float64)."""
        check_is_fitted(self)
        data, dtype = self._input(X, reset=False, dtype=KEPT_DTYPES)
        with torch.no_grad():
            return self._output(self.model_.hidden_probs(data), dtype)

    def score_samples(self, X: Any) -> np.ndarray:
        """Per-sample score, higher for likelier samples, in scikit-learn's dtype. Bernoulli: the
        exact pseudo-log-likelihood Σᵢ log p(vᵢ | v₋ᵢ). Gaussian: -F(v), the log-likelihood up to
        the model's constant log Z."""
        check_is_fitted(self)
        data, dtype = self._input(X, reset=False, dtype="numeric")
        # scikit-learn's sparse path computes in float64 whatever the dtype.
        return self._output(self._scores(data), np.dtype(np.float64) if sp.issparse(X) else dtype)

    def score(self, X: Any, y: Any = None) -> float:
        """Mean of :meth:`score_samples`, so a search can rank models on unlabelled data."""
        return float(np.mean(self.score_samples(X)))

    @torch.no_grad()
    def _scores(self, data: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._score_rows(rows) for rows in data.split(_SCORE_ROWS)])

    def _score_rows(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gibbs(self, v: Any) -> np.ndarray:
        """One Gibbs sweep v → h → v from the visible rows ``v``: the sampled visible rows
        (booleans for binary units, as scikit-learn's). Draws from ``random_state_``."""
        check_is_fitted(self)
        data, dtype = self._input(v, reset=False, dtype=KEPT_DTYPES)
        generator = torch.Generator(device=data.device)
        generator.manual_seed(int(self.random_state_.randint(_SEED_BOUND)))
        with torch.no_grad():
            hidden = self.model_.sample_hidden(data, generator)
            return self._visible_output(self.model_.sample_visible(hidden, generator), dtype)

    def _visible_output(self, visible: torch.Tensor, dtype: np.dtype) -> np.ndarray:
        return self._output(visible, dtype)

    # --- parameters as scikit-learn names them ----------------------------------------------

    @property
    def components_(self) -> np.ndarray:
        """Weights (n_components, n_features): ssdcore's W transposed, as scikit-learn holds it."""
        check_is_fitted(self)
        return self._parameter(self.model_.W.t())

    @property
    def intercept_hidden_(self) -> np.ndarray:
        """Hidden biases (n_components,): ssdcore's ``a``."""
        check_is_fitted(self)
        return self._parameter(self.model_.a)

    @property
    def intercept_visible_(self) -> np.ndarray:
        """Visible biases (n_features,): ssdcore's ``b``."""
        check_is_fitted(self)
        return self._parameter(self.model_.b)

    def _parameter(self, tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().cpu().numpy().astype(self._fitted_dtype)

    # --- input and output -------------------------------------------------------------------

    def _input(self, X: Any, *, reset: bool, dtype: Any) -> tuple[torch.Tensor, np.dtype]:
        """X checked by scikit-learn's rules (shape, finiteness, n_features_in_,
        feature_names_in_) and converted to ``dtype`` as scikit-learn's estimator does; returns
        it as a float32 tensor on the model's device, and the dtype it was converted to."""
        array = validate_data(self, X, accept_sparse=["csr", "csc"], dtype=dtype, reset=reset)
        converted_to = array.dtype
        # float32 before densifying a sparse matrix, so no float64 dense copy is ever made.
        array = array.astype(np.float32, copy=False)
        if sp.issparse(array):
            array = array.toarray()
        if not array.flags.writeable:  # torch wraps only writable arrays (a read-only memmap)
            array = array.copy()
        self._check_values(array)
        device = self.model_.W.device if hasattr(self, "model_") else torch.device(self.device)
        return torch.as_tensor(array, device=device), converted_to

    def _output(self, values: torch.Tensor, input_dtype: np.dtype) -> np.ndarray:
        """``values`` as numpy in the dtype scikit-learn's arithmetic gives: the input's and the
        fitted attributes' dtypes promoted together."""
        dtype = np.result_type(input_dtype, self._fitted_dtype)
        return values.cpu().numpy().astype(dtype, copy=False)

    def _check_values(self, array: np.ndarray) -> None:
        """Warn about values the model's visible units cannot take."""

    def _report(self, epoch: int, data: torch.Tensor, seconds: float) -> None:
        if not self.verbose:
            return
        # verbose output goes to stdout, as scikit-learn's estimators print it.
        print(
            f"[{type(self).__name__}] Iteration {epoch}, "
            f"{self._score_name} = {float(self._scores(data).mean()):.2f}, time = {seconds:.2f}s"
        )

    def __sklearn_tags__(self):  # type: ignore[no-untyped-def]
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        tags.transformer_tags.preserves_dtype = ["float64", "float32"]
        return tags


class BernoulliRBM(_RBMEstimator):
    """Bernoulli RBM (binary visible and hidden units) trained by ssdcore:
    ``sklearn.neural_network.BernoulliRBM`` with the same parameters, methods and fitted
    attributes (see the module docstring for what differs). Features belong in [0, 1].

    Parameters:
        n_components: hidden units.
        learning_rate: step size in scikit-learn's units (see the module docstring).
        batch_size: examples per step (cut to the number of samples when larger).
        n_iter: epochs (passes over the training data).
        verbose: print the mean pseudo-log-likelihood and the time of each epoch.
        random_state: seeds the initial weights, the data order and the CD draws.
        optimizer: "ssd" (Stochastic Spectral Descent), "sgd", "nesterov", "ssd-preconditioned".
        method: polar method: "auto", "svd", "lowrank", "randomized", "newton-schulz".
        cd_k: Gibbs sweeps per gradient estimate.
        persistent: persistent chains (PCD-k, what scikit-learn runs) instead of CD-k.
        max_spectral_norm: keep ‖W‖₂ at most this (None: unbounded).
        device: torch device to train and compute on ("cpu", "cuda").

    Attributes: scikit-learn's ``components_`` (n_components, n_features),
    ``intercept_hidden_``, ``intercept_visible_``, ``h_samples_`` (chains, n_components),
    ``n_features_in_``, ``feature_names_in_`` (for named columns), in the dtypes scikit-learn's
    estimator gives them; and ``model_`` (the ssdcore model), ``learning_rate_`` (the step size
    taken), ``random_state_`` (the RandomState that :meth:`gibbs` draws from).
    """

    _score_name = "pseudo-likelihood"

    def __init__(
        self,
        n_components: int = SKLEARN_N_COMPONENTS,
        *,
        learning_rate: float = SKLEARN_LEARNING_RATE,
        batch_size: int = SKLEARN_BATCH_SIZE,
        n_iter: int = SKLEARN_N_ITER,
        verbose: int = 0,
        random_state: int | np.random.RandomState | None = None,
        optimizer: str = OptimizerConfig.name,
        method: str = OptimizerConfig.method,
        cd_k: int = DEFAULT_CD_K,
        persistent: bool = False,
        max_spectral_norm: float | None = None,
        device: str = "cpu",
    ) -> None:
        self._keep_parameters(locals())

    def _new_model(self, n_features: int, generator: torch.Generator) -> RBM:
        return BernoulliModel(n_features, self.n_components, generator=generator)

    def _check_values(self, array: np.ndarray) -> None:
        if array.size == 0:
            return
        low, high = float(array.min()), float(array.max())
        if low < 0 or high > 1:
            warnings.warn(
                f"{type(self).__name__}: X holds values from {low:g} to {high:g}, but binary "
                "visible units take probabilities in [0, 1]; they are used as given. Scale the "
                "features into [0, 1] (e.g. MinMaxScaler) or use GaussianRBM for real-valued "
                "features",
                UnitIntervalWarning,
                stacklevel=4,
            )

    def _score_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return _pll_exact(self.model_, rows)

    def _visible_output(self, visible: torch.Tensor, dtype: np.dtype) -> np.ndarray:
        return visible.cpu().numpy().astype(bool)  # binary units, as scikit-learn's booleans


class GaussianRBM(_RBMEstimator):
    """Gaussian RBM (real-valued visible units, binary hidden units) trained by ssdcore.

    The parameters of :class:`BernoulliRBM`, plus ``variance`` (the covariance form: "identity",
    "isotropic", "diagonal", "full") and ``min_variance`` (the floor of the learned variances).
    Parameters start at zero biases and unit variances, so standardize the features first (e.g.
    ``StandardScaler`` in a Pipeline). ``score_samples`` is -F(v); ``gibbs`` returns real values.
    """

    _score_name = "-free energy"

    def __init__(
        self,
        n_components: int = SKLEARN_N_COMPONENTS,
        *,
        learning_rate: float = SKLEARN_LEARNING_RATE,
        batch_size: int = SKLEARN_BATCH_SIZE,
        n_iter: int = SKLEARN_N_ITER,
        verbose: int = 0,
        random_state: int | np.random.RandomState | None = None,
        optimizer: str = OptimizerConfig.name,
        method: str = OptimizerConfig.method,
        cd_k: int = DEFAULT_CD_K,
        persistent: bool = False,
        max_spectral_norm: float | None = None,
        device: str = "cpu",
        variance: str = DEFAULT_VARIANCE,
        min_variance: float = DEFAULT_MIN_VARIANCE,
    ) -> None:
        self._keep_parameters(locals())

    def _new_model(self, n_features: int, generator: torch.Generator) -> RBM:
        if self.variance not in VARIANCE_KINDS:
            raise ValueError(
                f"{type(self).__name__}: variance {self.variance!r} is unknown; choose one of "
                f"{VARIANCE_KINDS}"
            )
        return GaussianModel(
            n_features,
            self.n_components,
            self.variance,
            min_variance=self.min_variance,
            generator=generator,
        )

    def _score_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return -self.model_.free_energy(rows)


def _is_int(value: object, *, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


# The names the two estimators had before they took scikit-learn's.
SSDBernoulliRBM = BernoulliRBM
SSDGaussianRBM = GaussianRBM

__all__ = [
    "BernoulliRBM",
    "GaussianRBM",
    "SSDBernoulliRBM",
    "SSDGaussianRBM",
    "UnitIntervalWarning",
]
