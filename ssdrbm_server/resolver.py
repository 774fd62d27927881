"""Validation of StartTrainingRequest, with every default filled in.

A job's stored spec is the request as validated here: zero values that mean "server default"
are replaced by the actual defaults, so the worker never guesses. Each problem is reported as
INVALID_ARGUMENT naming the field (``optimizer.lr``, ``training.cd_k``, ...) and the fix.

Validation happens in two parts: ``check_request`` needs only the request, and
``apply_dataset`` finishes the checks that depend on the dataset's width and size (the variance
kind, batch size, epochs → total steps) once the servicer has resolved the dataset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper
from ssdrbm.v1 import rbm_pb2

from ssdcore.data import split_sizes
from ssdcore.training import steps_per_epoch
from ssdrbm_server import catalog
from ssdrbm_server.catalog import DatasetShape
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import InvalidArgumentError

pb = rbm_pb2

MAX_HIDDEN = 1 << 16
MAX_BATCH_SIZE = 1 << 16
MAX_CD_K = 10_000
MAX_AIS_CHAINS = 100_000
MAX_AIS_BETAS = 1_000_000
MAX_REQUEST_ID_LENGTH = 128
NESTEROV_DEFAULT_MOMENTUM = 0.9
DEFAULT_CD_K = 1

SSD_KINDS = (pb.OPTIMIZER_KIND_SSD, pb.OPTIMIZER_KIND_SSD_PRECONDITIONED)
BASE_PARAMETERS = ("W", "b", "a")
VARIANCE_PARAMETERS = {
    pb.VARIANCE_KIND_IDENTITY: (),
    pb.VARIANCE_KIND_ISOTROPIC: ("log_c",),
    pb.VARIANCE_KIND_DIAGONAL: ("log_var",),
    pb.VARIANCE_KIND_FULL: ("precision",),
}


@dataclass(frozen=True)
class ValidatedJob:
    """A spec ready to store: defaults filled, consistent with its dataset."""

    spec: rbm_pb2.StartTrainingRequest
    total_steps: int
    n_visible: int
    n_examples: int


def check_request(
    request: rbm_pb2.StartTrainingRequest, settings: Settings
) -> rbm_pb2.StartTrainingRequest:
    """A copy of ``request`` with defaults filled; raises InvalidArgumentError naming the field.

    Checks everything that does not depend on the dataset's contents.
    """
    spec = rbm_pb2.StartTrainingRequest()
    spec.CopyFrom(request)
    _check_text(spec.request_id, "request_id", MAX_REQUEST_ID_LENGTH)
    _check_text(spec.name, "name", settings.max_string_length)
    _check_model(spec.model)
    _check_optimizer(spec.optimizer, spec.model)
    _check_training(spec.training, settings)
    _check_eval(spec.eval, settings)
    _check_dataset_ref(spec.dataset, spec.model, settings)
    return spec


def builtin_dataset_shape(spec: rbm_pb2.StartTrainingRequest, settings: Settings) -> DatasetShape:
    """Width and size of the spec's built-in dataset (after ``check_request``)."""
    builtin = spec.dataset.builtin
    options = catalog.parse_options(builtin.name, builtin.options, "dataset.builtin")
    return catalog.builtin_shape(builtin.name, options, settings.data_dir)


def uploaded_dataset_shape(shape: tuple[int, ...]) -> DatasetShape:
    """Width and size of an uploaded dataset of ``shape`` (examples first, then features)."""
    return DatasetShape(n_visible=math.prod(shape[1:]), n_examples=shape[0])


