"""StartTrainingRequest validation: defaults filled in, and each bad field named in its error."""

from __future__ import annotations

import math

import pytest
from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.catalog import DatasetShape
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import FailedPreconditionError, InvalidArgumentError
from ssdrbm_server.validation import (
    apply_dataset,
    builtin_dataset_shape,
    check_request,
    uploaded_dataset_shape,
)

SETTINGS = Settings(max_full_variance_visibles=256)


def request(**fields: object) -> pb.StartTrainingRequest:
    """A valid small request; keyword arguments replace whole sub-messages."""
    base = pb.StartTrainingRequest(
        model=pb.ModelSpec(n_hidden=8),
        optimizer=pb.OptimizerSpec(lr=0.05),
        training=pb.TrainingSpec(steps=100),
        dataset=pb.DatasetRef(builtin=pb.BuiltinDataset(name="synthetic")),
    )
    for name, value in fields.items():
        getattr(base, name).CopyFrom(value)
    return base


def validate(req: pb.StartTrainingRequest, settings: Settings = SETTINGS):
    spec = check_request(req, settings)
    return apply_dataset(spec, builtin_dataset_shape(spec, settings), settings)


def field_of(req: pb.StartTrainingRequest) -> str:
    with pytest.raises(InvalidArgumentError) as caught:
        validate(req)
    assert caught.value.message.startswith(caught.value.field + ":")
    return caught.value.field


def test_defaults_are_filled_in() -> None:
    job = validate(request())
    spec = job.spec
    assert spec.model.kind == pb.MODEL_KIND_BERNOULLI
    assert spec.optimizer.kind == pb.OPTIMIZER_KIND_SSD
    assert spec.optimizer.method == pb.POLAR_METHOD_LOWRANK
    assert spec.training.cd_k == 1 and spec.training.HasField("cd_k")
    assert spec.training.batch_size == SETTINGS.default_batch_size
    assert spec.training.checkpoint_every == SETTINGS.default_checkpoint_every
    assert spec.eval.every == SETTINGS.default_eval_every
    assert spec.eval.validation_fraction == pytest.approx(0.1)
    assert (spec.eval.ais_chains, spec.eval.ais_betas) == (100, 1000)
    assert spec.dataset.preprocess == pb.PREPROCESS_NONE
    assert dict(spec.dataset.builtin.options) == {
        "n_visible": "100",
        "n_hidden": "25",
        "n_samples": "5000",
        "seed": "0",
    }
    assert (job.total_steps, job.n_visible, job.n_examples) == (100, 100, 5000)


def test_request_itself_is_not_modified() -> None:
    req = request()
    validate(req)
    assert req.optimizer.kind == pb.OPTIMIZER_KIND_UNSPECIFIED
    assert not req.training.HasField("cd_k")


def test_gaussian_and_optimizer_defaults() -> None:
    req = request(model=pb.ModelSpec(kind=pb.MODEL_KIND_GAUSSIAN, n_hidden=4))
    req.optimizer.kind = pb.OPTIMIZER_KIND_NESTEROV
    spec = validate(req).spec
    assert spec.model.variance == pb.VARIANCE_KIND_DIAGONAL
    assert spec.optimizer.momentum == pytest.approx(0.9)
    assert spec.optimizer.method == pb.POLAR_METHOD_UNSPECIFIED  # no SSD group: not needed
    req.optimizer.kind = pb.OPTIMIZER_KIND_SSD_PRECONDITIONED
    spec = validate(req).spec
    assert spec.optimizer.preconditioner == pb.PRECONDITIONER_RMSPROP


