"""Build a ``StartTrainingRequest`` from plain keyword arguments with sensible defaults.

Enum-valued options are given by their lower-case names ("gaussian", "newton-schulz", ...); an
unknown name raises :class:`~ssdrbm.errors.InvalidArgument` naming the field and the choices, before
anything is sent. Numeric ranges are checked by the service, which names the field in its answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from ssdrbm.errors import InvalidArgument
from ssdrbm.v1 import rbm_pb2

DEFAULT_STEPS = 1000


def enum_choices(enum_type: Any, prefix: str) -> dict[str, int]:
    """Lower-case, dash-separated names of a proto enum's values (UNSPECIFIED left out)."""
    choices = {}
    for name, number in enum_type.items():
        short = name.removeprefix(prefix)
        if short != "UNSPECIFIED":
            choices[short.lower().replace("_", "-")] = number
    return choices


MODELS = enum_choices(rbm_pb2.ModelKind, "MODEL_KIND_")
VARIANCES = enum_choices(rbm_pb2.VarianceKind, "VARIANCE_KIND_")
OPTIMIZERS = enum_choices(rbm_pb2.OptimizerKind, "OPTIMIZER_KIND_")
METHODS = enum_choices(rbm_pb2.PolarMethod, "POLAR_METHOD_")
PRECONDITIONERS = enum_choices(rbm_pb2.Preconditioner, "PRECONDITIONER_")
PREPROCESSING = enum_choices(rbm_pb2.Preprocess, "PREPROCESS_")


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


def new_request_id() -> str:
    """A fresh idempotency key, so that a retried StartTraining never creates a second job."""
    return uuid.uuid4().hex


def _check_unsigned(**values: Any) -> None:
    """Refuse negative or non-integer counts here: protobuf's own error would not name the field."""
    for field, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{field}: must be a non-negative integer, got {value!r}")


def training_request(
    *,
    model: str = "bernoulli",
    variance: str | None = None,
    min_variance: float = 0.0,
    n_hidden: int = 64,
    optimizer: str = "ssd",
    method: str | None = "lowrank",
    preconditioner: str | None = None,
    lr: float = 0.01,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    max_spectral_norm: float = 0.0,
    rank: int = 0,
    per_parameter: Mapping[str, str] | None = None,
    per_parameter_lr: Mapping[str, float] | None = None,
    cd_k: int | None = None,
    persistent: bool = False,
    batch_size: int = 100,
    steps: int | None = None,
    epochs: int | None = None,
    seed: int = 0,
    checkpoint_every: int = 0,
    eval_every: int = 0,
    ais: bool = False,
    ais_chains: int = 0,
    ais_betas: int = 0,
    validation_fraction: float = 0.0,
    dataset: str = "synthetic",
    dataset_id: str | None = None,
    dataset_options: Mapping[str, Any] | None = None,
    preprocess: str | None = None,
    request_id: str | None = None,
    name: str = "",
) -> rbm_pb2.StartTrainingRequest:
    """The request for :meth:`ssdrbm.Client.start_training`; see that method for the arguments.

    Zeros mean "server default" as in the proto. With neither ``steps`` nor ``epochs`` the job runs
    ``DEFAULT_STEPS`` steps. A missing ``request_id`` is generated, which makes retries safe.
    """
    _check_unsigned(
        n_hidden=n_hidden,
        rank=rank,
        cd_k=1 if cd_k is None else cd_k,
        batch_size=batch_size,
        steps=steps or 0,
        epochs=epochs or 0,
        seed=seed,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        ais_chains=ais_chains,
        ais_betas=ais_betas,
    )
    if steps is not None and epochs is not None:
        raise InvalidArgument("steps, epochs: give one of them, not both")
    if steps is None and epochs is None:
        steps = DEFAULT_STEPS
    per_parameter_kinds = {
        parameter: choose(f"per_parameter[{parameter}]", kind, OPTIMIZERS)
        for parameter, kind in (per_parameter or {}).items()
    }
    if dataset_id:
        dataset_ref = rbm_pb2.DatasetRef(dataset_id=dataset_id)
    else:
        options = {str(key): str(value) for key, value in (dataset_options or {}).items()}
        dataset_ref = rbm_pb2.DatasetRef(
            builtin=rbm_pb2.BuiltinDataset(name=dataset, options=options)
        )
    dataset_ref.preprocess = choose("preprocess", preprocess, PREPROCESSING)
    return rbm_pb2.StartTrainingRequest(
        model=rbm_pb2.ModelSpec(
            kind=choose("model", model, MODELS),
            variance=choose("variance", variance, VARIANCES),
            n_hidden=n_hidden,
            min_variance=min_variance,
        ),
        optimizer=rbm_pb2.OptimizerSpec(
            kind=choose("optimizer", optimizer, OPTIMIZERS),
            lr=lr,
            momentum=momentum,
            method=choose("method", method, METHODS),
            preconditioner=choose("preconditioner", preconditioner, PRECONDITIONERS),
            weight_decay=weight_decay,
            max_spectral_norm=max_spectral_norm,
            rank=rank,
            per_parameter=per_parameter_kinds,
            per_parameter_lr={str(k): float(v) for k, v in (per_parameter_lr or {}).items()},
        ),
        training=rbm_pb2.TrainingSpec(
            cd_k=cd_k,  # None leaves it unset: the server's default of 1
            persistent=persistent,
            batch_size=batch_size,
            steps=steps or 0,
            epochs=epochs or 0,
            seed=seed,
            checkpoint_every=checkpoint_every,
        ),
        eval=rbm_pb2.EvalSpec(
            every=eval_every,
            ais=ais,
            ais_chains=ais_chains,
            ais_betas=ais_betas,
            validation_fraction=validation_fraction,
        ),
        dataset=dataset_ref,
        request_id=request_id or new_request_id(),
        name=name,
    )