def apply_dataset(
    spec: rbm_pb2.StartTrainingRequest, dataset: DatasetShape, settings: Settings
) -> ValidatedJob:
    """Finish validation with the dataset's width and size; computes ``total_steps``."""
    model, training = spec.model, spec.training
    if (
        model.kind == pb.MODEL_KIND_GAUSSIAN
        and model.variance == pb.VARIANCE_KIND_FULL
        and dataset.n_visible > settings.max_full_variance_visibles
    ):
        raise InvalidArgumentError(
            "model.variance",
            f"FULL needs a {dataset.n_visible}×{dataset.n_visible} precision matrix; this server "
            f"allows it up to {settings.max_full_variance_visibles} visible units — use DIAGONAL",
        )
    try:
        n_train, _ = split_sizes(dataset.n_examples, spec.eval.validation_fraction)
    except ValueError as error:
        raise InvalidArgumentError("eval.validation_fraction", str(error)) from None
    if training.batch_size > n_train:
        raise InvalidArgumentError(
            "training.batch_size",
            f"{training.batch_size} is larger than the {n_train} training examples; lower it",
        )
    total_steps = training.steps or training.epochs * steps_per_epoch(n_train, training.batch_size)
    if total_steps > settings.max_total_steps:
        raise InvalidArgumentError(
            "training.epochs" if training.epochs else "training.steps",
            f"the job would run {total_steps} steps, more than this server's limit of "
            f"{settings.max_total_steps}",
        )
    return ValidatedJob(spec, total_steps, dataset.n_visible, dataset.n_examples)


def enum_value(enum: EnumTypeWrapper, value: int, field: str) -> int:
    """``value`` if it is a member of ``enum``; an open proto3 enum may carry unknown numbers."""
    if value not in enum.DESCRIPTOR.values_by_number:
        names = [v.name for v in enum.DESCRIPTOR.values if not v.name.endswith("_UNSPECIFIED")]
        raise InvalidArgumentError(field, f"unknown value {value}; use one of {names}")
    return value


def _check_text(value: str, field: str, max_length: int) -> None:
    if len(value) > max_length:
        raise InvalidArgumentError(
            field, f"is {len(value)} characters long; at most {max_length} allowed"
        )
    if any(not char.isprintable() for char in value):
        raise InvalidArgumentError(field, "contains control characters; use printable text")


def _finite(value: float, field: str) -> float:
    if not math.isfinite(value):
        raise InvalidArgumentError(field, f"must be a finite number, got {value}")
    return value


def _check_model(model: rbm_pb2.ModelSpec) -> None:
    enum_value(pb.ModelKind, model.kind, "model.kind")
    enum_value(pb.VarianceKind, model.variance, "model.variance")
    if model.kind == pb.MODEL_KIND_UNSPECIFIED:
        model.kind = pb.MODEL_KIND_BERNOULLI
    if model.kind == pb.MODEL_KIND_GAUSSIAN:
        if model.variance == pb.VARIANCE_KIND_UNSPECIFIED:
            model.variance = pb.VARIANCE_KIND_DIAGONAL
    elif model.variance != pb.VARIANCE_KIND_UNSPECIFIED:
        raise InvalidArgumentError(
            "model.variance", "applies to Gaussian models only; leave it unset for Bernoulli"
        )
    # The model's variances live in [min_variance, 1e4]; 1 is far above any useful floor.
    if not 0 <= _finite(model.min_variance, "model.min_variance") < 1:
        raise InvalidArgumentError(
            "model.min_variance",
            f"must be in [0, 1) (0 = the default 1e-4), got {model.min_variance}",
        )
    if model.min_variance and model.kind != pb.MODEL_KIND_GAUSSIAN:
        raise InvalidArgumentError(
            "model.min_variance", "applies to Gaussian models only; leave it unset for Bernoulli"
        )
    if model.n_hidden < 1:
        raise InvalidArgumentError("model.n_hidden", "is required and must be at least 1")
    if model.n_hidden > MAX_HIDDEN:
        raise InvalidArgumentError(
            "model.n_hidden", f"must be at most {MAX_HIDDEN}, got {model.n_hidden}"
        )


