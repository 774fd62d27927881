"""The resolver: every unset field of a StartTrainingRequest filled from its one owner, and
each bad field named in its error."""

from __future__ import annotations

import asyncio
import inspect
import math

import pytest
from google.protobuf.message import Message
from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore.blowup import BACKOFF_FACTOR, DEFAULT_MAX_BACKOFFS
from ssdcore.data import synthetic_rbm_data
from ssdcore.models.gaussian import DEFAULT_MIN_VARIANCE
from ssdcore.step_sizes import LONG_RUN_STEPS, SHORT_RUN_STEPS, default_lr, step_size
from ssdcore.training import DEFAULT_BATCH_SIZE
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from ssdrbm_server.job_spec import SPEC_VERSION
from ssdrbm_server.request_bounds import model_bytes, step_flops
from ssdrbm_server.resolver import (
    MAX_SEED,
    ResolvedJob,
    first_difference,
    resolve,
    training_defaults,
)
from ssdrbm_server.store.datasets import DatasetInfo

SETTINGS = Settings(max_full_variance_visibles=256)
UPLOADS = {
    "ab" * 32: DatasetInfo("ab" * 32, (50, 7), "float32", "floats", 50 * 7 * 4, (0.0, 1.0)),
    "ef" * 32: DatasetInfo("ef" * 32, (50, 7), "float32", "normal", 50 * 7 * 4, (-3.2, 2.9)),
    "cd" * 32: DatasetInfo("cd" * 32, (60, 28, 20), "uint8", "images", 60 * 560),
}


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


def validate(req: pb.StartTrainingRequest, settings: Settings = SETTINGS) -> ResolvedJob:
    async def find_upload(dataset_id: str) -> DatasetInfo:
        if dataset_id not in UPLOADS:
            raise NotFoundError(f"dataset {dataset_id} not found")
        return UPLOADS[dataset_id]

    return asyncio.run(resolve(req, settings, find_upload))


def field_of(req: pb.StartTrainingRequest) -> str:
    with pytest.raises(InvalidArgumentError) as caught:
        validate(req)
    assert caught.value.message.startswith(caught.value.field + ":")
    return caught.value.field


def test_a_request_with_only_n_hidden_is_resolved_in_full() -> None:
    job = validate(pb.StartTrainingRequest(model=pb.ModelSpec(n_hidden=8)))
    spec = job.spec
    assert spec.model.kind == pb.MODEL_KIND_BERNOULLI
    assert spec.optimizer.kind == pb.OPTIMIZER_KIND_SSD
    # the table's value for a job of the default length (1,000 steps: between its two lengths)
    assert spec.optimizer.lr == default_lr("bernoulli", "ssd", None, steps=job.total_steps)
    assert default_lr("bernoulli", "ssd", None) < spec.optimizer.lr
    assert spec.optimizer.HasField("momentum") and spec.optimizer.momentum == 0
    # The one device-dependent choice stays explicit; the worker resolves it for its device.
    assert spec.optimizer.method == pb.POLAR_METHOD_AUTO
    assert spec.training.cd_k == 1 and spec.training.HasField("cd_k")
    assert spec.training.steps == SETTINGS.default_steps
    assert spec.training.batch_size == DEFAULT_BATCH_SIZE
    assert spec.training.checkpoint_every == SETTINGS.default_checkpoint_every
    assert spec.training.max_backoffs == DEFAULT_MAX_BACKOFFS
    assert spec.training.backoff_factor == BACKOFF_FACTOR
    assert spec.eval.every == SETTINGS.default_eval_every
    assert spec.eval.validation_fraction == pytest.approx(0.1)
    assert (spec.eval.ais_chains, spec.eval.ais_betas) == (100, 1000)
    assert spec.dataset.builtin.name == "synthetic"
    assert spec.dataset.preprocess == pb.PREPROCESS_NONE
    assert dict(spec.dataset.builtin.options) == {
        "n_visible": "100",
        "n_hidden": "25",
        "n_samples": "5000",
        "seed": "0",
    }
    assert (job.total_steps, job.n_visible, job.n_examples) == (1000, 100, 5000)
    assert not spec.validate_only


def test_resolving_twice_changes_nothing() -> None:
    """The stored spec is a fixed point: the worker can read it with no defaults of its own."""
    once = validate(request()).spec
    assert first_difference(once, validate(once).spec) is None


def test_request_itself_is_not_modified() -> None:
    req = request()
    validate(req)
    assert req.optimizer.kind == pb.OPTIMIZER_KIND_UNSPECIFIED
    assert not req.training.HasField("cd_k")


