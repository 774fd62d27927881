"""Build a ``StartTrainingRequest`` from plain keyword arguments.

Every argument left out (None) is sent unset, so the service fills in its own default: the
defaults live on the server, in one table (``Client.training_defaults()`` and
``ssdrbm defaults`` show them; the job's ``spec`` shows what was filled in). Enum-valued
options are given by their lower-case names ("gaussian", "newton-schulz", ...); an unknown name
raises :class:`~ssdrbm.errors.InvalidArgument` naming the field and the choices, before anything
is sent. Numeric ranges are checked by the service, which names the field in its answer.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import math
import struct
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from ssdrbm.errors import InvalidArgument
from ssdrbm.v1 import rbm_pb2

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


def short_name(name: str, prefix: str) -> str:
    """An enum value's name as options take it and outputs show it: without the enum's prefix,
    lower-case, dash-separated (``STEP_RULE_PAPER`` → ``paper``, ``POLAR_METHOD_NEWTON_SCHULZ``
    → ``newton-schulz``). The one rendering of enum values in the SDK and the CLI."""
    return name.removeprefix(prefix).lower().replace("_", "-")


def _prefix(descriptor: EnumDescriptor) -> str:
    """A proto enum's prefix: the name of its value 0 (always ..._UNSPECIFIED) up to UNSPECIFIED."""
    return descriptor.values_by_number[0].name.removesuffix("UNSPECIFIED")


def enum_choices(enum: Any) -> dict[str, int]:
    """The :func:`short_name` of each of a proto enum's values but UNSPECIFIED, and its number."""
    prefix = _prefix(enum.DESCRIPTOR)
    return {short_name(name, prefix): number for name, number in enum.items() if number}


def enum_name(enum: Any, number: int) -> str | None:
    """The :func:`short_name` of a proto enum's value; None for UNSPECIFIED."""
    return short_name(enum.Name(number), _prefix(enum.DESCRIPTOR)) if number else None


def enum_member(cls: type[E], enum: Any, number: int) -> E:
    """The member of ``cls`` named as proto enum value ``number`` without the enum's prefix; an
    unknown number is ``cls.UNSPECIFIED``."""
    name = enum.Name(number) if number in enum.values() else ""
    return cls.__members__.get(name.removeprefix(_prefix(enum.DESCRIPTOR)), cls["UNSPECIFIED"])


MODELS = enum_choices(rbm_pb2.ModelKind)
VARIANCES = enum_choices(rbm_pb2.VarianceKind)
OPTIMIZERS = enum_choices(rbm_pb2.OptimizerKind)
METHODS = enum_choices(rbm_pb2.PolarMethod)
PRECONDITIONERS = enum_choices(rbm_pb2.Preconditioner)
PREPROCESSING = enum_choices(rbm_pb2.Preprocess)
STEP_RULES = enum_choices(rbm_pb2.StepRule)
SCHEDULES = enum_choices(rbm_pb2.ScheduleKind)
# What "KIND,X,Y" sets in a schedule given as text, per kind (the CLI's --schedule).
SCHEDULE_TEXT_FIELDS = {
    "constant": (),
    "exponential": ("decay_rate", "decay_steps"),
    "inverse-time": ("decay_steps",),
    "cosine": ("floor", "horizon"),
}


def choose(field: str, value: str | None, choices: Mapping[str, int]) -> int:
    """The enum number for ``value`` (0, the server default, for ``None``)."""
    if value is None:
        return 0
    key = str(value).lower().replace("_", "-")
    if key not in choices:
        raise InvalidArgument(
            f"{field}: unknown value {value!r}; choose one of {', '.join(choices)}"
        )
    return choices[key]


def message_dict(message: Message) -> dict[str, Any]:
    """A message's set fields as plain values, as people read them and the options take them:
    field names as in the proto, enum values by :func:`short_name` (``bernoulli``, ``paper``),
    64-bit integers as numbers (proto JSON makes them strings), float32 values at their
    shortest (``0.1``, not ``0.10000000149011612``). Job specs and the service's defaults are
    shown through it, so the SDK, the CLI's tables and its ``--json`` agree."""
    return {field.name: _field_value(field, value) for field, value in message.ListFields()}