def parameter_names(model: rbm_pb2.ModelSpec) -> tuple[str, ...]:
    """Names of the model's parameters, as optimizer.per_parameter uses them."""
    if model.kind == pb.MODEL_KIND_GAUSSIAN:
        return BASE_PARAMETERS + VARIANCE_PARAMETERS[model.variance]
    return BASE_PARAMETERS


def _check_optimizer(optimizer: rbm_pb2.OptimizerSpec, model: rbm_pb2.ModelSpec) -> None:
    enum_value(pb.OptimizerKind, optimizer.kind, "optimizer.kind")
    enum_value(pb.PolarMethod, optimizer.method, "optimizer.method")
    enum_value(pb.Preconditioner, optimizer.preconditioner, "optimizer.preconditioner")
    if optimizer.kind == pb.OPTIMIZER_KIND_UNSPECIFIED:
        optimizer.kind = pb.OPTIMIZER_KIND_SSD
    # NaN fails every comparison, so `not lr > 0` also refuses it.
    if not _finite(optimizer.lr, "optimizer.lr") > 0:
        raise InvalidArgumentError("optimizer.lr", f"must be > 0, got {optimizer.lr}")
    if not 0 <= _finite(optimizer.momentum, "optimizer.momentum") < 1:
        raise InvalidArgumentError(
            "optimizer.momentum", f"must be in [0, 1), got {optimizer.momentum}"
        )
    if not _finite(optimizer.weight_decay, "optimizer.weight_decay") >= 0:
        raise InvalidArgumentError(
            "optimizer.weight_decay", f"must be >= 0, got {optimizer.weight_decay}"
        )
    if not _finite(optimizer.max_spectral_norm, "optimizer.max_spectral_norm") >= 0:
        raise InvalidArgumentError(
            "optimizer.max_spectral_norm",
            f"must be >= 0 (0 = unbounded), got {optimizer.max_spectral_norm}",
        )
    if optimizer.rank > MAX_HIDDEN:
        raise InvalidArgumentError("optimizer.rank", f"must be at most {MAX_HIDDEN}")
    allowed = parameter_names(model)
    for name, kind in optimizer.per_parameter.items():
        field = f"optimizer.per_parameter[{name}]"
        if name not in allowed:
            raise InvalidArgumentError(
                field, f"unknown parameter {name!r}; this model has {list(allowed)}"
            )
        if enum_value(pb.OptimizerKind, kind, field) == pb.OPTIMIZER_KIND_UNSPECIFIED:
            raise InvalidArgumentError(field, "name an optimizer kind (SGD, NESTEROV, SSD, ...)")
    for name, lr in optimizer.per_parameter_lr.items():
        field = f"optimizer.per_parameter_lr[{name}]"
        if name not in allowed:
            raise InvalidArgumentError(
                field, f"unknown parameter {name!r}; this model has {list(allowed)}"
            )
        if not _finite(lr, field) > 0:
            raise InvalidArgumentError(field, f"must be > 0, got {lr}")
    kinds = {optimizer.kind, *optimizer.per_parameter.values()}
    if kinds & set(SSD_KINDS) and optimizer.method == pb.POLAR_METHOD_UNSPECIFIED:
        optimizer.method = pb.POLAR_METHOD_LOWRANK
    if (
        pb.OPTIMIZER_KIND_SSD_PRECONDITIONED in kinds
        and optimizer.preconditioner == pb.PRECONDITIONER_UNSPECIFIED
    ):
        optimizer.preconditioner = pb.PRECONDITIONER_RMSPROP
    if optimizer.kind == pb.OPTIMIZER_KIND_NESTEROV and optimizer.momentum == 0:
        optimizer.momentum = NESTEROV_DEFAULT_MOMENTUM