def test_step_size_defaults_follow_model_variance_and_optimizer() -> None:
    req = request(model=pb.ModelSpec(kind=pb.MODEL_KIND_GAUSSIAN, n_hidden=4))
    req.optimizer.ClearField("lr")
    req.optimizer.kind = pb.OPTIMIZER_KIND_NESTEROV
    spec = validate(req).spec
    assert spec.model.variance == pb.VARIANCE_KIND_DIAGONAL
    assert spec.model.min_variance == DEFAULT_MIN_VARIANCE
    assert spec.optimizer.lr == default_lr("gaussian", "nesterov", "diagonal", steps=100)
    assert spec.optimizer.momentum == pytest.approx(0.9)
    assert spec.optimizer.method == pb.POLAR_METHOD_UNSPECIFIED  # no SSD group: not needed
    req.optimizer.kind = pb.OPTIMIZER_KIND_SSD_PRECONDITIONED
    spec = validate(req).spec
    assert spec.optimizer.preconditioner == pb.PRECONDITIONER_RMSPROP
    assert spec.optimizer.lr == default_lr("gaussian", "ssd-preconditioned", "diagonal", steps=100)
    # A hybrid's override takes the step size of its own geometry.
    req.optimizer.kind = pb.OPTIMIZER_KIND_SGD
    req.optimizer.per_parameter["W"] = pb.OPTIMIZER_KIND_SSD
    spec = validate(req).spec
    # a job of 100 steps: the short-run values
    assert spec.optimizer.lr == default_lr("gaussian", "sgd", "diagonal", steps=100) == 0.01
    assert spec.optimizer.per_parameter_lr["W"] == step_size("gaussian", "ssd").short_lr
    assert spec.optimizer.method == pb.POLAR_METHOD_AUTO


def test_explicit_zeros_are_kept() -> None:
    req = request()
    req.optimizer.kind = pb.OPTIMIZER_KIND_NESTEROV
    req.optimizer.momentum = 0.0
    req.training.max_backoffs = 0
    spec = validate(req).spec
    assert spec.optimizer.momentum == 0.0 and spec.training.max_backoffs == 0


def test_training_defaults_table_covers_every_combination() -> None:
    table = asyncio.run(training_defaults(SETTINGS))
    combos = {(e.model, e.variance, e.optimizer, e.step_rule) for e in table.step_sizes}
    # Bernoulli + 4 Gaussian variances, then the normalized rule's two SSD optimizers of each
    assert len(combos) == len(table.step_sizes) == (4 + 4 * 4) + (2 + 2 * 4)
    for entry in table.step_sizes:
        assert entry.lr > 0
    ssd = step_size("bernoulli", "ssd")
    (entry,) = [
        e
        for e in table.step_sizes
        if e.model == pb.MODEL_KIND_BERNOULLI
        and e.optimizer == pb.OPTIMIZER_KIND_SSD
        and e.step_rule == pb.STEP_RULE_PAPER
    ]
    assert (entry.lr, entry.short_run_lr) == (ssd.lr, ssd.short_lr)
    assert (table.short_run_steps, table.long_run_steps) == (SHORT_RUN_STEPS, LONG_RUN_STEPS)
    example = table.example
    assert example.optimizer.lr == default_lr(
        "bernoulli", "ssd", None, steps=SETTINGS.default_steps
    )
    assert example.training.steps == SETTINGS.default_steps
    assert example.optimizer.method == pb.POLAR_METHOD_AUTO


def test_first_difference_names_the_field() -> None:
    a = validate(request()).spec
    b = pb.StartTrainingRequest()
    b.CopyFrom(a)
    assert first_difference(a, b) is None
    b.optimizer.lr *= 2
    assert first_difference(a, b) == "optimizer.lr"
    b.CopyFrom(a)
    b.dataset.builtin.options["seed"] = "7"
    assert first_difference(a, b) == "dataset.builtin.options"
    b.CopyFrom(a)
    b.training.ClearField("cd_k")  # unset differs from an explicit value
    assert first_difference(a, b) == "training.cd_k"


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


@pytest.mark.parametrize(
    ("name", "files"),
    [
        ("mnist", ["mnist/train-images-idx3-ubyte[.gz]", "mnist/t10k-images-idx3-ubyte[.gz]"]),
        ("freyface", ["freyface/frey_rawface.mat"]),
    ],
)
def test_missing_real_dataset_names_its_files_and_the_alternatives(tmp_path, name, files) -> None:
    req = request(dataset=pb.DatasetRef(builtin=pb.BuiltinDataset(name=name)))
    with pytest.raises(FailedPreconditionError) as caught:
        validate(req, SETTINGS.replace(data_dir=str(tmp_path)))
    message = caught.value.message
    assert caught.value.reason == "DATASET_NOT_INSTALLED"
    for part in [*files, str(tmp_path / name), "SSDRBM_DATA_DIR"]:
        assert part in message
    assert "ssdrbm train --data x.npy" in message and "ssdrbm upload" in message


