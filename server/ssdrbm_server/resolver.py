"""The one place a StartTrainingRequest becomes a job's spec: every field resolved and checked.

``resolve`` is called once, in StartTraining (a sweep calls ``resolve_known`` per point). What
it returns is stamped with ``job_spec.SPEC_VERSION``, stored with the job and used verbatim by
the worker, which has no defaults of its own and runs only specs of its version. Fields left
unset take the server's defaults from their owners: step sizes from ssdcore's table for the
job's length (ssdcore/step_sizes.py), blow-up recovery from ssdcore/blowup.py, the
server-tunable counts from ``Settings``, dataset options from the catalog. The one choice that
depends on the worker's device, the SSD polar method, is stored as AUTO; the worker resolves it
once and records what ran in the job's runtime. Fields that do not apply to the job (a
Bernoulli model's variance, a non-SSD job's polar method) stay unset.

Each problem is an INVALID_ARGUMENT naming the field (``optimizer.lr``, ``training.cd_k``, ...)
and the fix. Sizes and costs are request_bounds.py's: counts against the API's limits before a
field is walked, and a job too big for this server (model, checkpoint, per-step or evaluation
cost, ``request_bounds.check_budgets``) RESOURCE_EXHAUSTED naming the limit, the computed value
and the fix, refused on submit: the worker would otherwise allocate it first and fail at run
time.

``resolve`` looks an uploaded dataset up itself; ``resolve_known`` takes it looked up already
(``find_dataset``), so a sweep resolves its points off the event loop.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from ssdrbm.spec import MODELS, OPTIMIZERS, STEP_RULES, VARIANCES
from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore.blowup import BACKOFF_FACTOR, DEFAULT_MAX_BACKOFFS
from ssdcore.centering import DEFAULT_SLIDING_FACTOR
from ssdcore.data import split_sizes
from ssdcore.evaluation.ais import DEFAULT_AIS_BETAS, DEFAULT_AIS_CHAINS
from ssdcore.models.factory import parameter_names as model_parameter_names
from ssdcore.models.gaussian import DEFAULT_MIN_VARIANCE, DEFAULT_VARIANCE
from ssdcore.optim.config import DEFAULT_NESTEROV_MOMENTUM
from ssdcore.optim.step_rules import DEFAULT_STEP_RULE
from ssdcore.schedules import DEFAULT_DECAY_RATE, DEFAULT_DECAY_STEPS, DEFAULT_FLOOR
from ssdcore.step_sizes import (
    LONG_RUN_STEPS,
    RULE_DEPENDENT_OPTIMIZERS,
    SHORT_RUN_STEPS,
    default_lr,
    normalized_step_size_table,
    step_size_table,
)
from ssdcore.tempering import DEFAULT_MIN_BETA, DEFAULT_N_TEMPERATURES, MAX_TEMPERATURES
from ssdcore.training import DEFAULT_BATCH_SIZE, DEFAULT_CD_K, steps_per_epoch
from ssdrbm_server import catalog
from ssdrbm_server.catalog import DatasetShape
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import AlreadyExistsError, InvalidArgumentError
from ssdrbm_server.job_spec import SPEC_VERSION, schedule_config
from ssdrbm_server.request_bounds import (
    MAX_AIS_BETAS,
    MAX_AIS_CHAINS,
    MAX_BACKOFFS,
    MAX_BATCH_SIZE,
    MAX_CD_K,
    MAX_HIDDEN,
    MAX_SEED,
    QUOTED_CHARS,
    at_most,
    check_budgets,
    items_at_most,
    quoted,
)
from ssdrbm_server.request_checks import check_text, enum_value, finite
from ssdrbm_server.store.datasets import DatasetInfo
from ssdrbm_server.vocabulary import (
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    SSD_KINDS,
    STEP_RULE_NAMES,
    VARIANCE_NAMES,
)

MAX_REQUEST_ID_LENGTH = 128
DEFAULT_DATASET = "synthetic"  # the paper's generator: needs no files, so it is always there
INTEGER_DTYPES = frozenset({"uint8"})  # uploads that hold pixel intensities, not probabilities


UploadLookup = Callable[[str], Awaitable[DatasetInfo]]


@dataclass(frozen=True)
class ResolvedJob:
    """A spec ready to store: every default filled, consistent with its dataset."""

    spec: pb.StartTrainingRequest
    total_steps: int
    n_visible: int
    n_examples: int

    @property
    def pack_key(self) -> str:
        """Which queued jobs this one may train beside (ssdrbm_server/packing.py)."""
        from ssdrbm_server.packing import job_pack_key  # imports the pack's rules (torch)

        return job_pack_key(self.spec, self.n_visible)


async def resolve(
    request: pb.StartTrainingRequest, settings: Settings, find_upload: UploadLookup
) -> ResolvedJob:
    """The fully resolved spec of ``request`` (which is left unchanged).

    ``find_upload(dataset_id)`` gives an uploaded dataset's shape and dtype (NotFoundError when
    the caller cannot see it).
    """
    spec = _resolved_fields(request, settings)
    dataset_id = _check_dataset_ref(spec.dataset, settings)
    upload = await find_upload(dataset_id) if dataset_id else None
    return _with_upload(spec, upload, settings)


async def find_dataset(
    request: pb.StartTrainingRequest, settings: Settings, find_upload: UploadLookup
) -> DatasetInfo | None:
    """The uploaded dataset ``request`` trains on, looked up (None for a built-in one), for
    ``resolve_known``; its dataset reference is checked as ``resolve`` checks it."""
    dataset = pb.DatasetRef()
    dataset.CopyFrom(request.dataset)
    dataset_id = _check_dataset_ref(dataset, settings)
    return await find_upload(dataset_id) if dataset_id else None


def resolve_known(
    request: pb.StartTrainingRequest, settings: Settings, upload: DatasetInfo | None
) -> ResolvedJob:
    """``resolve`` for a request whose uploaded dataset ``find_dataset`` looked up already:
    no I/O, so it may run off the event loop (a sweep resolves its points in a thread)."""
    spec = _resolved_fields(request, settings)
    dataset_id = _check_dataset_ref(spec.dataset, settings)
    if dataset_id != (upload.id if upload else None):
        raise ValueError(f"the request names dataset {dataset_id!r}, not the one looked up")
    return _with_upload(spec, upload, settings)


def _resolved_fields(
    request: pb.StartTrainingRequest, settings: Settings
) -> pb.StartTrainingRequest:
    """A copy of ``request`` with every field that does not depend on the data resolved."""
    spec = pb.StartTrainingRequest()
    spec.CopyFrom(request)
    spec.validate_only = False  # how this call was made, not part of the job
    spec.spec_version = SPEC_VERSION  # what the worker checks before it reads the spec
    check_text(spec.request_id, "request_id", MAX_REQUEST_ID_LENGTH)
    check_text(spec.name, "name", settings.max_string_length)
    _resolve_model(spec.model)
    _resolve_optimizer(spec.optimizer, spec.model)
    _resolve_training(spec.training, settings)
    _resolve_eval(spec.eval, settings)
    return spec


def _with_upload(
    spec: pb.StartTrainingRequest, upload: DatasetInfo | None, settings: Settings
) -> ResolvedJob:
    """The checks that need the dataset (its facts from the upload, or the catalog's)."""
    shape = (
        DatasetShape(n_visible=math.prod(upload.shape[1:]), n_examples=upload.shape[0])
        if upload is not None
        else catalog.builtin_shape(spec.dataset.builtin.name, _options(spec), settings)
    )
    _resolve_preprocess(spec.dataset, spec.model, upload)
    job = _with_dataset(spec, shape, settings)
    _fill_step_sizes(job.spec, job.total_steps)
    # A cosine schedule without a horizon runs over the job's steps (ssdcore's one rule).
    schedule = job.spec.optimizer.schedule
    schedule.horizon = schedule_config(schedule).for_run(job.total_steps).horizon
    return job


async def training_defaults(settings: Settings) -> pb.TrainingDefaults:
    """The table GetTrainingDefaults answers with: step sizes and a resolved minimal request."""
    table = pb.TrainingDefaults(short_run_steps=SHORT_RUN_STEPS, long_run_steps=LONG_RUN_STEPS)
    tables = (
        (pb.STEP_RULE_PAPER, step_size_table()),
        (pb.STEP_RULE_NORMALIZED, normalized_step_size_table()),
    )
    for rule, entries in tables:
        for entry in entries:
            by_rule = entry.optimizer in RULE_DEPENDENT_OPTIMIZERS
            table.step_sizes.add(
                model=MODELS[entry.model_kind],
                variance=VARIANCES.get(entry.variance, pb.VARIANCE_KIND_UNSPECIFIED),
                optimizer=OPTIMIZERS[entry.optimizer],
                lr=entry.lr,
                source=entry.source,
                step_rule=rule if by_rule else pb.STEP_RULE_UNSPECIFIED,
                short_run_lr=entry.short_lr,
            )
    minimal = pb.StartTrainingRequest(model=pb.ModelSpec(n_hidden=16))
    table.example.CopyFrom((await resolve(minimal, settings, _no_uploads)).spec)
    return table


async def _no_uploads(dataset_id: str) -> DatasetInfo:
    raise AssertionError("a request without a dataset_id looks none up")


def first_difference(a: Message, b: Message, prefix: str = "") -> str | None:
    """The first field (in declaration order, dotted path) where two messages differ; a field
    left unset differs from one set to its zero value."""
    for field in a.DESCRIPTOR.fields:
        name = f"{prefix}{field.name}"
        left, right = getattr(a, field.name), getattr(b, field.name)
        if _is_submessage(field):
            difference = first_difference(left, right, f"{name}.")
            if difference:
                return difference
        elif _is_map(field):
            if dict(left) != dict(right):
                return name
        elif left != right or _presence(a, field) != _presence(b, field):
            return name
    return None


def check_same_request(
    first: pb.StartTrainingRequest | pb.StartSweepRequest,
    again: pb.StartTrainingRequest | pb.StartSweepRequest,
    made: str,
) -> None:
    """A reused request_id must come with the request it was first used with (both resolved);
    ALREADY_EXISTS naming the first difference otherwise. ``made``: what the first request
    made, e.g. "job <id>"."""
    difference = first_difference(first, again)
    if difference is not None:
        raise AlreadyExistsError(
            f"request_id {again.request_id!r} was already used for {made} with a different "
            f"request (first difference: {difference}); use a new request_id for a new one, or "
            "repeat the original request to get that one",
            reason="REQUEST_ID_REUSED",
        )


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _is_submessage(field: FieldDescriptor) -> bool:
    return field.message_type is not None and not field.is_repeated


def _presence(message: Message, field: FieldDescriptor) -> bool | None:
    return message.HasField(field.name) if field.has_presence else None


def parameter_names(model: pb.ModelSpec) -> tuple[str, ...]:
    """Names of the model's parameters, as optimizer.per_parameter uses them."""
    variance = VARIANCE_NAMES.get(model.variance) if model.kind == pb.MODEL_KIND_GAUSSIAN else None
    return model_parameter_names(MODEL_NAMES[model.kind], variance)


# --- model ------------------------------------------------------------------------------------


def _resolve_model(model: pb.ModelSpec) -> None:
    enum_value(pb.ModelKind, model.kind, "model.kind")
    enum_value(pb.VarianceKind, model.variance, "model.variance")
    if model.kind == pb.MODEL_KIND_UNSPECIFIED:
        model.kind = pb.MODEL_KIND_BERNOULLI
    # The model's variances live in [min_variance, 1e4]; 1 is far above any useful floor.
    if not 0 <= finite(model.min_variance, "model.min_variance") < 1:
        raise InvalidArgumentError(
            "model.min_variance",
            f"must be in [0, 1) (0 = the default {DEFAULT_MIN_VARIANCE}), got {model.min_variance}",
        )
    gaussian = model.kind == pb.MODEL_KIND_GAUSSIAN
    only_gaussian = "Gaussian models only; leave it unset for Bernoulli"
    _default_where_it_applies(
        model, "model.variance", VARIANCES[DEFAULT_VARIANCE], gaussian, only_gaussian
    )
    _default_where_it_applies(
        model, "model.min_variance", DEFAULT_MIN_VARIANCE, gaussian, only_gaussian
    )
    if model.n_hidden < 1:
        raise InvalidArgumentError("model.n_hidden", "is required and must be at least 1")
    at_most("model.n_hidden", model.n_hidden, MAX_HIDDEN)


# --- optimizer --------------------------------------------------------------------------------


def _resolve_optimizer(optimizer: pb.OptimizerSpec, model: pb.ModelSpec) -> None:
    enum_value(pb.OptimizerKind, optimizer.kind, "optimizer.kind")
    enum_value(pb.PolarMethod, optimizer.method, "optimizer.method")
    enum_value(pb.Preconditioner, optimizer.preconditioner, "optimizer.preconditioner")
    enum_value(pb.StepRule, optimizer.step_rule, "optimizer.step_rule")
    if optimizer.kind == pb.OPTIMIZER_KIND_UNSPECIFIED:
        optimizer.kind = pb.OPTIMIZER_KIND_SSD
    _check_per_parameter(optimizer, model)
    # NaN fails every comparison, so `not lr > 0` also refuses it. Unset step sizes are filled
    # in once the job's length is known (_fill_step_sizes).
    if optimizer.HasField("lr") and not finite(optimizer.lr, "optimizer.lr") > 0:
        raise InvalidArgumentError("optimizer.lr", f"must be > 0, got {optimizer.lr}")
    kinds = {optimizer.kind, *optimizer.per_parameter.values()}
    if not optimizer.HasField("momentum"):
        nesterov = pb.OPTIMIZER_KIND_NESTEROV in kinds
        optimizer.momentum = DEFAULT_NESTEROV_MOMENTUM if nesterov else 0.0
    if not 0 <= finite(optimizer.momentum, "optimizer.momentum") < 1:
        raise InvalidArgumentError(
            "optimizer.momentum", f"must be in [0, 1), got {optimizer.momentum}"
        )
    if not finite(optimizer.weight_decay, "optimizer.weight_decay") >= 0:
        raise InvalidArgumentError(
            "optimizer.weight_decay", f"must be >= 0, got {optimizer.weight_decay}"
        )
    if not finite(optimizer.max_spectral_norm, "optimizer.max_spectral_norm") >= 0:
        raise InvalidArgumentError(
            "optimizer.max_spectral_norm",
            f"must be >= 0 (0 = unbounded), got {optimizer.max_spectral_norm}",
        )
    at_most("optimizer.rank", optimizer.rank, MAX_HIDDEN)
    _resolve_spectral_choices(optimizer, kinds)
    _resolve_schedule(optimizer.schedule)


def _fill_step_sizes(spec: pb.StartTrainingRequest, total_steps: int) -> None:
    """Unset step sizes from the step-size table, for a run of the job's length and the step
    rule asked for (unset: the paper's rule)."""
    optimizer, model = spec.optimizer, spec.model
    rule = STEP_RULE_NAMES.get(optimizer.step_rule, "paper")
    variance = VARIANCE_NAMES.get(model.variance) if model.kind == pb.MODEL_KIND_GAUSSIAN else None

    def table(kind: int) -> float:
        return default_lr(
            MODEL_NAMES[model.kind], OPTIMIZER_NAMES[kind], variance, rule, total_steps
        )

    if not optimizer.HasField("lr"):
        optimizer.lr = table(optimizer.kind)
    for name, kind in optimizer.per_parameter.items():
        if name not in optimizer.per_parameter_lr:
            optimizer.per_parameter_lr[name] = table(kind)


def _resolve_schedule(schedule: pb.StepSizeSchedule) -> None:
    """Unset kind: constant; unset decay parameters: ssdcore.schedules' defaults; then checked
    by ssdcore's own Schedule (its message names the field)."""
    enum_value(pb.ScheduleKind, schedule.kind, "optimizer.schedule.kind")
    if schedule.kind == pb.SCHEDULE_KIND_UNSPECIFIED:
        schedule.kind = pb.SCHEDULE_KIND_CONSTANT
    if not schedule.HasField("decay_rate"):
        schedule.decay_rate = DEFAULT_DECAY_RATE
    if not schedule.HasField("decay_steps"):
        schedule.decay_steps = DEFAULT_DECAY_STEPS
    if not schedule.HasField("floor"):
        schedule.floor = DEFAULT_FLOOR
    try:
        schedule_config(schedule)
    except ValueError as error:
        named = re.match(r"Schedule\.(\w+)", str(error))
        field = f"optimizer.schedule.{named.group(1)}" if named else "optimizer.schedule"
        raise InvalidArgumentError(field, str(error)) from None


def _check_per_parameter(optimizer: pb.OptimizerSpec, model: pb.ModelSpec) -> None:
    allowed = parameter_names(model)
    for field, entries in (
        ("optimizer.per_parameter", optimizer.per_parameter),
        ("optimizer.per_parameter_lr", optimizer.per_parameter_lr),
    ):
        items_at_most(field, entries, len(allowed), f"one per parameter: {list(allowed)}")
    for name, kind in optimizer.per_parameter.items():
        field = f"optimizer.per_parameter[{name[:QUOTED_CHARS]}]"
        _check_parameter_name(name, allowed, field)
        if enum_value(pb.OptimizerKind, kind, field) == pb.OPTIMIZER_KIND_UNSPECIFIED:
            raise InvalidArgumentError(field, "name an optimizer kind (SGD, NESTEROV, SSD, ...)")
    for name, lr in optimizer.per_parameter_lr.items():
        field = f"optimizer.per_parameter_lr[{name[:QUOTED_CHARS]}]"
        _check_parameter_name(name, allowed, field)
        if not finite(lr, field) > 0:
            raise InvalidArgumentError(field, f"must be > 0, got {lr}")


def _check_parameter_name(name: str, allowed: tuple[str, ...], field: str) -> None:
    if name not in allowed:
        raise InvalidArgumentError(
            field, f"unknown parameter {quoted(name)}; this model has {list(allowed)}"
        )


def _resolve_spectral_choices(optimizer: pb.OptimizerSpec, kinds: set[int]) -> None:
    """SSD jobs get AUTO for an unset polar method; the worker picks it for its device."""
    ssd = bool(kinds & SSD_KINDS)
    only_ssd = "SSD only; leave it unset for SGD and Nesterov"
    _default_where_it_applies(optimizer, "optimizer.method", pb.POLAR_METHOD_AUTO, ssd, only_ssd)
    # The library's default rule, not a second choice of the service's.
    default_rule = STEP_RULES[DEFAULT_STEP_RULE]
    _default_where_it_applies(optimizer, "optimizer.step_rule", default_rule, ssd, only_ssd)
    _default_where_it_applies(
        optimizer,
        "optimizer.preconditioner",
        pb.PRECONDITIONER_RMSPROP,
        pb.OPTIMIZER_KIND_SSD_PRECONDITIONED in kinds,
        "SSD_PRECONDITIONED only; leave it unset for other optimizers",
    )


def _default_where_it_applies(
    spec: pb.ModelSpec | pb.OptimizerSpec, path: str, default: float, applies: bool, only: str
) -> None:
    """A field (``path``: "model.variance") that applies to some choices only: unset (0, an
    enum's UNSPECIFIED) it takes ``default`` where it applies; set where it does not, it is
    refused ("applies to <only>")."""
    field = path.rpartition(".")[2]
    if applies:
        if not getattr(spec, field):
            setattr(spec, field, default)
    elif getattr(spec, field):
        raise InvalidArgumentError(path, f"applies to {only}")


# --- training and evaluation ------------------------------------------------------------------


def _resolve_training(training: pb.TrainingSpec, settings: Settings) -> None:
    if not training.HasField("cd_k"):
        training.cd_k = DEFAULT_CD_K
    if not 1 <= training.cd_k <= MAX_CD_K:
        raise InvalidArgumentError(
            "training.cd_k", f"must be between 1 and {MAX_CD_K}, got {training.cd_k}"
        )
    if training.batch_size == 0:
        training.batch_size = DEFAULT_BATCH_SIZE
    at_most("training.batch_size", training.batch_size, MAX_BATCH_SIZE)
    if training.steps and training.epochs:
        raise InvalidArgumentError(
            "training.steps", "set one of training.steps and training.epochs, not both"
        )
    if not training.steps and not training.epochs:
        training.steps = settings.default_steps
    if training.steps > settings.max_total_steps:
        raise InvalidArgumentError(
            "training.steps", f"must be at most {settings.max_total_steps}, got {training.steps}"
        )
    if training.seed > MAX_SEED:
        raise InvalidArgumentError(
            "training.seed", f"must be between 0 and {MAX_SEED} (2^63 - 1), got {training.seed}"
        )
    if training.checkpoint_every == 0:
        training.checkpoint_every = settings.default_checkpoint_every
    if not training.HasField("max_backoffs"):
        training.max_backoffs = DEFAULT_MAX_BACKOFFS
    at_most("training.max_backoffs", training.max_backoffs, MAX_BACKOFFS)
    if training.backoff_factor == 0:
        training.backoff_factor = BACKOFF_FACTOR
    if not finite(training.backoff_factor, "training.backoff_factor") > 1:
        raise InvalidArgumentError(
            "training.backoff_factor",
            f"must be > 1 (each backoff divides the step sizes by it), got "
            f"{training.backoff_factor}",
        )
    _resolve_tempering(training)
    _resolve_centering(training)


def _resolve_tempering(training: pb.TrainingSpec) -> None:
    """Parallel tempering: PCD only; unset counts take ssdcore's defaults (ssdcore/tempering.py)."""
    if not training.HasField("parallel_tempering"):
        return
    field = "training.parallel_tempering"
    if not training.persistent:
        raise InvalidArgumentError(
            field,
            "tempers persistent chains: set training.persistent = true (PCD), or leave "
            f"{field} unset",
        )
    tempering = training.parallel_tempering
    if tempering.temperatures == 0:
        tempering.temperatures = DEFAULT_N_TEMPERATURES
    if not 2 <= tempering.temperatures <= MAX_TEMPERATURES:
        raise InvalidArgumentError(
            f"{field}.temperatures",
            f"must be between 2 and {MAX_TEMPERATURES}, got {tempering.temperatures} "
            f"(one temperature is plain PCD: leave {field} unset)",
        )
    if tempering.min_beta == 0:
        tempering.min_beta = DEFAULT_MIN_BETA
    if not 0 < finite(tempering.min_beta, f"{field}.min_beta") < 1:
        raise InvalidArgumentError(
            f"{field}.min_beta",
            f"must be in (0, 1) (the hottest chains' inverse temperature), got "
            f"{tempering.min_beta}",
        )


def _resolve_centering(training: pb.TrainingSpec) -> None:
    """Centered training: the sliding factor from ssdcore (ssdcore/centering.py) when unset."""
    if not training.HasField("centering"):
        return
    centering = training.centering
    if not centering.HasField("sliding_factor"):
        centering.sliding_factor = DEFAULT_SLIDING_FACTOR
    field = "training.centering.sliding_factor"
    if not 0 <= finite(centering.sliding_factor, field) <= 1:
        raise InvalidArgumentError(
            field,
            f"must be in [0, 1] (how far the offsets move towards each batch's means; 0 keeps "
            f"them fixed), got {centering.sliding_factor}",
        )


def _resolve_eval(eval_spec: pb.EvalSpec, settings: Settings) -> None:
    if eval_spec.every == 0:
        eval_spec.every = settings.default_eval_every
    if eval_spec.ais_chains == 0:
        eval_spec.ais_chains = DEFAULT_AIS_CHAINS
    at_most("eval.ais_chains", eval_spec.ais_chains, MAX_AIS_CHAINS)
    if eval_spec.ais_betas == 0:
        eval_spec.ais_betas = DEFAULT_AIS_BETAS
    at_most("eval.ais_betas", eval_spec.ais_betas, MAX_AIS_BETAS)
    fraction = finite(eval_spec.validation_fraction, "eval.validation_fraction")
    if fraction == 0:
        eval_spec.validation_fraction = settings.default_validation_fraction
    elif not 0 < fraction < 1:
        raise InvalidArgumentError(
            "eval.validation_fraction", f"must be in (0, 1) (0 = default), got {fraction}"
        )


# --- data ---------------------------------------------------------------------------------------


def _check_dataset_ref(dataset: pb.DatasetRef, settings: Settings) -> str | None:
    """The uploaded dataset's id to look up; None for a built-in one (its options filled)."""
    enum_value(pb.Preprocess, dataset.preprocess, "dataset.preprocess")
    source = dataset.WhichOneof("source")
    if source is None:
        dataset.builtin.name = DEFAULT_DATASET
        source = "builtin"
    if source == "builtin":
        _resolve_builtin(dataset.builtin, settings)
        return None
    if not dataset.dataset_id:
        raise InvalidArgumentError("dataset.dataset_id", "is empty; use an UploadDataset id")
    check_text(dataset.dataset_id, "dataset.dataset_id", settings.max_string_length)
    return dataset.dataset_id


def _resolve_builtin(builtin: pb.BuiltinDataset, settings: Settings) -> None:
    check_text(builtin.name, "dataset.builtin.name", settings.max_string_length)
    known = catalog.OPTIONS.get(builtin.name)
    if known is not None:  # an unknown name is refused by parse_options, its options unread
        items_at_most(
            "dataset.builtin.options", builtin.options, len(known), f"allowed: {sorted(known)}"
        )
    for key, value in builtin.options.items():
        check_text(key, "dataset.builtin.options", settings.max_string_length)
        check_text(value, f"dataset.builtin.options[{key}]", settings.max_string_length)
    parsed = catalog.parse_options(builtin.name, builtin.options, "dataset.builtin")
    for key, value in parsed.items():  # stored too: the worker reads them as they are
        builtin.options[key] = str(value)


def _options(spec: pb.StartTrainingRequest) -> dict[str, int]:
    return {key: int(value) for key, value in spec.dataset.builtin.options.items()}


def _resolve_preprocess(
    dataset: pb.DatasetRef, model: pb.ModelSpec, upload: DatasetInfo | None
) -> None:
    """The natural preprocessing, one rule for built-in and uploaded data: images (MNIST, Frey
    Face, uint8 uploads) are binarized for binary units and standardized for Gaussian ones;
    the synthetic data is binary already, and float uploads are taken as given."""
    builtin_image = dataset.builtin.name in catalog.IMAGE_DATASETS
    images = upload.dtype in INTEGER_DTYPES if upload else builtin_image
    gaussian = model.kind == pb.MODEL_KIND_GAUSSIAN
    if dataset.preprocess == pb.PREPROCESS_UNSPECIFIED:
        if images:
            dataset.preprocess = pb.PREPROCESS_STANDARDIZE if gaussian else pb.PREPROCESS_BINARIZE
        else:
            dataset.preprocess = pb.PREPROCESS_NONE
    elif images and not gaussian and dataset.preprocess == pb.PREPROCESS_NONE:
        raise InvalidArgumentError(
            "dataset.preprocess",
            "NONE leaves pixel intensities (0…255), but a Bernoulli model's visible units are "
            "probabilities in [0, 1]; use BINARIZE or SCALE, or leave it unset (BINARIZE)",
        )
    _check_probabilities(dataset, gaussian, upload)


def _check_probabilities(
    dataset: pb.DatasetRef, gaussian: bool, upload: DatasetInfo | None
) -> None:
    """Binary units take values in [0, 1]: an upload outside it, used as it is, is refused."""
    if gaussian or upload is None or upload.value_range is None:
        return
    low, high = upload.value_range
    if dataset.preprocess == pb.PREPROCESS_NONE and (low < 0 or high > 1):
        raise InvalidArgumentError(
            "dataset.preprocess",
            f"the uploaded data holds values from {low:g} to {high:g}, but a Bernoulli model's "
            "visible units are probabilities in [0, 1]; use SCALE or BINARIZE, or a Gaussian "
            "model",
        )


def _with_dataset(
    spec: pb.StartTrainingRequest, dataset: DatasetShape, settings: Settings
) -> ResolvedJob:
    """The checks that need the dataset's width and size; computes ``total_steps``."""
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
    check_budgets(spec, dataset.n_visible, settings)
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
    return ResolvedJob(spec, total_steps, dataset.n_visible, dataset.n_examples)