def _check_training(training: rbm_pb2.TrainingSpec, settings: Settings) -> None:
    if not training.HasField("cd_k"):
        training.cd_k = DEFAULT_CD_K
    if not 1 <= training.cd_k <= MAX_CD_K:
        raise InvalidArgumentError(
            "training.cd_k", f"must be between 1 and {MAX_CD_K}, got {training.cd_k}"
        )
    if training.batch_size == 0:
        training.batch_size = settings.default_batch_size
    if training.batch_size > MAX_BATCH_SIZE:
        raise InvalidArgumentError(
            "training.batch_size", f"must be at most {MAX_BATCH_SIZE}, got {training.batch_size}"
        )
    if bool(training.steps) == bool(training.epochs):
        raise InvalidArgumentError(
            "training.steps",
            "set exactly one of training.steps and training.epochs (both are "
            f"{'set' if training.steps else 'zero'})",
        )
    if training.steps > settings.max_total_steps:
        raise InvalidArgumentError(
            "training.steps", f"must be at most {settings.max_total_steps}, got {training.steps}"
        )
    if training.checkpoint_every == 0:
        training.checkpoint_every = settings.default_checkpoint_every


def _check_eval(eval_spec: rbm_pb2.EvalSpec, settings: Settings) -> None:
    if eval_spec.every == 0:
        eval_spec.every = settings.default_eval_every
    if eval_spec.ais_chains == 0:
        eval_spec.ais_chains = settings.default_ais_chains
    if eval_spec.ais_chains > MAX_AIS_CHAINS:
        raise InvalidArgumentError("eval.ais_chains", f"must be at most {MAX_AIS_CHAINS}")
    if eval_spec.ais_betas == 0:
        eval_spec.ais_betas = settings.default_ais_betas
    if eval_spec.ais_betas > MAX_AIS_BETAS:
        raise InvalidArgumentError("eval.ais_betas", f"must be at most {MAX_AIS_BETAS}")
    fraction = _finite(eval_spec.validation_fraction, "eval.validation_fraction")
    if fraction == 0:
        eval_spec.validation_fraction = settings.default_validation_fraction
    elif not 0 < fraction < 1:
        raise InvalidArgumentError(
            "eval.validation_fraction", f"must be in (0, 1) (0 = default), got {fraction}"
        )


def _check_dataset_ref(
    dataset: rbm_pb2.DatasetRef, model: rbm_pb2.ModelSpec, settings: Settings
) -> None:
    enum_value(pb.Preprocess, dataset.preprocess, "dataset.preprocess")
    source = dataset.WhichOneof("source")
    if source is None:
        raise InvalidArgumentError(
            "dataset", f"set dataset.builtin (one of {catalog.builtin_names()}) or dataset_id"
        )
    if source == "dataset_id":
        if not dataset.dataset_id:
            raise InvalidArgumentError("dataset.dataset_id", "is empty; use an UploadDataset id")
        _check_text(dataset.dataset_id, "dataset.dataset_id", settings.max_string_length)
    else:
        builtin = dataset.builtin
        _check_text(builtin.name, "dataset.builtin.name", settings.max_string_length)
        for key, value in builtin.options.items():
            _check_text(key, "dataset.builtin.options", settings.max_string_length)
            _check_text(value, f"dataset.builtin.options[{key}]", settings.max_string_length)
        parsed = catalog.parse_options(builtin.name, builtin.options, "dataset.builtin")
        for key, value in parsed.items():  # store the defaults too: the worker never guesses
            builtin.options[key] = str(value)
    if dataset.preprocess == pb.PREPROCESS_UNSPECIFIED:
        dataset.preprocess = _natural_preprocess(dataset, model)


def _natural_preprocess(dataset: rbm_pb2.DatasetRef, model: rbm_pb2.ModelSpec) -> int:
    """Binary units want binary images; Gaussian units want standardized ones."""
    if dataset.WhichOneof("source") == "builtin" and dataset.builtin.name in (
        catalog.IMAGE_DATASETS
    ):
        if model.kind == pb.MODEL_KIND_GAUSSIAN:
            return pb.PREPROCESS_STANDARDIZE
        return pb.PREPROCESS_BINARIZE
    return pb.PREPROCESS_NONE
