"""From a job's spec (a serialized ssdrbm.v1.StartTrainingRequest) to what training needs.

The servicer has validated the spec and filled in its defaults; zeros that still mean "server
default" are resolved here with `PlanDefaults`, so a spec written by an older client trains too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssdrbm.v1 import rbm_pb2

from ssdcore.optim import OptimizerConfig
from ssdcore.training import steps_per_epoch
from ssdrbm_server.worker.defaults import PlanDefaults

OPTIMIZER_NAMES = {
    rbm_pb2.OPTIMIZER_KIND_UNSPECIFIED: "ssd",
    rbm_pb2.OPTIMIZER_KIND_SGD: "sgd",
    rbm_pb2.OPTIMIZER_KIND_NESTEROV: "nesterov",
    rbm_pb2.OPTIMIZER_KIND_SSD: "ssd",
    rbm_pb2.OPTIMIZER_KIND_SSD_PRECONDITIONED: "ssd-preconditioned",
}
POLAR_METHODS = {
    # "auto" is resolved by ssdcore on the worker's device: on the CPU lowrank for SSD and svd
    # where lowrank cannot serve (preconditioned SSD); on CUDA newton-schulz.
    rbm_pb2.POLAR_METHOD_UNSPECIFIED: "auto",
    rbm_pb2.POLAR_METHOD_SVD: "svd",
    rbm_pb2.POLAR_METHOD_LOWRANK: "lowrank",
    rbm_pb2.POLAR_METHOD_RANDOMIZED: "randomized",
    rbm_pb2.POLAR_METHOD_NEWTON_SCHULZ: "newton-schulz",
}
PRECONDITIONERS = {
    rbm_pb2.PRECONDITIONER_UNSPECIFIED: "rmsprop",
    rbm_pb2.PRECONDITIONER_RMSPROP: "rmsprop",
    rbm_pb2.PRECONDITIONER_ADAM: "adam",
}
VARIANCES = {
    rbm_pb2.VARIANCE_KIND_UNSPECIFIED: "diagonal",
    rbm_pb2.VARIANCE_KIND_IDENTITY: "identity",
    rbm_pb2.VARIANCE_KIND_ISOTROPIC: "isotropic",
    rbm_pb2.VARIANCE_KIND_DIAGONAL: "diagonal",
    rbm_pb2.VARIANCE_KIND_FULL: "full",
}


@dataclass(frozen=True)
class TrainingPlan:
    """Everything the training child needs from a spec, with defaults resolved."""

    model_kind: str  # "bernoulli" | "gaussian"
    variance: str  # Gaussian only
    min_variance: float  # Gaussian only; 0 = the model's default floor
    n_hidden: int
    optimizer: OptimizerConfig
    batch_size: int
    cd_k: int
    persistent: bool
    seed: int
    steps: int  # 0 when the spec gives epochs
    epochs: int
    checkpoint_every: int
    eval_every: int
    ais: bool
    ais_chains: int
    ais_betas: int
    validation_fraction: float

    def total_steps(self, n_train: int) -> int:
        """Steps to train: as given, or epochs over `n_train` examples in whole batches (the
        trainer drops an epoch's last partial batch)."""
        if self.steps > 0:
            return self.steps
        return self.epochs * steps_per_epoch(n_train, self.batch_size)

    def model_config(self, n_visible: int) -> dict[str, object]:
        """The model's config as `ssdcore.model_from_config` takes it."""
        config: dict[str, object] = {
            "type": self.model_kind,
            "n_visible": n_visible,
            "n_hidden": self.n_hidden,
        }
        if self.model_kind == "gaussian":
            config["variance"] = self.variance
            if self.min_variance > 0:
                config["min_variance"] = self.min_variance
        return config


def optimizer_config(spec: rbm_pb2.OptimizerSpec) -> OptimizerConfig:
    """The ssdcore optimizer configuration of an OptimizerSpec (ValueError if invalid)."""
    return OptimizerConfig(
        name=OPTIMIZER_NAMES[spec.kind],
        lr=spec.lr,
        # Zero means "the optimizer's default": 0 for SGD, 0.9 for Nesterov.
        momentum=spec.momentum or None,
        method=POLAR_METHODS[spec.method],
        preconditioner=PRECONDITIONERS[spec.preconditioner],
        weight_decay=spec.weight_decay,
        max_spectral_norm=spec.max_spectral_norm or None,
        rank=spec.rank,
        per_parameter={name: OPTIMIZER_NAMES[kind] for name, kind in spec.per_parameter.items()},
        per_parameter_lr=dict(spec.per_parameter_lr),
    )


def plan_from_request(
    request: rbm_pb2.StartTrainingRequest, defaults: PlanDefaults | None = None
) -> TrainingPlan:
    """Resolve a validated StartTrainingRequest into a TrainingPlan."""
    defaults = defaults or PlanDefaults()
    training, evaluation = request.training, request.eval
    gaussian = request.model.kind == rbm_pb2.MODEL_KIND_GAUSSIAN
    return TrainingPlan(
        model_kind="gaussian" if gaussian else "bernoulli",
        variance=VARIANCES[request.model.variance],
        min_variance=request.model.min_variance,
        n_hidden=request.model.n_hidden,
        optimizer=optimizer_config(request.optimizer),
        batch_size=training.batch_size or defaults.batch_size,
        cd_k=training.cd_k if training.HasField("cd_k") else 1,
        persistent=training.persistent,
        seed=training.seed,
        steps=training.steps,
        epochs=training.epochs,
        checkpoint_every=training.checkpoint_every or defaults.checkpoint_every,
        eval_every=evaluation.every or defaults.eval_every,
        ais=evaluation.ais,
        ais_chains=evaluation.ais_chains or defaults.ais_chains,
        ais_betas=evaluation.ais_betas or defaults.ais_betas,
        validation_fraction=evaluation.validation_fraction or defaults.validation_fraction,
    )
