"""A scikit-learn estimator whose training runs on the ssdrbm service: :class:`RemoteRBM`.

from sklearn.pipeline import make_pipeline
from sklearn.linear_model import LogisticRegression
from ssdrbm.estimator import RemoteRBM

pipeline = make_pipeline(RemoteRBM(n_components=100, n_iter=10), LogisticRegression())
pipeline.fit(X_train, y_train)   # X in [0, 1]: uploaded, trained as a job, awaited

Needs scikit-learn (the ``sklearn`` extra: ``pip install './client[sklearn]'`` in a checkout);
the rest of the SDK does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
    from sklearn.utils.validation import check_is_fitted, validate_data
except ImportError as error:  # scikit-learn is an optional extra of the client
    raise ImportError(
        "ssdrbm.estimator needs scikit-learn >= 1.6: install the 'sklearn' extra, in a checkout "
        "pip install './client[sklearn]'"
    ) from error

from ssdrbm.client import Client
from ssdrbm.errors import DeadlineExceeded
from ssdrbm.events import Job, JobState

# The parameters named as scikit-learn names them, by their start_training keyword; every other
# parameter but target and timeout is the keyword of the same name.
_TRAINING_NAMES = {
    "n_components": "n_hidden",
    "learning_rate": "lr",
    "n_iter": "epochs",
    "random_state": "seed",
}


class TrainingFailed(RuntimeError):
    """The training job ended FAILED or CANCELLED; ``job`` is its final record."""

    def __init__(self, job: Job) -> None:
        super().__init__(
            f"training job {job.id} ended {job.state.value}: {job.error or 'no error given'}"
        )
        self.job = job


class RemoteRBM(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """An RBM feature extractor trained by the ssdrbm service, usable in a Pipeline.

    ``fit(X)`` uploads X as a dataset (float32; content-addressed, so the same X is stored
    once), submits a training job on it and waits for the job to end; ``transform(X)`` returns
    the hidden-unit probabilities from the service's SampleHidden. Every parameter left as None
    is sent unset, so the service fills in its own default (``ssdrbm defaults`` lists them;
    ``job_.spec`` shows what was used). The job and the dataset stay on the service after ``fit``
    (``Client.delete_job(job_id_)`` and ``Client.delete_dataset(dataset_id_)`` remove them);
    ``transform`` needs the job.

    Parameters (scikit-learn's names where ``sklearn.neural_network.BernoulliRBM`` has one):
        n_components: hidden units (the request's ``n_hidden``).
        model: "bernoulli" (features in [0, 1]) or "gaussian".
        variance: Gaussian covariance form: "identity", "isotropic", "diagonal", "full".
        learning_rate: step size (``lr``).
        batch_size: examples per step.
        n_iter: epochs.
        random_state: integer seed (``seed``).
        optimizer: "ssd", "sgd", "nesterov", "ssd-preconditioned".
        method: polar method of the spectral step.
        cd_k: Gibbs sweeps per gradient estimate.
        persistent: PCD-k instead of CD-k.
        validation_fraction: share of X the service holds out for its validation metrics.
        target: ``host:port`` of the service (None: ``$SSDRBM_TARGET`` or the SDK's default).
            The token and TLS settings come from the ``SSDRBM_TOKEN`` / ``SSDRBM_TLS*``
            variables, so no credential is ever a parameter (parameters are printed, cloned
            and pickled).
        timeout: seconds to wait for the job (None: no limit). A job still running then is
            cancelled and ``fit`` raises :class:`~ssdrbm.errors.DeadlineExceeded`.

    Attributes after ``fit``: ``job_id_``, ``job_`` (the final :class:`~ssdrbm.Job`),
    ``dataset_id_``, ``n_components_`` (as the service resolved it), ``components_``
    (n_components, n_features), ``intercept_hidden_``, ``intercept_visible_`` (the trained
    model's parameters, as exported), ``n_features_in_``, ``feature_names_in_`` (for named
    columns).
    """

    def __init__(
        self,
        n_components: int | None = None,
        *,
        model: str | None = None,
        variance: str | None = None,
        learning_rate: float | None = None,
        batch_size: int | None = None,
        n_iter: int | None = None,
        random_state: int | None = None,
        optimizer: str | None = None,
        method: str | None = None,
        cd_k: int | None = None,
        persistent: bool | None = None,
        validation_fraction: float | None = None,
        target: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.n_components = n_components
        self.model = model
        self.variance = variance
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.n_iter = n_iter
        self.random_state = random_state
        self.optimizer = optimizer
        self.method = method
        self.cd_k = cd_k
        self.persistent = persistent
        self.validation_fraction = validation_fraction
        self.target = target
        self.timeout = timeout

    def training_arguments(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`ssdrbm.Client.start_training` these parameters give
        (unset ones left out, so the service supplies them)."""
        if self.random_state is not None and (
            isinstance(self.random_state, bool) or not isinstance(self.random_state, int)
        ):
            raise ValueError(
                f"RemoteRBM: random_state must be an integer seed or None (the service's "
                f"default seed), got {self.random_state!r}"
            )
        return {
            _TRAINING_NAMES.get(name, name): value
            for name, value in self.get_params().items()
            if value is not None and name not in ("target", "timeout")
        }

    def fit(self, X: Any, y: Any = None) -> RemoteRBM:
        """Upload X, train a job on it and wait for it; raises :class:`TrainingFailed` when the
        job fails or is cancelled."""
        data = validate_data(self, X, dtype=np.float32, reset=True)
        arguments = self.training_arguments()
        with Client(self.target) as client:
            dataset_id = client.upload_dataset(np.ascontiguousarray(data))
            job = client.start_training(dataset_id=dataset_id, **arguments)
            try:
                final = client.wait(job.id, timeout=self.timeout)
            except DeadlineExceeded:
                # The caller gave up on this fit: do not leave the job using the service.
                client.cancel(job.id)
                raise
            if final.state is not JobState.SUCCEEDED:
                raise TrainingFailed(final)
            parameters = client.fetch_model(final.id).parameters
        # scikit-learn's names and layout: weights (n_components, n_features).
        self.components_ = parameters["W"].T
        self.intercept_hidden_ = parameters["a"]
        self.intercept_visible_ = parameters["b"]
        self.dataset_id_ = dataset_id
        self.job_id_ = final.id
        self.job_ = final
        self.n_components_ = int(final.spec["model"]["n_hidden"])
        self._n_features_out = self.n_components_
        return self

    def transform(self, X: Any) -> np.ndarray:
        """Hidden-unit probabilities (n_samples, n_components_) float32, from SampleHidden."""
        check_is_fitted(self)
        data = validate_data(self, X, dtype=np.float32, reset=False)
        with Client(self.target) as client:
            return client.sample_hidden(self.job_id_, np.ascontiguousarray(data))

    def __sklearn_tags__(self):  # type: ignore[no-untyped-def]
        tags = super().__sklearn_tags__()
        tags.transformer_tags.preserves_dtype = ["float32"]
        return tags


__all__ = ["RemoteRBM", "TrainingFailed"]
