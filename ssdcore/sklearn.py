"""scikit-learn estimators around ssdcore: drop-ins for ``sklearn.neural_network.BernoulliRBM``.

:class:`SSDBernoulliRBM` takes scikit-learn's parameter names where they mean the same thing
(``n_components``, ``learning_rate``, ``batch_size``, ``n_iter`` in epochs, ``verbose``,
``random_state``) and trains through :class:`ssdcore.Trainer`, so it gets ssdcore's optimizers
(Stochastic Spectral Descent by default), CD-k / PCD-k and divergence checks.
:class:`SSDGaussianRBM` is the same for real-valued features (standardize them first).

Defaults: ``n_components`` and ``n_iter`` are scikit-learn's (read from its BernoulliRBM), the
batch size, ``cd_k`` and the optimizer ssdcore's (:class:`ssdcore.Trainer`,
:class:`ssdcore.optim.OptimizerConfig`).

Differences from scikit-learn's estimator, on purpose:

- ``learning_rate="auto"`` (the default) takes the step size of ssdcore's step-size table
  (:mod:`ssdcore.step_sizes`) for the model and optimizer; scikit-learn's 0.1 is tuned for
  its plain SGD and is far too long for an SSD step.
- ``persistent=False`` (CD-k) as in ssdcore and the service; scikit-learn always runs PCD-1.
- An epoch's last partial batch is dropped (ssdcore's rule, :func:`ssdcore.steps_per_epoch`),
  and a batch larger than the data is cut to the data.
- :meth:`~_SSDRBM.score_samples` of the Bernoulli model is the exact pseudo-log-likelihood
  (every unit flipped in turn): deterministic, and the expectation of scikit-learn's one-bit
  estimate. The Gaussian model has no pseudo-likelihood; it scores ``-F(v)``, the
  log-likelihood up to the constant ``log Z``.
- :meth:`~_SSDRBM.gibbs` returns float32 samples (0.0/1.0 for binary units), not booleans.
- Computation is float32 (``transform`` returns float32 whatever the input dtype).
"""

from __future__ import annotations

import inspect
import numbers
import time
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
from ssdcore.models import RBM, BernoulliRBM, GaussianRBM
from ssdcore.models.gaussian import DEFAULT_MIN_VARIANCE, DEFAULT_VARIANCE, VARIANCE_KINDS
from ssdcore.optim import OptimizerConfig
from ssdcore.optim.config import CONFIG_METHODS, OPTIMIZER_NAMES
from ssdcore.training import DEFAULT_BATCH_SIZE, DEFAULT_CD_K, Trainer, steps_per_epoch


def _sklearn_default(parameter: str) -> Any:
    """scikit-learn's BernoulliRBM default for a parameter that ssdcore has no default for."""
    return inspect.signature(SklearnBernoulliRBM).parameters[parameter].default


SKLEARN_N_COMPONENTS: int = _sklearn_default("n_components")
SKLEARN_N_ITER: int = _sklearn_default("n_iter")
# learning_rate values that mean "the step-size table's value".
AUTO_LEARNING_RATE = ("auto", None)
# Seeds drawn from a RandomState (or numpy's global one, for random_state=None) lie below this.
_SEED_BOUND = 2**31 - 1
# Rows per chunk when scoring, so the exact pseudo-likelihood never holds a huge (B, V, H) block.
_SCORE_ROWS = 256