def test_epochs_give_total_steps_from_the_training_split() -> None:
    req = request(training=pb.TrainingSpec(epochs=3, batch_size=64))
    req.dataset.builtin.options["n_samples"] = "1000"
    job = validate(req)
    n_train = 1000 - 100  # 10 % held out
    assert job.total_steps == 3 * (n_train // 64)  # an epoch's last partial batch is dropped


def test_mnist_width_and_natural_preprocessing() -> None:
    req = request(dataset=pb.DatasetRef(builtin=pb.BuiltinDataset(name="mnist")))
    job = validate(req)
    assert (job.n_visible, job.n_examples) == (784, 10000)
    assert job.spec.dataset.preprocess == pb.PREPROCESS_BINARIZE
    req.model.kind = pb.MODEL_KIND_GAUSSIAN
    assert validate(req).spec.dataset.preprocess == pb.PREPROCESS_STANDARDIZE


def test_missing_real_dataset_is_failed_precondition(tmp_path) -> None:
    req = request(dataset=pb.DatasetRef(builtin=pb.BuiltinDataset(name="freyface")))
    with pytest.raises(FailedPreconditionError, match="SSDRBM_DATA_DIR"):
        validate(req, SETTINGS.replace(data_dir=str(tmp_path)))


def bad(**changes: object) -> pb.StartTrainingRequest:
    """A request with dotted-path fields set, e.g. bad(**{"optimizer.lr": 0})."""
    req = request()
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = req
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, leaf, value)
    return req


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"optimizer.lr": 0.0}, "optimizer.lr"),
        ({"optimizer.lr": -1e-3}, "optimizer.lr"),
        ({"optimizer.lr": math.nan}, "optimizer.lr"),
        ({"optimizer.lr": math.inf}, "optimizer.lr"),
        ({"training.cd_k": 0}, "training.cd_k"),
        ({"training.cd_k": 10**6}, "training.cd_k"),
        ({"model.n_hidden": 0}, "model.n_hidden"),
        ({"model.n_hidden": 10**7}, "model.n_hidden"),
        ({"model.kind": 99}, "model.kind"),
        ({"model.variance": pb.VARIANCE_KIND_FULL}, "model.variance"),  # Bernoulli
        ({"optimizer.kind": 42}, "optimizer.kind"),
        ({"optimizer.method": 17}, "optimizer.method"),
        ({"optimizer.preconditioner": 9}, "optimizer.preconditioner"),
        ({"optimizer.momentum": 1.0}, "optimizer.momentum"),
        ({"optimizer.momentum": -0.1}, "optimizer.momentum"),
        ({"optimizer.weight_decay": -1.0}, "optimizer.weight_decay"),
        ({"optimizer.max_spectral_norm": math.nan}, "optimizer.max_spectral_norm"),
        ({"training.steps": 0}, "training.steps"),  # neither steps nor epochs
        ({"training.epochs": 2}, "training.steps"),  # both
        ({"training.batch_size": 10**6}, "training.batch_size"),
        ({"training.batch_size": 4600}, "training.batch_size"),  # more than the training split
        ({"training.steps": 10**12}, "training.steps"),
        ({"eval.validation_fraction": 1.0}, "eval.validation_fraction"),
        ({"eval.validation_fraction": -0.5}, "eval.validation_fraction"),
        ({"eval.validation_fraction": 1e-9}, "eval.validation_fraction"),  # no example held out
        ({"eval.ais_chains": 10**7}, "eval.ais_chains"),
        ({"dataset.preprocess": 12}, "dataset.preprocess"),
        ({"dataset.builtin.name": "cifar"}, "dataset.builtin.name"),
        ({"request_id": "x" * 129}, "request_id"),
        ({"request_id": "line\nbreak"}, "request_id"),
        ({"name": "n" * 10_000}, "name"),
    ],
)
def test_bad_fields_are_named(changes: dict[str, object], field: str) -> None:
    assert field_of(bad(**changes)) == field


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"n_visible": "abc"}, "dataset.builtin.options[n_visible]"),
        ({"n_visible": "0"}, "dataset.builtin.options[n_visible]"),
        ({"n_samples": "-5"}, "dataset.builtin.options[n_samples]"),
        ({"colour": "red"}, "dataset.builtin.options"),
    ],
)
def test_bad_dataset_options_are_named(options: dict[str, str], field: str) -> None:
    req = request()
    req.dataset.builtin.options.update(options)
    assert field_of(req) == field