def from_message(cls: type[T], message: Message, **given: Any) -> T:
    """``cls(**given)``, each other field of dataclass ``cls`` read from ``message``'s field of
    the same name: None where an optional field is unset, a Timestamp as an aware UTC datetime,
    a map as a dict, a repeated field as a tuple."""
    for name in (field.name for field in dataclasses.fields(cls) if field.name not in given):
        descriptor, value = message.DESCRIPTOR.fields_by_name[name], getattr(message, name)
        if descriptor.has_presence and not message.HasField(name):
            value = None
        elif descriptor.message_type is Timestamp.DESCRIPTOR:
            value = message_time(message, name)
        elif descriptor.message_type is not None and descriptor.message_type.GetOptions().map_entry:
            value = dict(value)
        elif descriptor.is_repeated:
            value = tuple(value)
        given[name] = value
    return cls(**given)


def message_time(message: Message, name: str) -> datetime | None:
    """Timestamp field ``name`` as an aware UTC datetime; None while it is unset."""
    return optional_message(message, name, lambda stamp: stamp.ToDatetime(tzinfo=UTC))


def optional_message(message: Message, name: str, convert: Callable[[Any], T]) -> T | None:
    """``convert`` of message field ``name``; None while it is unset."""
    return convert(getattr(message, name)) if message.HasField(name) else None


def _field_value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {key: _single_value(value_field, item) for key, item in value.items()}
    if field.is_repeated:
        return [_single_value(field, item) for item in value]
    return _single_value(field, value)


