"""ssdcore.sklearn: scikit-learn's estimator checks with no expected failure, the same signature,
fitted attributes and dtypes as scikit-learn's BernoulliRBM, exactness against a hand-run Trainer,
Pipeline and GridSearchCV use, and scikit-learn's digits example with only the import changed."""

from __future__ import annotations

import inspect
import time
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from sklearn.base import clone
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import GridSearchCV, train_test_split
from sklearn.neural_network import BernoulliRBM as SklearnBernoulliRBM
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler, minmax_scale
from sklearn.utils.estimator_checks import parametrize_with_checks
from threadpoolctl import threadpool_limits

import ssdcore
from ssdcore.sklearn import (
    SKLEARN_LEARNING_RATE,
    BernoulliRBM,
    GaussianRBM,
    SSDBernoulliRBM,
    SSDGaussianRBM,
    UnitIntervalWarning,
)
from ssdcore.step_sizes import default_lr

pytestmark = pytest.mark.usefixtures("one_thread")

# Small and short, so that each of scikit-learn's checks fits in a fraction of a second.
FAST = {"n_components": 4, "n_iter": 2, "random_state": 0}


# scikit-learn's checks feed real values to the binary units too: accepted with a warning.
@pytest.mark.filterwarnings("ignore::ssdcore.sklearn.UnitIntervalWarning")
@parametrize_with_checks([BernoulliRBM(**FAST), GaussianRBM(**FAST)])
def test_scikit_learn_estimator_checks(estimator, check) -> None:  # type: ignore[no-untyped-def]
    check(estimator)


def test_the_constructor_takes_scikit_learns_parameters_with_its_defaults() -> None:
    theirs = inspect.signature(SklearnBernoulliRBM).parameters
    for estimator in (BernoulliRBM, GaussianRBM):
        ours = inspect.signature(estimator).parameters
        # The same names in the same order, positional or keyword as scikit-learn has them.
        assert list(ours)[: len(theirs)] == list(theirs)
        for name, parameter in theirs.items():
            assert (ours[name].default, ours[name].kind) == (parameter.default, parameter.kind)
    assert SSDBernoulliRBM is BernoulliRBM and SSDGaussianRBM is GaussianRBM


def binary_data(n: int = 60, v: int = 12, seed: int = 0) -> np.ndarray:
    """Two noisy binary prototypes: something with structure to learn."""
    rng = np.random.default_rng(seed)
    prototypes = (rng.random((2, v)) < 0.5).astype(np.float32)
    flips = rng.random((n, v)) < 0.1
    return np.abs(prototypes[rng.integers(0, 2, n)] - flips).astype(np.float32)