def test_dataset_source_is_required() -> None:
    req = request()
    req.dataset.ClearField("builtin")
    assert field_of(req) == "dataset"


def test_per_parameter_hybrid_is_checked_against_the_model() -> None:
    req = request()
    req.optimizer.kind = pb.OPTIMIZER_KIND_SGD
    req.optimizer.per_parameter["W"] = pb.OPTIMIZER_KIND_SSD
    spec = validate(req).spec  # the paper's SSD_W/SGD
    assert spec.optimizer.method == pb.POLAR_METHOD_LOWRANK
    req.optimizer.per_parameter["log_var"] = pb.OPTIMIZER_KIND_SGD  # Bernoulli has no log_var
    assert field_of(req) == "optimizer.per_parameter[log_var]"
    del req.optimizer.per_parameter["log_var"]
    req.optimizer.per_parameter["b"] = 77
    assert field_of(req) == "optimizer.per_parameter[b]"


def test_per_parameter_step_sizes_are_checked() -> None:
    req = request()
    req.optimizer.kind = pb.OPTIMIZER_KIND_SGD
    req.optimizer.per_parameter["W"] = pb.OPTIMIZER_KIND_SSD
    req.optimizer.per_parameter_lr["W"] = 1e-3
    assert validate(req).spec.optimizer.per_parameter_lr["W"] == pytest.approx(1e-3)
    for bad in (0.0, -1.0, math.nan, math.inf):
        req.optimizer.per_parameter_lr["W"] = bad
        assert field_of(req) == "optimizer.per_parameter_lr[W]"
    req.optimizer.per_parameter_lr["W"] = 1e-3
    req.optimizer.per_parameter_lr["log_var"] = 1e-3  # Bernoulli has no log_var
    assert field_of(req) == "optimizer.per_parameter_lr[log_var]"


def test_min_variance_is_for_gaussian_models_within_its_range() -> None:
    req = request(model=pb.ModelSpec(kind=pb.MODEL_KIND_GAUSSIAN, n_hidden=8, min_variance=0.01))
    assert validate(req).spec.model.min_variance == pytest.approx(0.01)
    for bad in (-0.1, 1.0, math.nan):
        req.model.min_variance = bad
        assert field_of(req) == "model.min_variance"
    bernoulli = request(model=pb.ModelSpec(n_hidden=8, min_variance=0.01))
    assert field_of(bernoulli) == "model.min_variance"


def test_full_variance_is_refused_for_wide_data_only() -> None:
    req = request(model=pb.ModelSpec(kind=pb.MODEL_KIND_GAUSSIAN, n_hidden=4))
    req.model.variance = pb.VARIANCE_KIND_FULL
    req.dataset.builtin.options["n_visible"] = "16"
    assert validate(req).spec.model.variance == pb.VARIANCE_KIND_FULL
    req.dataset.builtin.options["n_visible"] = "257"
    with pytest.raises(InvalidArgumentError) as caught:
        validate(req)
    assert caught.value.field == "model.variance"
    assert "DIAGONAL" in caught.value.message


def test_uploaded_dataset_shapes_flatten_images() -> None:
    assert uploaded_dataset_shape((50, 28, 20)) == DatasetShape(n_visible=560, n_examples=50)
    req = request(dataset=pb.DatasetRef(dataset_id="ab" * 32))
    req.training.batch_size = 10
    spec = check_request(req, SETTINGS)
    job = apply_dataset(spec, uploaded_dataset_shape((50, 7)), SETTINGS)
    assert (job.n_visible, job.spec.dataset.preprocess) == (7, pb.PREPROCESS_NONE)