def test_uploads_follow_the_same_preprocessing_rule_as_builtin_images() -> None:
    floats = request(dataset=pb.DatasetRef(dataset_id="ab" * 32))
    floats.training.batch_size = 10
    job = validate(floats)
    assert (job.n_visible, job.spec.dataset.preprocess) == (7, pb.PREPROCESS_NONE)
    images = request(dataset=pb.DatasetRef(dataset_id="cd" * 32))
    images.training.batch_size = 10
    job = validate(images)  # uint8 (60, 28, 20) images, flattened
    assert (job.n_visible, job.spec.dataset.preprocess) == (560, pb.PREPROCESS_BINARIZE)
    images.model.kind = pb.MODEL_KIND_GAUSSIAN
    assert validate(images).spec.dataset.preprocess == pb.PREPROCESS_STANDARDIZE
    images.model.kind = pb.MODEL_KIND_BERNOULLI
    images.dataset.preprocess = pb.PREPROCESS_NONE  # raw 0…255 cannot feed binary units
    assert field_of(images) == "dataset.preprocess"
    mnist = request(dataset=pb.DatasetRef(builtin=pb.BuiltinDataset(name="mnist")))
    mnist.dataset.preprocess = pb.PREPROCESS_NONE
    assert field_of(mnist) == "dataset.preprocess"
    with pytest.raises(NotFoundError):
        validate(request(dataset=pb.DatasetRef(dataset_id="99" * 32)))
    # Float values outside [0, 1] cannot feed binary units as they are: refused on submit.
    normal = request(dataset=pb.DatasetRef(dataset_id="ef" * 32))
    normal.training.batch_size = 10
    assert field_of(normal) == "dataset.preprocess"
    normal.dataset.preprocess = pb.PREPROCESS_SCALE
    assert validate(normal).spec.dataset.preprocess == pb.PREPROCESS_SCALE
    normal.model.kind = pb.MODEL_KIND_GAUSSIAN
    normal.dataset.preprocess = pb.PREPROCESS_UNSPECIFIED
    assert validate(normal).spec.dataset.preprocess == pb.PREPROCESS_NONE


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
        ({"training.epochs": 2}, "training.steps"),  # both
        ({"training.max_backoffs": 1000}, "training.max_backoffs"),
        ({"training.backoff_factor": 1.0}, "training.backoff_factor"),
        ({"training.backoff_factor": math.nan}, "training.backoff_factor"),
        ({"optimizer.method": pb.POLAR_METHOD_SVD, "optimizer.kind": 1}, "optimizer.method"),
        ({"training.batch_size": 10**6}, "training.batch_size"),
        ({"training.batch_size": 4600}, "training.batch_size"),  # more than the training split
        ({"training.steps": 10**12}, "training.steps"),
        ({"training.seed": 2**63}, "training.seed"),  # past the signed 64-bit range
        ({"training.seed": 2**64 - 1}, "training.seed"),  # torch would fail at run time
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


def test_seeds_up_to_the_signed_64_bit_limit_are_accepted() -> None:
    assert validate(bad(**{"training.seed": MAX_SEED})).spec.training.seed == 2**63 - 1
    with pytest.raises(InvalidArgumentError) as caught:
        validate(bad(**{"training.seed": 2**63}))
    assert "between 0 and 9223372036854775807 (2^63 - 1)" in caught.value.message


def test_an_unset_dataset_is_the_synthetic_one() -> None:
    req = request()
    req.dataset.ClearField("builtin")
    assert validate(req).spec.dataset.builtin.name == "synthetic"


def test_the_synthetic_defaults_are_the_generators_own() -> None:
    # Rows of synthetic_rbm_data() saved as a job's input are rows of its data set: a job that
    # leaves the options out must resolve to the generator's own defaults.
    options = validate(request()).spec.dataset.builtin.options
    assert options, "the resolver fills in every option"
    generator = inspect.signature(synthetic_rbm_data).parameters
    assert {key: int(value) for key, value in options.items()} == {
        key: generator[key].default for key in options
    }


def test_per_parameter_hybrid_is_checked_against_the_model() -> None:
    req = request()
    req.optimizer.kind = pb.OPTIMIZER_KIND_SGD
    req.optimizer.per_parameter["W"] = pb.OPTIMIZER_KIND_SSD
    spec = validate(req).spec  # the paper's SSD_W/SGD
    assert spec.optimizer.method == pb.POLAR_METHOD_AUTO
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


