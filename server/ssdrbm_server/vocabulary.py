"""The proto's enum values in ssdcore's words ("gaussian", "newton-schulz", ...).

The words are the SDK's rendering of the values (``ssdrbm.spec.short_name``: the value's name
without its enum's prefix, lower-case, dash-separated), which are ssdcore's names by design, so
the service, the SDK and the CLI read and show them from one table. A resolved spec
(ssdrbm_server/resolver.py) never holds an UNSPECIFIED value where a choice applies, so these
maps have no entry for it: a lookup of one is a bug, not a default.
"""

from __future__ import annotations

from collections.abc import Mapping

from ssdrbm.spec import (
    METHODS,
    MODELS,
    OPTIMIZERS,
    PRECONDITIONERS,
    PREPROCESSING,
    SCHEDULES,
    STEP_RULES,
    VARIANCES,
)
from ssdrbm.v1 import rbm_pb2 as pb


def _by_number(by_name: Mapping[str, int]) -> dict[int, str]:
    return {number: name for name, number in by_name.items()}


MODEL_NAMES = _by_number(MODELS)
VARIANCE_NAMES = _by_number(VARIANCES)
OPTIMIZER_NAMES = _by_number(OPTIMIZERS)
POLAR_METHOD_NAMES = _by_number(METHODS)
PRECONDITIONER_NAMES = _by_number(PRECONDITIONERS)
PREPROCESS_NAMES = _by_number(PREPROCESSING)
STEP_RULE_NAMES = _by_number(STEP_RULES)
SCHEDULE_KIND_NAMES = _by_number(SCHEDULES)
SSD_KINDS = frozenset({pb.OPTIMIZER_KIND_SSD, pb.OPTIMIZER_KIND_SSD_PRECONDITIONED})
