"""Rank metrics: which Metrics fields can rank a sweep's runs, and which direction is better.

The one place a metric's direction is defined: the leaderboard (sweeps/service.py) and the ASHA
decision at a rung (store/rungs.py, asked by the worker) both compare ``signed_value``s, lower
is better. Which metrics a sweep's runs report is sweeps/ranking.py's question.
"""

from __future__ import annotations

import math

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.errors import InvalidArgumentError

DEFAULT_RANK_METRIC = "reconstruction_error"
# metric -> True when higher is better
HIGHER_IS_BETTER = {
    "reconstruction_error": False,
    "free_energy_gap": False,
    "log_likelihood": True,
    "log_likelihood_lower": True,  # the conservative bound, where AIS ran (eval.ais)
    "pseudo_log_likelihood": True,
}


def resolve_rank_metric(name: str) -> str:
    """The rank metric a request names ("" = the default); INVALID_ARGUMENT otherwise."""
    if not name:
        return DEFAULT_RANK_METRIC
    if name not in HIGHER_IS_BETTER:
        raise InvalidArgumentError(
            "rank_metric", f"unknown metric {name!r}; choose one of {sorted(HIGHER_IS_BETTER)}"
        )
    return name


def metric_value(metrics: pb.Metrics, name: str) -> float | None:
    """The metric's value in ``metrics``; None where it was not computed (or is not finite)."""
    if name != "reconstruction_error" and not metrics.HasField(name):
        return None
    value = float(getattr(metrics, name))
    return value if math.isfinite(value) else None


def signed_value(value: float, name: str) -> float:
    """The value turned so that lower is better, for every metric."""
    return -value if HIGHER_IS_BETTER[name] else value