def _single_value(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = field.enum_type.values_by_number.get(value)
        if known is None:  # a value newer than this client: its number
            return value
        return short_name(known.name, _prefix(field.enum_type))
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if field.message_type.file.package == "google.protobuf":  # Timestamp, Struct, ...
            return json_format.MessageToDict(value)
        return message_dict(value)
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return _shortest_float32(value)
    if field.type == FieldDescriptor.TYPE_BYTES:
        return base64.b64encode(value).decode("ascii")  # as proto JSON writes bytes
    return value


def _shortest_float32(value: float) -> float:
    """The shortest decimal that is the same float32 (proto JSON's rendering of a float)."""
    if not math.isfinite(value):
        return value
    for digits in range(6, 10):
        short = float(f"{value:.{digits}g}")
        if struct.pack("<f", short) == struct.pack("<f", value):
            return short
    return value


@dataclass(frozen=True)
class StepSizeDefault:
    """The server's default step size for one model, variance and optimizer."""

    model: str
    variance: str | None  # Gaussian models only
    optimizer: str
    lr: float  # for jobs of TrainingDefaults.long_run_steps or more
    source: str = ""  # the tuning the value comes from
    step_rule: str | None = None  # SSD entries: "paper" or "normalized"; None: either rule
    short_run_lr: float | None = None  # for jobs of short_run_steps or fewer; None: lr always

    def lr_for(self, *, short_run: bool) -> float:
        """The value for short jobs (``short_run``) or for long ones."""
        return self.short_run_lr if short_run and self.short_run_lr is not None else self.lr


@dataclass(frozen=True)
class TrainingDefaults:
    """What the server fills into a training request's unset fields."""

    step_sizes: list[StepSizeDefault]
    example: dict[str, Any]  # a minimal request (n_hidden only) as the server resolves it
    # The job lengths the step sizes were measured at; a job between them takes the geometric
    # interpolation of short_run_lr and lr (a resolved request shows its value).
    short_run_steps: int = 0
    long_run_steps: int = 0

    @classmethod
    def from_proto(cls, message: rbm_pb2.TrainingDefaults) -> TrainingDefaults:
        step_sizes = [
            from_message(
                StepSizeDefault,
                entry,
                model=enum_name(rbm_pb2.ModelKind, entry.model) or "",
                variance=enum_name(rbm_pb2.VarianceKind, entry.variance),
                optimizer=enum_name(rbm_pb2.OptimizerKind, entry.optimizer) or "",
                step_rule=enum_name(rbm_pb2.StepRule, entry.step_rule),
            )
            for entry in message.step_sizes
        ]
        return from_message(
            cls, message, step_sizes=step_sizes, example=message_dict(message.example)
        )

    def lr(
        self,
        model: str,
        optimizer: str,
        variance: str | None = None,
        step_rule: str = "paper",
        *,
        short_run: bool = False,
    ) -> float:
        """The default step size of one combination for long jobs, or for short ones
        (``short_run``); KeyError when the table lacks it. ``step_rule`` matters for the SSD
        optimizers only. A job's own value is in its resolved spec (``validate_only``)."""
        wanted = (model, optimizer, variance)
        for entry in self.step_sizes:
            same = (entry.model, entry.optimizer, entry.variance) == wanted
            if same and entry.step_rule in (None, step_rule):
                return entry.lr_for(short_run=short_run)
        raise KeyError((model, optimizer, variance, step_rule))


def parse_schedule(text: str) -> dict[str, Any]:
    """A schedule given as ``KIND[,X[,Y]]`` (``cosine,0.05``, ``exponential,0.5,2000``,
    ``inverse-time,500``) as :func:`training_request`'s ``schedule`` mapping."""
    kind, *values = [part.strip() for part in str(text).split(",")]
    kind = kind.lower().replace("_", "-")
    if kind not in SCHEDULE_TEXT_FIELDS:
        raise InvalidArgument(
            f"schedule: unknown kind {kind!r}; choose one of {', '.join(SCHEDULE_TEXT_FIELDS)}"
        )
    fields = SCHEDULE_TEXT_FIELDS[kind]
    if len(values) > len(fields):
        forms = "".join(f"[,{name.upper()}" for name in fields) + "]" * len(fields)
        raise InvalidArgument(f"schedule: {kind} takes {kind}{forms}; got {text!r}")
    schedule: dict[str, Any] = {"kind": kind}
    for name, value in zip(fields, values, strict=False):
        try:
            number = float(value)
            schedule[name] = int(number) if name in ("decay_steps", "horizon") else number
        except ValueError:
            raise InvalidArgument(f"schedule: {name} expects a number, got {value!r}") from None
    return schedule


def new_request_id() -> str:
    """A fresh idempotency key, so that a retried StartTraining never creates a second job."""
    return uuid.uuid4().hex


def _check_unsigned(**values: Any) -> None:
    """Refuse negative or non-integer counts here: protobuf's own error would not name the field."""
    for field, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{field}: must be a non-negative integer, got {value!r}")


def set_given(message: Any, **values: Any) -> Any:
    """Set the fields whose value is not None; the others stay unset (the server's default)."""
    for field, value in values.items():
        if value is not None:
            setattr(message, field, value)
    return message


def training_request(
    *,
    model: str | None = None,
    variance: str | None = None,
    min_variance: float | None = None,
    n_hidden: int | None = None,
    optimizer: str | None = None,
    method: str | None = None,
    preconditioner: str | None = None,
    lr: float | None = None,
    momentum: float | None = None,
    weight_decay: float | None = None,
    max_spectral_norm: float | None = None,
    rank: int | None = None,
    per_parameter: Mapping[str, str] | None = None,
    per_parameter_lr: Mapping[str, float] | None = None,
    step_rule: str | None = None,
    schedule: str | Mapping[str, Any] | None = None,
    warmup_steps: int | None = None,
    cd_k: int | None = None,
    persistent: bool | None = None,
    centered: bool | None = None,
    centering_sliding_factor: float | None = None,
    tempering: int | None = None,
    tempering_min_beta: float | None = None,
    batch_size: int | None = None,
    steps: int | None = None,
    epochs: int | None = None,
    seed: int | None = None,
    checkpoint_every: int | None = None,
    max_backoffs: int | None = None,
    backoff_factor: float | None = None,
    eval_every: int | None = None,
    ais: bool | None = None,
    ais_chains: int | None = None,
    ais_betas: int | None = None,
    validation_fraction: float | None = None,
    dataset: str | None = None,
    dataset_id: str | None = None,
    dataset_options: Mapping[str, Any] | None = None,
    preprocess: str | None = None,
    request_id: str | None = None,
    name: str | None = None,
    validate_only: bool | None = None,
) -> rbm_pb2.StartTrainingRequest:
    """The request for :meth:`ssdrbm.Client.start_training`; see that method for the arguments.

    Arguments left as None are sent unset: the server fills in its defaults. A missing
    ``request_id`` is generated, which makes retries safe.
    """
    _check_unsigned(
        n_hidden=n_hidden,
        rank=rank,
        cd_k=cd_k,
        tempering=tempering,
        batch_size=batch_size,
        steps=steps,
        epochs=epochs,
        seed=seed,
        checkpoint_every=checkpoint_every,
        max_backoffs=max_backoffs,
        eval_every=eval_every,
        ais_chains=ais_chains,
        ais_betas=ais_betas,
    )
    if steps is not None and epochs is not None:
        raise InvalidArgument("steps, epochs: give one of them, not both")
    if dataset is not None and dataset_id is not None:
        raise InvalidArgument("dataset, dataset_id: give one of them, not both")
    request = rbm_pb2.StartTrainingRequest(request_id=request_id or new_request_id())
    set_given(request, name=name, validate_only=validate_only)
    set_given(
        request.model,
        kind=_choice("model", model, MODELS),
        variance=_choice("variance", variance, VARIANCES),
        n_hidden=n_hidden,
        min_variance=min_variance,
    )
    set_given(
        request.optimizer,
        kind=_choice("optimizer", optimizer, OPTIMIZERS),
        lr=lr,
        momentum=momentum,
        method=_choice("method", method, METHODS),
        preconditioner=_choice("preconditioner", preconditioner, PRECONDITIONERS),
        weight_decay=weight_decay,
        max_spectral_norm=max_spectral_norm,
        rank=rank,
    )
    for parameter, kind in (per_parameter or {}).items():
        request.optimizer.per_parameter[parameter] = choose(
            f"per_parameter[{parameter}]", kind, OPTIMIZERS
        )
    for parameter, value in (per_parameter_lr or {}).items():
        request.optimizer.per_parameter_lr[str(parameter)] = float(value)
    set_given(request.optimizer, step_rule=_choice("step_rule", step_rule, STEP_RULES))
    _set_schedule(request.optimizer.schedule, schedule, warmup_steps)
    set_given(
        request.training,
        cd_k=cd_k,
        persistent=persistent,
        batch_size=batch_size,
        steps=steps,
        epochs=epochs,
        seed=seed,
        checkpoint_every=checkpoint_every,
        max_backoffs=max_backoffs,
        backoff_factor=backoff_factor,
    )
    if centering_sliding_factor is not None and not centered:
        raise InvalidArgument(
            "centering_sliding_factor: applies to centered training; pass centered=True too"
        )
    if centered:
        request.training.centering.SetInParent()  # on, the sliding factor left to the server
        set_given(request.training.centering, sliding_factor=centering_sliding_factor)
    if tempering is not None or tempering_min_beta is not None:
        request.training.parallel_tempering.SetInParent()  # on, even with every count default
        set_given(
            request.training.parallel_tempering,
            temperatures=tempering,
            min_beta=tempering_min_beta,
        )
    set_given(
        request.eval,
        every=eval_every,
        ais=ais,
        ais_chains=ais_chains,
        ais_betas=ais_betas,
        validation_fraction=validation_fraction,
    )
    _set_dataset(request.dataset, dataset, dataset_id, dataset_options)
    set_given(request.dataset, preprocess=_choice("preprocess", preprocess, PREPROCESSING))
    return request


def _set_schedule(
    message: rbm_pb2.StepSizeSchedule,
    schedule: str | Mapping[str, Any] | None,
    warmup_steps: int | None,
) -> None:
    """``schedule`` as text (:func:`parse_schedule`) or a mapping of StepSizeSchedule fields."""
    fields = dict(parse_schedule(schedule) if isinstance(schedule, str) else schedule or {})
    if warmup_steps is not None:
        fields["warmup_steps"] = warmup_steps
    if not fields:
        return
    kind = fields.pop("kind", None)
    unknown = sorted(set(fields) - set(message.DESCRIPTOR.fields_by_name))
    if unknown:
        raise InvalidArgument(f"schedule: unknown fields {unknown}")
    _check_unsigned(**{k: fields.get(k) for k in ("decay_steps", "horizon", "warmup_steps")})
    message.SetInParent()
    set_given(message, kind=_choice("schedule", kind, SCHEDULES), **fields)


def _choice(field: str, value: str | None, choices: Mapping[str, int]) -> int | None:
    return None if value is None else choose(field, value, choices)


def _set_dataset(
    ref: rbm_pb2.DatasetRef,
    dataset: str | None,
    dataset_id: str | None,
    options: Mapping[str, Any] | None,
) -> None:
    if dataset_id is not None:
        ref.dataset_id = dataset_id
    elif dataset is not None or options:
        if dataset is None:
            raise InvalidArgument("dataset_options: name the built-in dataset they are for")
        ref.builtin.name = dataset
        for key, value in (options or {}).items():
            ref.builtin.options[str(key)] = str(value)