# --- budgets: refused on submit, naming the limit, the value and the fix ------------------------

WIDE = "fa" * 32  # a (2000, 784) upload: MNIST's width, enough rows for batch 1000
WIDE_UPLOADS = {WIDE: DatasetInfo(WIDE, (2000, 784), "float32", "wide", 2000 * 784 * 4, (0, 1))}


def validate_upload(req: pb.StartTrainingRequest, uploads: dict[str, DatasetInfo]) -> ResolvedJob:
    async def find_upload(dataset_id: str) -> DatasetInfo:
        return uploads[dataset_id]

    return asyncio.run(resolve(req, SETTINGS, find_upload))


def exhausted(req: pb.StartTrainingRequest, uploads: dict[str, DatasetInfo] | None = None) -> str:
    with pytest.raises(ResourceExhaustedError) as caught:
        validate_upload(req, uploads or UPLOADS)
    return caught.value.message


def on_upload(dataset_id: str, **fields: object) -> pb.StartTrainingRequest:
    return request(dataset=pb.DatasetRef(dataset_id=dataset_id), **fields)


def test_default_budgets_admit_mnist_sized_cd10_with_batch_1000() -> None:
    req = on_upload(
        WIDE,
        model=pb.ModelSpec(n_hidden=2000),
        training=pb.TrainingSpec(steps=10, cd_k=10, batch_size=1000, persistent=True),
        eval=pb.EvalSpec(ais=True),
    )
    assert validate_upload(req, WIDE_UPLOADS).n_visible == 784


def test_an_unbounded_upload_width_is_refused_before_anything_is_allocated() -> None:
    width = 1 << 20
    uploads = {WIDE: DatasetInfo(WIDE, (50, width), "float32", "w", 50 * width * 4, (0, 1))}
    message = exhausted(on_upload(WIDE), uploads)
    assert "1048576 visible units" in message
    assert "SSDRBM_MAX_VISIBLES" in message and "65536" in message


def test_a_model_over_the_byte_budget_names_its_size_and_the_fix() -> None:
    req = request(model=pb.ModelSpec(n_hidden=65_536))
    req.dataset.builtin.options["n_visible"] = "4096"
    message = exhausted(req)
    assert "model size: 1024.3 MiB for 4096×65536" in message
    assert "SSDRBM_MAX_MODEL_BYTES" in message and "model.n_hidden" in message


def test_full_variance_parameters_count_towards_the_model_size() -> None:
    gaussian = pb.ModelSpec(kind=pb.MODEL_KIND_GAUSSIAN, variance=pb.VARIANCE_KIND_FULL, n_hidden=8)
    assert model_bytes(gaussian, 100) == 4 * (100 * 8 + 100 + 8 + 100 * 100)
    assert model_bytes(pb.ModelSpec(n_hidden=8), 100) == 4 * (100 * 8 + 100 + 8)


def test_a_checkpoint_over_the_stores_value_limit_is_refused_on_submit() -> None:
    # 196 MB of parameters fit the model budget; four copies of them do not fit one value.
    req = request(model=pb.ModelSpec(n_hidden=12_000))
    req.dataset.builtin.options["n_visible"] = "4096"
    message = exhausted(req)
    assert "checkpoint size" in message and "SSDRBM_MAX_VALUE_BYTES" in message
    small_store = SETTINGS.replace(max_value_bytes=4 * model_bytes(req.model, 4096) - 1)
    req.model.n_hidden = 8
    assert validate(req, small_store).n_visible == 4096


def test_a_huge_cd_k_is_refused_by_the_step_cost_budget() -> None:
    req = on_upload(
        WIDE,
        model=pb.ModelSpec(n_hidden=2000),
        training=pb.TrainingSpec(steps=10, cd_k=10_000, batch_size=100),
    )
    message = exhausted(req, WIDE_UPLOADS)
    assert "training step cost" in message and "cd_k=10000" in message
    assert "SSDRBM_MAX_STEP_FLOPS" in message and "lower training.cd_k" in message
    assert step_flops(784, 2000, 100, 10_000) > SETTINGS.max_step_flops


def test_huge_ais_settings_are_refused_only_when_ais_runs() -> None:
    huge = pb.EvalSpec(ais=True, ais_chains=100_000, ais_betas=1_000_000)
    message = exhausted(request(eval=huge))
    assert "AIS evaluation cost" in message and "SSDRBM_MAX_EVAL_FLOPS" in message
    huge.ais = False
    assert validate(request(eval=huge)).spec.eval.ais_chains == 100_000


