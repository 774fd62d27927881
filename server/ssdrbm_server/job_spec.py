"""A job's resolved spec in ssdcore's terms: what the job trains and how it is evaluated.

``resolver.py`` produces the spec once, in StartTraining; the resolver itself, the pack key, the
sweeps and the worker's training process all read it here, the same way. No defaults live here:
the spec is read as stored, and only when this version's resolver stamped it (``SPEC_VERSION``).
The SSD polar method may be AUTO, which ssdcore resolves for the device the model is on.
"""

from __future__ import annotations

from ssdrbm.v1 import rbm_pb2 as pb

from ssdcore.centering import CenteringConfig
from ssdcore.optim import OptimizerConfig
from ssdcore.schedules import Schedule
from ssdcore.tempering import TemperingConfig
from ssdrbm_server.vocabulary import (
    MODEL_NAMES,
    OPTIMIZER_NAMES,
    POLAR_METHOD_NAMES,
    PRECONDITIONER_NAMES,
    SCHEDULE_KIND_NAMES,
    STEP_RULE_NAMES,
    VARIANCE_NAMES,
)

EXACT_LL_MAX_HIDDEN = 16  # 2^16 hidden states: exact log Z is cheap enough for every event

# The version of the resolved spec's format: the resolver stamps every spec it produces with it
# (StartTrainingRequest.spec_version) and the worker runs only specs of this version. Raise it
# whenever the resolver starts filling a field, stops filling one, or changes what a filled
# value means: a spec stored by the other version would be read wrongly. (tests/test_resolver.py
# lists the fields filled at this version and fails when they change without it.)
SPEC_VERSION = 1


class UnresolvedSpecError(ValueError):
    """The stored spec was not resolved by this version's resolver: it is not guessed at."""


def check_resolved(spec: pb.StartTrainingRequest) -> None:
    """Refuse a spec this version's resolver did not produce (e.g. one stored by an older or
    newer server, whose fields may be filled differently)."""
    if spec.spec_version != SPEC_VERSION:
        raise UnresolvedSpecError(
            f"the job's stored spec has spec_version {spec.spec_version}, but this server "
            f"reads version {SPEC_VERSION}: it was not resolved by this server version; submit "
            "the job again"
        )


def model_config(spec: pb.StartTrainingRequest, n_visible: int) -> dict[str, object]:
    """The model's config as ``ssdcore.model_from_config`` takes it."""
    model = spec.model
    config: dict[str, object] = {
        "type": MODEL_NAMES[model.kind],
        "n_visible": n_visible,
        "n_hidden": model.n_hidden,
    }
    if model.kind == pb.MODEL_KIND_GAUSSIAN:
        config["variance"] = VARIANCE_NAMES[model.variance]
        config["min_variance"] = model.min_variance
    return config


def optimizer_config(spec: pb.OptimizerSpec) -> OptimizerConfig:
    """The ssdcore optimizer configuration of a resolved OptimizerSpec."""
    choices: dict[str, object] = {}
    # Unset only where no parameter takes that kind of step, so never read there.
    if spec.method:
        choices["method"] = POLAR_METHOD_NAMES[spec.method]
    if spec.preconditioner:
        choices["preconditioner"] = PRECONDITIONER_NAMES[spec.preconditioner]
    if spec.step_rule:
        choices["step_rule"] = STEP_RULE_NAMES[spec.step_rule]
    return OptimizerConfig(
        name=OPTIMIZER_NAMES[spec.kind],
        lr=spec.lr,
        momentum=spec.momentum,
        weight_decay=spec.weight_decay,
        max_spectral_norm=spec.max_spectral_norm or None,
        rank=spec.rank,
        per_parameter={name: OPTIMIZER_NAMES[kind] for name, kind in spec.per_parameter.items()},
        per_parameter_lr=dict(spec.per_parameter_lr),
        schedule=schedule_config(spec.schedule),
        **choices,
    )


def schedule_config(spec: pb.StepSizeSchedule) -> Schedule:
    """The ssdcore schedule of a StepSizeSchedule whose kind and decay parameters are set
    (ValueError names the invalid field as ``Schedule.<field>``)."""
    return Schedule(
        kind=SCHEDULE_KIND_NAMES[spec.kind],
        decay_rate=spec.decay_rate,
        decay_steps=spec.decay_steps,
        floor=spec.floor,
        horizon=spec.horizon,
        warmup_steps=spec.warmup_steps,
    )


def centering_config(training: pb.TrainingSpec) -> CenteringConfig | None:
    """A resolved job's centered training (its sliding factor), or None when uncentered."""
    if not training.HasField("centering"):
        return None
    return CenteringConfig(sliding_factor=training.centering.sliding_factor)


def tempering_config(training: pb.TrainingSpec) -> TemperingConfig | None:
    """The ladder of a resolved job's parallel tempering (a geometric one), or None without."""
    if not training.HasField("parallel_tempering"):
        return None
    tempering = training.parallel_tempering
    return TemperingConfig(n_temperatures=tempering.temperatures, min_beta=tempering.min_beta)


def log_likelihood_method(spec: pb.StartTrainingRequest, *, with_ais: bool) -> str:
    """How a job's evaluation estimates the log-likelihood: AIS when asked (at checkpoints),
    else exactly for small hidden layers, else not at all."""
    if with_ais:
        return "ais"
    if spec.model.n_hidden <= EXACT_LL_MAX_HIDDEN:
        return "exact"
    return "none"