def parameters(model: ssdcore.RBM) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("batch_size", "n_iter"), [(60, 1), (20, 3)])
def test_fit_equals_a_hand_run_trainer_with_the_same_seed(batch_size: int, n_iter: int) -> None:
    x = binary_data()
    estimator = BernoulliRBM(
        n_components=5, batch_size=batch_size, n_iter=n_iter, random_state=7
    ).fit(x)

    model = ssdcore.BernoulliRBM(12, 5, generator=torch.Generator().manual_seed(7))
    start = parameters(model)
    trainer = ssdcore.Trainer(
        model, torch.from_numpy(x), optimizer="ssd", batch_size=batch_size, seed=7
    )
    trainer.train_steps(n_iter * ssdcore.steps_per_epoch(60, batch_size))

    # Same seed, same float32 operations in the same order: bit for bit.
    np.testing.assert_array_equal(estimator.components_, model.W.detach().numpy().T)
    np.testing.assert_array_equal(estimator.intercept_hidden_, model.a.detach().numpy())
    np.testing.assert_array_equal(estimator.intercept_visible_, model.b.detach().numpy())
    assert not np.array_equal(start["W"], model.W.detach().numpy())  # training moved it
    assert estimator.learning_rate_ == default_lr("bernoulli", "ssd")
    assert estimator.components_.shape == (5, 12) and estimator.n_features_in_ == 12
    with torch.no_grad():
        expected = model.hidden_probs(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(estimator.transform(x), expected)


def test_gaussian_fit_equals_a_hand_run_trainer_and_transforms_by_its_formula() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((50, 6)).astype(np.float32)
    estimator = GaussianRBM(
        n_components=3, batch_size=10, n_iter=2, optimizer="sgd", random_state=2
    ).fit(x)

    model = ssdcore.GaussianRBM(6, 3, "diagonal", generator=torch.Generator().manual_seed(2))
    trainer = ssdcore.Trainer(model, torch.from_numpy(x), optimizer="sgd", batch_size=10, seed=2)
    trainer.train_steps(2 * 5)
    for name, value in parameters(model).items():
        np.testing.assert_array_equal(parameters(estimator.model_)[name], value, err_msg=name)
    assert estimator.learning_rate_ == default_lr("gaussian", "sgd", "diagonal")

    # p(h = 1 | v) = σ(vᵀC⁻¹W + a) with C = diag(exp(log_var)), in float64.
    w = estimator.components_.T.astype(np.float64)
    variance = np.exp(estimator.model_.log_var.detach().numpy().astype(np.float64))
    expected = 1 / (1 + np.exp(-((x / variance) @ w + estimator.intercept_hidden_)))
    np.testing.assert_allclose(estimator.transform(x), expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        free_energy = estimator.model_.free_energy(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(estimator.score_samples(x), -free_energy, rtol=1e-6)


def test_score_samples_is_the_exact_pseudo_log_likelihood_by_brute_force() -> None:
    x = binary_data(n=20, v=6)
    estimator = BernoulliRBM(n_components=4, batch_size=10, n_iter=3, random_state=0).fit(x)
    w = estimator.components_.T.astype(np.float64)
    b = estimator.intercept_visible_.astype(np.float64)
    a = estimator.intercept_hidden_.astype(np.float64)

    def free_energy(v: np.ndarray) -> np.ndarray:
        return -(v @ b) - np.logaddexp(0, v @ w + a).sum(axis=1)

    # Σᵢ log p(vᵢ | v₋ᵢ) = Σᵢ log σ(F(v with bit i flipped) - F(v)), one bit at a time.
    expected = np.zeros(len(x))
    for i in range(x.shape[1]):
        flipped = x.astype(np.float64).copy()
        flipped[:, i] = 1 - flipped[:, i]
        expected += -np.logaddexp(0, -(free_energy(flipped) - free_energy(x.astype(np.float64))))
    scores = estimator.score_samples(x)
    assert scores.dtype == np.float32 and scores.shape == (20,)  # float32 in, as scikit-learn
    np.testing.assert_allclose(scores, expected, rtol=1e-5)
    pll = ssdcore.pseudo_log_likelihood(estimator.model_, torch.from_numpy(x))
    assert estimator.score(x) == pytest.approx(pll, rel=1e-5)


def test_bernoulli_input_outside_the_unit_interval_is_used_with_a_warning() -> None:
    x = binary_data()
    outside = np.vstack([x, np.full((1, 12), -0.5, np.float32)])
    with pytest.warns(UnitIntervalWarning, match=r"from -0\.5 to 1.*\[0, 1\].*MinMaxScaler"):
        fitted = BernoulliRBM(**FAST).fit(outside)
    with pytest.warns(UnitIntervalWarning, match=r"from 0 to 3"):
        assert fitted.transform(3 * x).shape == (60, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # values in [0, 1], or real-valued units: no warning
        BernoulliRBM(**FAST).fit(x).transform(x)
        GaussianRBM(**FAST).fit(3 * x - 1)


@pytest.mark.parametrize(
    ("parameter", "value", "message"),
    [
        ("optimizer", "adam", "optimizer 'adam' is unknown"),
        ("learning_rate", -1.0, "learning_rate must be a finite number > 0"),
        ("learning_rate", "auto", r"learning_rate .*0\.1, its default, takes the step-size"),
        ("method", "qr", "method 'qr' is unknown"),
        ("cd_k", 0, "cd_k"),
    ],
)
def test_bad_parameters_name_the_parameter(parameter: str, value: object, message: str) -> None:
    estimator = BernoulliRBM(**FAST).set_params(**{parameter: value})
    with pytest.raises(ValueError, match=message):
        estimator.fit(binary_data())


def test_partial_fit_streams_batches_and_continues_the_model() -> None:
    x = binary_data(n=200, seed=4)
    estimator = BernoulliRBM(n_components=6, batch_size=20, random_state=0, persistent=True)
    estimator.partial_fit(x[:20])
    first = estimator.components_.copy()
    before = estimator.score(x)
    for rows in np.split(x, 10):
        estimator.partial_fit(rows)
    assert not np.array_equal(first, estimator.components_)
    assert estimator.score(x) > before  # the pseudo-likelihood rose over the stream
    assert estimator._training_state_["estimator"]["chains"].shape == (20, 6)  # PCD chains kept
    with pytest.raises(ValueError, match="12 features"):
        estimator.partial_fit(x[:, :5])


def test_gibbs_samples_are_binary_and_seeded() -> None:
    x = binary_data()
    samples = [BernoulliRBM(**FAST).fit(x).gibbs(x) for _ in range(2)]
    assert samples[0].shape == x.shape and samples[0].dtype == np.bool_  # as scikit-learn's
    np.testing.assert_array_equal(samples[0], samples[1])


def test_verbose_prints_each_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    BernoulliRBM(**{**FAST, "verbose": 1}).fit(binary_data())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[BernoulliRBM] Iteration 1, pseudo-likelihood")


def small_digits() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_digits(return_X_y=True)
    return minmax_scale(x).astype(np.float32), y


def test_pipeline_grid_search_and_clone() -> None:
    x, y = small_digits()
    x, y = x[:300], y[:300]
    pipeline = Pipeline(
        [
            ("rbm", BernoulliRBM(n_components=16, batch_size=10, n_iter=5, random_state=0)),
            ("logistic", LogisticRegression(max_iter=200)),
        ]
    )
    search = GridSearchCV(
        pipeline, {"rbm__n_components": [8, 16], "rbm__optimizer": ["ssd", "sgd"]}, cv=2
    )
    with threadpool_limits(1):
        search.fit(x, y)
    assert set(search.best_params_) == {"rbm__n_components", "rbm__optimizer"}
    assert search.best_score_ > 0.5  # ten classes: chance is 0.1
    assert search.best_estimator_.predict(x[:5]).shape == (5,)

    copy = clone(search.best_estimator_.named_steps["rbm"])
    assert copy.get_params() == search.best_estimator_.named_steps["rbm"].get_params()
    assert not hasattr(copy, "model_")
    names = search.best_estimator_[:-1].get_feature_names_out()
    assert names[0] == "bernoullirbm0" and len(names) == search.best_params_["rbm__n_components"]

    gaussian = Pipeline([("scale", StandardScaler()), ("rbm", GaussianRBM(**FAST))])
    assert gaussian.fit_transform(x).shape == (300, 4)


def test_learning_rate_is_in_scikit_learns_units() -> None:
    x = binary_data()
    fitted = {
        (optimizer, rate): BernoulliRBM(**FAST, optimizer=optimizer, learning_rate=rate).fit(x)
        for optimizer in ("ssd", "sgd")
        for rate in (SKLEARN_LEARNING_RATE, 0.06)
    }
    # scikit-learn's default takes the step-size table's step, exactly.
    assert fitted["ssd", SKLEARN_LEARNING_RATE].learning_rate_ == default_lr("bernoulli", "ssd")
    # Another value scales it in proportion.
    assert fitted["ssd", 0.06].learning_rate_ == pytest.approx(0.6 * default_lr("bernoulli", "ssd"))
    # With SGD the table's step is scikit-learn's default, so learning_rate is the step itself.
    assert default_lr("bernoulli", "sgd") == SKLEARN_LEARNING_RATE
    assert fitted["sgd", 0.06].learning_rate_ == pytest.approx(0.06)
    gaussian = GaussianRBM(**FAST).fit(x)
    assert gaussian.learning_rate_ == default_lr("gaussian", "ssd", "diagonal")


def fitted_arrays(estimator) -> dict[str, tuple[type, tuple[int, ...]]]:  # type: ignore[no-untyped-def]
    """Each public fitted array attribute scikit-learn's estimator has: its dtype and shape."""
    names = [n for n in vars(SklearnBernoulliRBM(**FAST).fit(binary_data())) if n.endswith("_")]
    arrays = {name: getattr(estimator, name) for name in names}
    return {n: (a.dtype, a.shape) for n, a in arrays.items() if isinstance(a, np.ndarray)}


@pytest.mark.filterwarnings("ignore::ssdcore.sklearn.UnitIntervalWarning")
@pytest.mark.parametrize(
    "fit_dtype", [np.float64, np.float32, np.int64, bool, "csr-float32", "csc-float64"]
)
def test_fitted_attributes_and_dtypes_are_scikit_learns(fit_dtype: object) -> None:
    def as_input(x: np.ndarray, kind: object):  # type: ignore[no-untyped-def]
        if isinstance(kind, str):
            layout, dtype = kind.split("-")
            return getattr(sp, f"{layout}_matrix")(x.astype(dtype))
        return x.astype(kind)

    x = binary_data()  # more rows than batch_size: h_samples_ has batch_size rows in both
    theirs = SklearnBernoulliRBM(**FAST).fit(as_input(x, fit_dtype))
    ours = BernoulliRBM(**FAST).fit(as_input(x, fit_dtype))
    assert fitted_arrays(ours) == fitted_arrays(theirs)
    assert set(fitted_arrays(ours)) >= {"components_", "intercept_visible_", "h_samples_"}
    assert ours.n_features_in_ == theirs.n_features_in_
    assert list(ours.get_feature_names_out()) == list(theirs.get_feature_names_out())
    for kind in (np.float64, np.float32, np.int64, bool, "csr-float32"):
        data = as_input(x, kind)
        for method in ("transform", "score_samples", "gibbs"):
            mine, reference = getattr(ours, method)(data), getattr(theirs, method)(data)
            assert (mine.dtype, mine.shape) == (reference.dtype, reference.shape), (method, kind)
    theirs_stream, ours_stream = SklearnBernoulliRBM(**FAST), BernoulliRBM(**FAST)
    theirs_stream.partial_fit(as_input(x, fit_dtype))
    ours_stream.partial_fit(as_input(x, fit_dtype))
    assert fitted_arrays(ours_stream) == fitted_arrays(theirs_stream)


def test_sparse_input_trains_and_transforms_as_the_dense_input() -> None:
    x = binary_data()
    dense = BernoulliRBM(**FAST).fit(x)
    sparse = BernoulliRBM(**FAST).fit(sp.csr_matrix(x))
    np.testing.assert_array_equal(sparse.components_, dense.components_)
    np.testing.assert_array_equal(sparse.transform(sp.csr_matrix(x)), dense.transform(x))


def test_inputs_scikit_learn_takes_are_taken_without_a_warning() -> None:
    x = binary_data()
    read_only = x.copy()
    read_only.setflags(write=False)
    inputs = [read_only, x.tolist(), np.asfortranarray(x), x.astype(np.int64), sp.csc_matrix(x)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for data in inputs:
            BernoulliRBM(**FAST).fit(data).transform(data)


def test_h_samples_are_the_persistent_chains_under_pcd() -> None:
    x = binary_data()
    estimator = BernoulliRBM(**FAST, batch_size=20, persistent=True).fit(x)
    chains = estimator._training_state_["estimator"]["chains"].numpy()
    np.testing.assert_array_equal(estimator.h_samples_, chains)
    assert estimator.h_samples_.shape == (20, 4) and estimator.h_samples_.dtype == np.float32
    cd = BernoulliRBM(**FAST, batch_size=20).fit(x)  # CD-k keeps no chains: its negative phase
    assert cd.h_samples_.shape == (20, 4) and set(np.unique(cd.h_samples_)) <= {0.0, 1.0}


def digits_example(BernoulliRBM, seed: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """scikit-learn's example "Restricted Boltzmann Machine features for digit classification"
    for whichever BernoulliRBM it is given (the import is the only difference): the digits
    scaled to [0, 1], an 80/20 split, the example's RBM settings (100 components, 10 epochs,
    learning rate 0.06, batch 10) and its hidden probabilities fed to a logistic regression.
    Not the example's nudged copies of the images (five times the rows) nor its C = 6000 with
    tol = 1 (which stops the logistic regression of this scikit-learn at chance): C = 100, to
    convergence. Returns the test accuracy and the fit time."""
    x, y = load_digits(return_X_y=True)
    x = np.asarray(x, "float32")
    x = minmax_scale(x, feature_range=(0, 1))
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0)
    logistic = LogisticRegression(max_iter=1000)
    rbm = BernoulliRBM(random_state=seed, verbose=True)
    rbm_features_classifier = Pipeline(steps=[("rbm", rbm), ("logistic", logistic)])
    rbm.learning_rate = 0.06
    rbm.n_iter = 10
    rbm.n_components = 100
    logistic.C = 100.0
    started = time.perf_counter()
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the logistic regression's convergence warnings
        rbm_features_classifier.fit(x_train, y_train)
    seconds = time.perf_counter() - started
    return float(rbm_features_classifier.score(x_test, y_test)), seconds


# Ours must be no more than this below scikit-learn's accuracy (measured: above it).
DIGITS_MARGIN = 0.02


def test_digits_example_with_only_the_import_changed(record_property, capsys) -> None:  # type: ignore[no-untyped-def]
    theirs, their_seconds = digits_example(SklearnBernoulliRBM, seed=0)
    ours, our_seconds = digits_example(BernoulliRBM, seed=0)
    epochs = [line for line in capsys.readouterr().out.splitlines() if "Iteration" in line]
    assert len(epochs) == 20 and epochs[-1].startswith("[BernoulliRBM] Iteration 10, pseudo-")
    record_property("digits_accuracy_sklearn_bernoullirbm", theirs)
    record_property("digits_accuracy_ssd_bernoullirbm", ours)
    print(
        f"digits accuracy: sklearn BernoulliRBM {theirs:.4f} ({their_seconds:.1f} s), "
        f"ssdcore.sklearn BernoulliRBM {ours:.4f} ({our_seconds:.1f} s)"
    )
    assert ours >= theirs - DIGITS_MARGIN
    assert ours > 0.9