class _SSDRBM(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """What the Bernoulli and the Gaussian estimator share; see the module docstring."""

    # What verbose output calls the mean of score_samples.
    _score_name: ClassVar[str] = "score"

    # --- fitting ----------------------------------------------------------------------------

    def fit(self, X: Any, y: Any = None) -> _SSDRBM:
        """Train a fresh model for ``n_iter`` epochs over ``X`` (n_samples, n_features)."""
        self._check_training_parameters()
        data = self._validated(X, reset=True)
        seed = self._start(data.shape[1])
        trainer = self._trainer(data, seed)
        per_epoch = steps_per_epoch(data.shape[0], trainer.batch_size)
        for epoch in range(1, self.n_iter + 1):
            started = time.perf_counter()
            trainer.train_steps(per_epoch)
            self._report(epoch, data, time.perf_counter() - started)
        self._keep_training_state(trainer, seed, calls=0)
        return self

    def partial_fit(self, X: Any, y: Any = None) -> _SSDRBM:
        """One epoch over ``X``, continuing the model (and the optimizer's state and PCD chains)
        of earlier calls; the first call starts a fresh model. With no more rows than
        ``batch_size`` that is one step on all of ``X``, as scikit-learn's ``partial_fit``."""
        self._check_training_parameters()
        first = not hasattr(self, "model_")
        data = self._validated(X, reset=first)
        if first:
            seed, calls = self._start(data.shape[1]), 0
        else:
            seed, calls = self._training_state_["seed"], self._training_state_["calls"] + 1
        # Each call shuffles with its own seed; the CD estimator's random stream and the
        # optimizer's state continue from the last call.
        trainer = self._trainer(data, seed + calls)
        if not first:
            trainer.estimator.load_state_dict(self._training_state_["estimator"])
            trainer.optimizer.load_state_dict(self._training_state_["optimizer"])
        trainer.train_steps(steps_per_epoch(data.shape[0], trainer.batch_size))
        self._keep_training_state(trainer, seed, calls)
        return self

    def _start(self, n_features: int) -> int:
        """A fresh model for ``n_features`` inputs; returns the seed it was drawn with."""
        seed = self._new_seed()
        self.model_ = self._new_model(n_features, seed)
        # What gibbs() draws from, as scikit-learn's estimator keeps it.
        self.random_state_ = check_random_state(seed)
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

    def _keep_training_state(self, trainer: Trainer, seed: int, calls: int) -> None:
        """What a following ``partial_fit`` continues from (tensors only: picklable)."""
        self._training_state_ = {
            "seed": seed,
            "calls": calls,
            "estimator": trainer.estimator.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
        }
        self.learning_rate_ = trainer.lr
        self._n_features_out = self.model_.n_hidden

    def _optimizer_config(self) -> OptimizerConfig:
        return OptimizerConfig(
            name=self.optimizer,
            lr=None if self.learning_rate in AUTO_LEARNING_RATE else self.learning_rate,
            method=self.method,
            max_spectral_norm=self.max_spectral_norm,
        )

    def _check_training_parameters(self) -> None:
        """ValueError naming the estimator parameter, before ssdcore names its own field."""
        name = type(self).__name__
        if not _is_int(self.n_components, minimum=1):
            raise ValueError(
                f"{name}: n_components must be an integer >= 1, got {self.n_components!r}"
            )
        if not _is_int(self.n_iter, minimum=0):
            raise ValueError(
                f"{name}: n_iter (epochs) must be an integer >= 0, got {self.n_iter!r}"
            )
        if not _is_int(self.batch_size, minimum=1):
            raise ValueError(f"{name}: batch_size must be an integer >= 1, got {self.batch_size!r}")
        if not _is_int(self.cd_k, minimum=1):
            raise ValueError(
                f"{name}: cd_k (Gibbs sweeps) must be an integer >= 1, got {self.cd_k!r}"
            )
        if self.optimizer not in OPTIMIZER_NAMES:
            raise ValueError(
                f"{name}: optimizer {self.optimizer!r} is unknown; choose one of {OPTIMIZER_NAMES}"
            )
        if self.method not in CONFIG_METHODS:
            raise ValueError(
                f"{name}: method {self.method!r} is unknown; choose one of {CONFIG_METHODS}"
            )
        auto = isinstance(self.learning_rate, str | type(None))
        if auto and self.learning_rate not in AUTO_LEARNING_RATE:
            raise ValueError(
                f"{name}: learning_rate must be a number > 0 or 'auto' (the step-size table's "
                f"value), got {self.learning_rate!r}"
            )
        if not auto and not (
            isinstance(self.learning_rate, numbers.Real)
            and np.isfinite(self.learning_rate)
            and self.learning_rate > 0
        ):
            raise ValueError(
                f"{name}: learning_rate must be a finite number > 0 or 'auto', "
                f"got {self.learning_rate!r}"
            )

    def _new_seed(self) -> int:
        """random_state as an integer seed: itself for an int, else drawn from it."""
        if _is_int(self.random_state, minimum=0):
            return int(self.random_state)
        return int(check_random_state(self.random_state).randint(_SEED_BOUND))

    def _new_model(self, n_features: int, seed: int) -> RBM:
        raise NotImplementedError

    # --- using the model --------------------------------------------------------------------

    def transform(self, X: Any) -> np.ndarray:
        """Hidden-unit probabilities p(h = 1 | v), (n_samples, n_components) float32."""
        check_is_fitted(self)
        data = self._validated(X, reset=False)
        with torch.no_grad():
            return self.model_.hidden_probs(data).cpu().numpy()

    def score_samples(self, X: Any) -> np.ndarray:
        """Per-sample score, higher for likelier samples (float64, as scikit-learn returns).

        Bernoulli: the exact pseudo-log-likelihood Σᵢ log p(vᵢ | v₋ᵢ). Gaussian: -F(v), the
        log-likelihood up to the model's constant log Z.
        """
        check_is_fitted(self)
        data = self._validated(X, reset=False)
        with torch.no_grad():
            scores = [self._score_rows(rows) for rows in data.split(_SCORE_ROWS)]
        return torch.cat(scores).cpu().numpy().astype(np.float64)

    def score(self, X: Any, y: Any = None) -> float:
        """Mean of :meth:`score_samples`, so a search can rank models on unlabelled data."""
        return float(np.mean(self.score_samples(X)))

    def _score_rows(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def gibbs(self, v: Any) -> np.ndarray:
        """One Gibbs sweep v → h → v from the visible rows ``v``: the sampled visible rows,
        float32 (0.0/1.0 for binary units). Draws from ``random_state_``."""
        check_is_fitted(self)
        data = self._validated(v, reset=False)
        generator = torch.Generator(device=data.device)
        generator.manual_seed(int(self.random_state_.randint(_SEED_BOUND)))
        with torch.no_grad():
            hidden = self.model_.sample_hidden(data, generator)
            return self.model_.sample_visible(hidden, generator).cpu().numpy()

    # --- parameters as scikit-learn names them ----------------------------------------------

    @property
    def components_(self) -> np.ndarray:
        """Weights (n_components, n_features): ssdcore's W transposed, as scikit-learn holds it."""
        check_is_fitted(self)
        return self.model_.W.detach().t().cpu().numpy()

    @property
    def intercept_hidden_(self) -> np.ndarray:
        """Hidden biases (n_components,): ssdcore's ``a``."""
        check_is_fitted(self)
        return self.model_.a.detach().cpu().numpy()

    @property
    def intercept_visible_(self) -> np.ndarray:
        """Visible biases (n_features,): ssdcore's ``b``."""
        check_is_fitted(self)
        return self.model_.b.detach().cpu().numpy()

    # --- input ------------------------------------------------------------------------------

    def _validated(self, X: Any, *, reset: bool) -> torch.Tensor:
        """X checked by scikit-learn's rules (shape, finiteness, n_features_in_,
        feature_names_in_), then as a float32 tensor on the model's device."""
        array = validate_data(
            self, X, accept_sparse="csr", dtype=(np.float32, np.float64), reset=reset
        )
        if sp.issparse(array):
            array = array.toarray()
        self._check_values(array)
        device = self.model_.W.device if hasattr(self, "model_") else torch.device(self.device)
        return torch.as_tensor(np.asarray(array, dtype=np.float32), device=device)

    def _check_values(self, array: np.ndarray) -> None:
        """Raise ValueError for values the model's visible units cannot take."""

    def _report(self, epoch: int, data: torch.Tensor, seconds: float) -> None:
        if not self.verbose:
            return
        with torch.no_grad():
            score = torch.cat([self._score_rows(rows) for rows in data.split(_SCORE_ROWS)])
        # verbose output goes to stdout, as scikit-learn's estimators print it.
        print(
            f"[{type(self).__name__}] Iteration {epoch}, "
            f"{self._score_name} = {float(score.mean()):.2f}, time = {seconds:.2f}s"
        )

    def __sklearn_tags__(self):  # type: ignore[no-untyped-def]
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        # float32 throughout: float32 in gives float32 out, float64 in gives float32 out too.
        tags.transformer_tags.preserves_dtype = ["float32"]
        return tags


class SSDBernoulliRBM(_SSDRBM):
    """Bernoulli RBM (binary visible and hidden units) trained by ssdcore.

    A drop-in for ``sklearn.neural_network.BernoulliRBM``; see the module docstring for the
    differences. Features must lie in [0, 1] (ValueError otherwise): scale them first.

    Parameters:
        n_components: hidden units.
        learning_rate: step size, or "auto" for the step-size table's value for ``optimizer``.
        batch_size: examples per step (cut to the number of samples when larger).
        n_iter: epochs (passes over the training data).
        verbose: print the mean pseudo-log-likelihood and the time of each epoch.
        random_state: seeds the initial weights, the data order and the CD draws.
        optimizer: "ssd" (Stochastic Spectral Descent), "sgd", "nesterov" or
            "ssd-preconditioned".
        method: polar method of the spectral step: "auto", "svd", "lowrank", "randomized",
            "newton-schulz".
        cd_k: Gibbs sweeps per gradient estimate.
        persistent: persistent chains (PCD-k, what scikit-learn runs) instead of CD-k.
        max_spectral_norm: keep ‖W‖₂ at most this (None: unbounded).
        device: torch device to train and compute on ("cpu", "cuda").

    Attributes: ``components_`` (n_components, n_features), ``intercept_hidden_``,
    ``intercept_visible_``, ``n_features_in_``, ``feature_names_in_`` (for named columns),
    ``model_`` (the ssdcore model), ``learning_rate_`` (the step size used),
    ``random_state_`` (the RandomState that :meth:`gibbs` draws from).
    """

    _score_name = "pseudo-likelihood"

    def __init__(
        self,
        n_components: int = SKLEARN_N_COMPONENTS,
        *,
        learning_rate: float | str | None = "auto",
        batch_size: int = DEFAULT_BATCH_SIZE,
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
        self.n_components = n_components
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.n_iter = n_iter
        self.verbose = verbose
        self.random_state = random_state
        self.optimizer = optimizer
        self.method = method
        self.cd_k = cd_k
        self.persistent = persistent
        self.max_spectral_norm = max_spectral_norm
        self.device = device

    def _new_model(self, n_features: int, seed: int) -> RBM:
        generator = torch.Generator().manual_seed(seed)
        return BernoulliRBM(n_features, self.n_components, generator=generator).to(self.device)

    def _check_values(self, array: np.ndarray) -> None:
        if array.size == 0:
            return
        low, high = float(array.min()), float(array.max())
        if low < 0 or high > 1:
            raise ValueError(
                f"{type(self).__name__}: X holds values from {low:g} to {high:g}, but binary "
                "visible units take probabilities in [0, 1]; scale the features into [0, 1] "
                "(e.g. MinMaxScaler) or use SSDGaussianRBM for real-valued features"
            )

    def _score_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return _pll_exact(self.model_, rows)


class SSDGaussianRBM(_SSDRBM):
    """Gaussian RBM (real-valued visible units, binary hidden units) trained by ssdcore.

    The same parameters as :class:`SSDBernoulliRBM`, plus ``variance`` (the covariance form:
    "identity", "isotropic", "diagonal", "full") and ``min_variance`` (the floor of the learned
    variances). Parameters start as ssdcore's (zero biases, unit variances), so standardize the
    features first (e.g. ``StandardScaler`` in a Pipeline), as the service does by default.
    ``score_samples`` is -F(v): the log-likelihood up to the constant log Z.
    """

    _score_name = "-free energy"

    def __init__(
        self,
        n_components: int = SKLEARN_N_COMPONENTS,
        *,
        learning_rate: float | str | None = "auto",
        batch_size: int = DEFAULT_BATCH_SIZE,
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
        self.n_components = n_components
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.n_iter = n_iter
        self.verbose = verbose
        self.random_state = random_state
        self.optimizer = optimizer
        self.method = method
        self.cd_k = cd_k
        self.persistent = persistent
        self.max_spectral_norm = max_spectral_norm
        self.device = device
        self.variance = variance
        self.min_variance = min_variance

    def _new_model(self, n_features: int, seed: int) -> RBM:
        if self.variance not in VARIANCE_KINDS:
            raise ValueError(
                f"{type(self).__name__}: variance {self.variance!r} is unknown; choose one of "
                f"{VARIANCE_KINDS}"
            )
        generator = torch.Generator().manual_seed(seed)
        model = GaussianRBM(
            n_features,
            self.n_components,
            self.variance,
            min_variance=self.min_variance,
            generator=generator,
        )
        return model.to(self.device)

    def _score_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return -self.model_.free_energy(rows)


def _is_int(value: object, *, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


__all__ = ["SSDBernoulliRBM", "SSDGaussianRBM"]
