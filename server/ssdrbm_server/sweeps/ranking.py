"""Whether a sweep's runs report its rank metric (``check_reported``; the metrics and their
direction: ssdrbm_server/rank_metrics.py). ``reported_metrics`` asks the job spec for its
evaluations' log-likelihood method and ssdcore's ``Trainer.evaluate`` for what comes with it,
evaluating a 2×2 stand-in of the job's model, so the answer cannot drift from what runs send.
"""

from __future__ import annotations

import functools
import logging

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.errors import InvalidArgumentError
from ssdrbm_server.rank_metrics import HIGHER_IS_BETTER

logger = logging.getLogger(__name__)


def check_reported(metric: str, specs: list[pb.StartTrainingRequest], where: list[str]) -> None:
    """INVALID_ARGUMENT naming ``rank_metric`` when a run (``specs[i]``, described by
    ``where[i]``) would never report ``metric``: its runs would all end unranked."""
    for spec, place in zip(specs, where, strict=True):
        reported = reported_metrics(spec)
        if reported is not None and metric not in reported:
            hint = "" if spec.eval.ais else " (base.eval.ais adds the log-likelihood bounds)"
            raise InvalidArgumentError(
                "rank_metric",
                f"{metric} is never reported by the runs of this sweep ({place}): their model "
                f"reports {', '.join(sorted(reported))}; rank by one of those{hint}",
            )


def reported_metrics(spec: pb.StartTrainingRequest) -> frozenset[str] | None:
    """The rank metrics that a job with this resolved spec reports in its metric events (at
    its evaluations or at its checkpoints); None when the stand-in could not tell."""
    from ssdrbm_server.job_spec import log_likelihood_method  # torch: on first use

    # AIS runs at checkpoints only, when asked; the other evaluations use the plain method
    methods = {log_likelihood_method(spec, with_ais=ais) for ais in {False, spec.eval.ais}}
    stand_in = pb.ModelSpec()
    stand_in.CopyFrom(spec.model)
    stand_in.n_hidden = STAND_IN_UNITS  # the method above was decided with the job's own size
    try:
        names = [_evaluated(stand_in.SerializeToString(), method) for method in sorted(methods)]
    except Exception:  # a stand-in is no reason to refuse a sweep: it goes unchecked
        logger.exception("could not tell the metrics of model %s", spec.model)
        return None
    return frozenset().union(*names) & frozenset(HIGHER_IS_BETTER)


STAND_IN_UNITS = 2  # visible and hidden units of the stand-in model: what it reports, cheaply
STAND_IN_ROWS = 4


@functools.lru_cache(maxsize=64)
def _evaluated(model_spec: bytes, method: str) -> frozenset[str]:
    """The names ``Trainer.evaluate(method)`` reports for the stand-in model ``model_spec``
    (STAND_IN_UNITS hidden units), with validation rows (the resolver's split keeps some)."""
    import torch

    from ssdcore.models import model_from_config
    from ssdcore.training import Trainer
    from ssdrbm_server.job_spec import model_config

    stand_in = pb.StartTrainingRequest(model=pb.ModelSpec.FromString(model_spec))
    model = model_from_config(model_config(stand_in, STAND_IN_UNITS))
    rows = torch.zeros(STAND_IN_ROWS, STAND_IN_UNITS)
    trainer = Trainer(model, rows, batch_size=STAND_IN_ROWS, valid_data=rows)
    return frozenset(trainer.evaluate(method, ais_chains=2, ais_betas=2))
