"""ssdrbm.estimator.RemoteRBM against a real service: fit trains a job on the uploaded data,
transform is the service's SampleHidden, and it works as a Pipeline step."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from ssdrbm import Client, DeadlineExceeded, InvalidArgument, JobState
from ssdrbm.estimator import RemoteRBM

from tests.fixtures.service import RunningService

JOB_TIMEOUT_S = 120


def labelled_binary_data(n: int = 200, v: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Noisy copies of two binary prototypes, labelled by prototype."""
    rng = np.random.default_rng(seed)
    prototypes = (rng.random((2, v)) < 0.5).astype(np.float32)
    labels = rng.integers(0, 2, n)
    flips = rng.random((n, v)) < 0.1
    return np.abs(prototypes[labels] - flips).astype(np.float32), labels


def test_fit_trains_a_job_transform_is_sample_hidden_and_it_fits_a_pipeline(
    service: RunningService,
) -> None:
    x, _ = labelled_binary_data()
    estimator = RemoteRBM(
        n_components=8,
        n_iter=2,
        batch_size=20,
        random_state=5,
        target=service.target,
        timeout=JOB_TIMEOUT_S,
    ).fit(x)
    job = estimator.job_
    assert job.state is JobState.SUCCEEDED and job.id == estimator.job_id_
    assert estimator.n_components_ == 8 and estimator.n_features_in_ == 16
    # Parameters given are in the spec; those left unset were filled in by the service.
    assert job.spec["model"]["n_hidden"] == 8
    assert job.spec["training"]["epochs"] == 2 and job.spec["training"]["batch_size"] == 20
    assert job.spec["training"]["seed"] == 5  # a number, not proto JSON's string for 64 bits
    assert job.spec["dataset"]["dataset_id"] == estimator.dataset_id_
    assert job.spec["optimizer"]["kind"] and job.spec["optimizer"]["lr"] > 0
    # The service held out its default validation share: 180 of 200 rows, 9 steps an epoch.
    assert job.total_steps == 2 * 9

    features = estimator.transform(x)
    with Client(service.target) as client:
        expected = client.sample_hidden(job.id, x)
    assert features.dtype == np.float32 and features.shape == (200, 8)
    np.testing.assert_array_equal(features, expected)
    assert list(estimator.get_feature_names_out()[:2]) == ["remoterbm0", "remoterbm1"]
    # The exported parameters, in scikit-learn's layout, give the same probabilities.
    assert estimator.components_.shape == (8, 16) and estimator.intercept_visible_.shape == (16,)
    logits = x @ estimator.components_.T + estimator.intercept_hidden_
    np.testing.assert_allclose(features, 1 / (1 + np.exp(-logits)), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="16 features"):
        estimator.transform(x[:, :4])

    # In a Pipeline (a second job on the same service).
    x, y = labelled_binary_data(seed=1)
    pipeline = Pipeline(
        [
            ("rbm", RemoteRBM(n_components=8, n_iter=3, batch_size=20, target=service.target)),
            ("logistic", LogisticRegression()),
        ]
    )
    pipeline.fit(x, y)
    assert pipeline.score(x, y) > 0.9  # two well-separated prototypes
    copy = clone(pipeline)
    assert copy.get_params()["rbm__target"] == service.target
    assert not hasattr(copy.named_steps["rbm"], "job_id_")


def test_unset_parameters_stay_unset() -> None:
    assert RemoteRBM().training_arguments() == {}
    arguments = RemoteRBM(n_components=4, learning_rate=1e-3, n_iter=3).training_arguments()
    assert arguments == {"n_hidden": 4, "lr": 1e-3, "epochs": 3}
    with pytest.raises(ValueError, match="random_state must be an integer seed"):
        RemoteRBM(random_state=np.random.RandomState(0)).training_arguments()


def test_service_refusal_reaches_the_caller_with_its_field(service: RunningService) -> None:
    x, _ = labelled_binary_data()
    with pytest.raises(InvalidArgument, match=r"dataset\.preprocess"):
        RemoteRBM(n_components=4, target=service.target).fit(3 * x)  # not probabilities


def test_a_fit_that_times_out_cancels_its_job(service: RunningService) -> None:
    x, _ = labelled_binary_data()
    estimator = RemoteRBM(n_components=8, n_iter=100_000, target=service.target, timeout=1.0)
    with pytest.raises(DeadlineExceeded):
        estimator.fit(x)
    with Client(service.target) as client:
        (job,) = client.list_jobs()
        assert client.wait(job.id, timeout=JOB_TIMEOUT_S).state is JobState.CANCELLED
    assert not hasattr(estimator, "job_id_")


def test_without_scikit_learn_the_import_error_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what an installation without it gives
    monkeypatch.delitem(sys.modules, "ssdrbm.estimator")
    with pytest.raises(ImportError, match=r"pip install './client\[sklearn\]'"):
        importlib.import_module("ssdrbm.estimator")