# What the resolver fills when a request leaves it unset, per spec version (the fields the
# worker then reads unchecked). A change here means stored specs of the old version would be
# read wrongly: raise job_spec.SPEC_VERSION and add the new version's entry.
FILLED_AT_SPEC_VERSION = {
    1: {
        "dataset.builtin.name",
        "dataset.builtin.options",
        "dataset.preprocess",
        "eval.ais_betas",
        "eval.ais_chains",
        "eval.every",
        "eval.validation_fraction",
        "model.kind",
        "model.min_variance",
        "model.variance",
        "optimizer.kind",
        "optimizer.lr",
        "optimizer.method",
        "optimizer.momentum",
        "optimizer.per_parameter_lr",
        "optimizer.preconditioner",
        "optimizer.schedule.decay_rate",
        "optimizer.schedule.decay_steps",
        "optimizer.schedule.floor",
        "optimizer.schedule.horizon",
        "optimizer.schedule.kind",
        "optimizer.step_rule",
        "spec_version",
        "training.backoff_factor",
        "training.batch_size",
        "training.cd_k",
        "training.centering.sliding_factor",
        "training.checkpoint_every",
        "training.max_backoffs",
        "training.parallel_tempering.min_beta",
        "training.parallel_tempering.temperatures",
        "training.steps",
    }
}


def _set_fields(message: Message, prefix: str = "") -> set[str]:
    """Dotted paths of the fields set in ``message`` (sub-messages by their set fields)."""
    paths: set[str] = set()
    for field, value in message.ListFields():
        name = f"{prefix}{field.name}"
        nested = field.message_type is not None and not field.is_repeated
        if nested and not field.message_type.GetOptions().map_entry:
            paths |= _set_fields(value, f"{name}.") or {name}
        else:
            paths.add(name)
    return paths


def test_the_resolver_stamps_its_spec_version_and_fills_what_that_version_says() -> None:
    """Every spec the resolver produces carries job_spec.SPEC_VERSION (a value a client sends is
    replaced), and the fields it fills are the ones recorded for that version: filling another
    field without a new version would let a worker read specs of the old one wrongly."""
    sent = request()
    sent.spec_version = SPEC_VERSION + 7
    assert validate(sent).spec.spec_version == SPEC_VERSION
    requests = [
        pb.StartTrainingRequest(model=pb.ModelSpec(n_hidden=8)),
        pb.StartTrainingRequest(
            model=pb.ModelSpec(n_hidden=8, kind=pb.MODEL_KIND_GAUSSIAN),
            optimizer=pb.OptimizerSpec(
                kind=pb.OPTIMIZER_KIND_SSD_PRECONDITIONED,
                per_parameter={"b": pb.OPTIMIZER_KIND_SGD},
                schedule=pb.StepSizeSchedule(kind=pb.SCHEDULE_KIND_COSINE),
            ),
            training=pb.TrainingSpec(
                persistent=True,
                parallel_tempering=pb.ParallelTempering(),
                centering=pb.Centering(),
            ),
        ),
    ]
    filled: set[str] = set()
    for req in requests:
        filled |= _set_fields(validate(req).spec) - _set_fields(req)
    recorded = FILLED_AT_SPEC_VERSION.get(SPEC_VERSION)
    assert filled == recorded, (
        f"the resolver now fills {sorted(filled - (recorded or set()))} and no longer fills "
        f"{sorted((recorded or set()) - filled)}: raise job_spec.SPEC_VERSION and record what "
        "the new version fills"
    )


@pytest.mark.parametrize(
    ("steps", "expected"), [(100, 0.03), (400, 0.03), (1_000, 0.016), (2_000, 0.01), (10**6, 0.01)]
)
def test_an_unset_step_size_suits_the_jobs_length(steps: int, expected: float) -> None:
    """Short jobs take the table's short-run value, long ones its long-run value, and lengths
    between the geometric interpolation to two digits (Bernoulli SSD: 0.03 → 0.01)."""
    req = request(training=pb.TrainingSpec(steps=steps))
    req.optimizer.ClearField("lr")
    assert validate(req).spec.optimizer.lr == expected
    req.optimizer.lr = 0.2  # a step size given is kept at any length
    assert validate(req).spec.optimizer.lr == 0.2


def test_a_job_given_in_epochs_takes_the_step_size_of_its_total_steps() -> None:
    req = request(training=pb.TrainingSpec(epochs=1, batch_size=10))
    req.optimizer.ClearField("lr")
    job = validate(req)
    assert job.spec.optimizer.lr == default_lr("bernoulli", "ssd", None, steps=job.total_steps)
