"""Successive halving (ASHA): a sweep's rung schedule, stored with its record. Rungs are steps
(``early_stopping.rungs``, or min_steps · eta^k below the runs' total steps); the decision at a
rung is store/rungs.py's (``RungGate``), asked by the worker when a run reports its metrics.
Each rung step is evaluated: the runs' ``eval.every`` divides every rung (the gcd of the
server's default and the rungs when the base request leaves it unset; else it must divide them).
"""

from __future__ import annotations

import itertools
import math

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.errors import InvalidArgumentError
from ssdrbm_server.request_bounds import MAX_RUNGS

DEFAULT_REDUCTION_FACTOR = 3
MAX_REDUCTION_FACTOR = 100


def resolve_rungs(early: pb.EarlyStopping, total_steps: int) -> tuple[list[int], int]:
    """(rung steps, eta); ([], 0) when early stopping is off."""
    if not early.rungs and not early.min_steps:
        if early.reduction_factor:
            raise InvalidArgumentError(
                "early_stopping.reduction_factor", "set rungs or min_steps to stop early"
            )
        return [], 0
    eta = early.reduction_factor or DEFAULT_REDUCTION_FACTOR
    if not 2 <= eta <= MAX_REDUCTION_FACTOR:
        raise InvalidArgumentError(
            "early_stopping.reduction_factor",
            f"must be between 2 and {MAX_REDUCTION_FACTOR} (0 = {DEFAULT_REDUCTION_FACTOR})",
        )
    if early.rungs and early.min_steps:
        raise InvalidArgumentError("early_stopping.min_steps", "give rungs or min_steps, not both")
    if early.rungs:
        rungs = list(early.rungs)
        if any(b <= a for a, b in itertools.pairwise(rungs)) or rungs[0] < 1:
            raise InvalidArgumentError(
                "early_stopping.rungs", f"must be increasing steps >= 1, got {rungs}"
            )
        if rungs[-1] >= total_steps:
            raise InvalidArgumentError(
                "early_stopping.rungs",
                f"every rung must be below the runs' {total_steps} steps, got {rungs[-1]}",
            )
    else:
        if not 1 <= early.min_steps < total_steps:
            raise InvalidArgumentError(
                "early_stopping.min_steps",
                f"must be between 1 and the runs' {total_steps} steps, got {early.min_steps}",
            )
        rungs, step = [], early.min_steps
        while step < total_steps:
            rungs.append(step)
            step *= eta
    if len(rungs) > MAX_RUNGS:
        raise InvalidArgumentError("early_stopping.rungs", f"at most {MAX_RUNGS} rungs")
    return rungs, eta


def eval_every_for(requested: int, default: int, rungs: list[int]) -> int:
    """The runs' eval.every: one that divides every rung, so each rung step is evaluated."""
    if not rungs:
        return requested
    if requested == 0:
        return math.gcd(default, *rungs)
    bad = [rung for rung in rungs if rung % requested]
    if bad:
        raise InvalidArgumentError(
            "base.eval.every",
            f"{requested} does not divide the rung steps {bad}; the runs are evaluated every "
            "eval.every steps and must be at each rung — leave it unset (the sweep picks a "
            "divisor) or choose a divisor of every rung",
        )
    return requested
