"""The proto's enum values in ssdcore's words ("gaussian", "newton-schulz", ...).

A resolved spec (ssdrbm_server/resolver.py) never holds an UNSPECIFIED value where a choice
applies, so these maps have no entry for it: a lookup of one is a bug, not a default.
"""

from __future__ import annotations

from ssdrbm.v1 import rbm_pb2 as pb

MODEL_NAMES = {pb.MODEL_KIND_BERNOULLI: "bernoulli", pb.MODEL_KIND_GAUSSIAN: "gaussian"}
VARIANCE_NAMES = {
    pb.VARIANCE_KIND_IDENTITY: "identity",
    pb.VARIANCE_KIND_ISOTROPIC: "isotropic",
    pb.VARIANCE_KIND_DIAGONAL: "diagonal",
    pb.VARIANCE_KIND_FULL: "full",
}
OPTIMIZER_NAMES = {
    pb.OPTIMIZER_KIND_SGD: "sgd",
    pb.OPTIMIZER_KIND_NESTEROV: "nesterov",
    pb.OPTIMIZER_KIND_SSD: "ssd",
    pb.OPTIMIZER_KIND_SSD_PRECONDITIONED: "ssd-preconditioned",
}
POLAR_METHOD_NAMES = {
    pb.POLAR_METHOD_AUTO: "auto",
    pb.POLAR_METHOD_SVD: "svd",
    pb.POLAR_METHOD_LOWRANK: "lowrank",
    pb.POLAR_METHOD_RANDOMIZED: "randomized",
    pb.POLAR_METHOD_NEWTON_SCHULZ: "newton-schulz",
}
POLAR_METHODS_BY_NAME = {name: value for value, name in POLAR_METHOD_NAMES.items()}
PRECONDITIONER_NAMES = {pb.PRECONDITIONER_RMSPROP: "rmsprop", pb.PRECONDITIONER_ADAM: "adam"}
PREPROCESS_NAMES = {
    pb.PREPROCESS_NONE: "none",
    pb.PREPROCESS_BINARIZE: "binarize",
    pb.PREPROCESS_SCALE: "scale",
    pb.PREPROCESS_STANDARDIZE: "standardize",
}
STEP_RULE_NAMES = {pb.STEP_RULE_PAPER: "paper", pb.STEP_RULE_NORMALIZED: "normalized"}
SCHEDULE_KIND_NAMES = {
    pb.SCHEDULE_KIND_CONSTANT: "constant",
    pb.SCHEDULE_KIND_EXPONENTIAL: "exponential",
    pb.SCHEDULE_KIND_INVERSE_TIME: "inverse-time",
    pb.SCHEDULE_KIND_COSINE: "cosine",
}
MODELS_BY_NAME = {name: value for value, name in MODEL_NAMES.items()}
VARIANCES_BY_NAME = {name: value for value, name in VARIANCE_NAMES.items()}
OPTIMIZERS_BY_NAME = {name: value for value, name in OPTIMIZER_NAMES.items()}
SSD_KINDS = frozenset({pb.OPTIMIZER_KIND_SSD, pb.OPTIMIZER_KIND_SSD_PRECONDITIONED})
