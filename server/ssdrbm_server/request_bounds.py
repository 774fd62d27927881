"""Bound before you expand: what a request will cost, from its own numbers, checked before
anything is allocated or iterated (the one owner of the rule).

A sweep's points, the length of each repeated field and map, counts such as cd_k or AIS chains
and, with the dataset's width, a job's model bytes, checkpoint bytes and FLOPs per step and per
evaluation are computed by arithmetic alone and compared with their limits before the request is
walked, so a refused request costs nothing but reading those numbers. Every refusal names the
field: a limit of the API itself (``MAX_CD_K``, ``MAX_AXES``, ...) is INVALID_ARGUMENT
(``<field>: must be at most <limit>, got <value>``), a limit this server sets (a ``Settings``
field) is RESOURCE_EXHAUSTED (``<field>: <value> is over this server's limit of <limit>
(SSDRBM_<SETTING>); <fix>``). Serving inputs are bounded by ``tensors.check_batch_shape`` and
``serving.ModelServer``, both before computing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized

from ssdrbm.v1 import rbm_pb2 as pb

from ssdrbm_server.config import Settings
from ssdrbm_server.errors import InvalidArgumentError, ResourceExhaustedError
from ssdrbm_server.request_checks import check_text

# Limits of the API: the same on every server.
MAX_HIDDEN = 1 << 16
MAX_BATCH_SIZE = 1 << 16
MAX_CD_K = 10_000
MAX_AIS_CHAINS = 100_000
MAX_AIS_BETAS = 1_000_000
MAX_BACKOFFS = 100
# Every seed (training, serving). The trainer seeds its estimator with seed + an offset, and
# torch takes seeds below 2^64, so seeds from 2^64 - 0x5EED fail in the training process
# (measured: "Overflow when unpacking long long"). The contract is the signed 64-bit range:
# every client language can hold it, and it stays valid if the offset changes.
MAX_SEED = 2**63 - 1
# Rung steps of a sweep's early stopping: each is a sorted set and a decision per run.
MAX_RUNGS = 64
# Axes of one sweep: one per field (sweeps/axes.py), and a model has a handful of parameters
# for optimizer.per_parameter_lr.<name>; 16 leaves room for both.
MAX_AXES = 16

# The trainer state holds the parameters and up to three buffers of their size (momentum or the
# preconditioner's two moments, the last finite parameters kept for a blow-up's restore).
TRAINER_STATE_COPIES = 4
MIB = 1024 * 1024


# A refusal quotes at most this much of a request's own text (a name, a key): the message
# travels in a trailer that gRPC clients refuse beyond 8 KiB (errors.MAX_STATUS_BYTES).
QUOTED_CHARS = 256


def quoted(text: str) -> str:
    """``text`` as a message quotes it (``repr``), cut to QUOTED_CHARS characters."""
    if len(text) <= QUOTED_CHARS:
        return repr(text)
    return f"{text[:QUOTED_CHARS]!r}… ({len(text)} characters)"


# --- the two kinds of refusal --------------------------------------------------------------------


def at_most(field: str, value: int, limit: int) -> None:
    """INVALID_ARGUMENT naming ``field`` when ``value`` is over a limit of the API."""
    if value > limit:
        raise InvalidArgumentError(field, f"must be at most {limit}, got {value}")


def items_at_most(field: str, items: Sized, limit: int, what: str) -> None:
    """INVALID_ARGUMENT naming ``field`` when a repeated field or map holds more than ``limit``
    entries; ``what`` says why there can be no more (``"one per field"``)."""
    if len(items) > limit:
        raise InvalidArgumentError(
            field, f"has {len(items)} entries; at most {limit} are allowed ({what})"
        )


def over_limit(
    subject: str, value: str, limit: str, setting: str, fix: str
) -> ResourceExhaustedError:
    """The RESOURCE_EXHAUSTED of a server limit: ``subject`` (the field, or what the fields
    make) and its ``value`` over ``limit``, the ``Settings`` field ``setting`` and the fix."""
    return ResourceExhaustedError(
        f"{subject}: {value} is over this server's limit of {limit} (SSDRBM_{setting.upper()}); "
        f"{fix}",
        limit=setting,
    )


# --- sweeps --------------------------------------------------------------------------------------


def sweep_points(request: pb.StartSweepRequest) -> tuple[int, list[tuple[str, int]]]:
    """(points, the factors that make them) of a sweep, by arithmetic: RANDOM mode's
    ``samples``; a grid's product of its axes' lengths and ``seeds``. An axis without values
    (a range) counts 0: check_axes refuses it in a grid."""
    if request.mode == pb.SWEEP_MODE_RANDOM:
        return request.samples, [("samples", request.samples)]
    factors = [
        (f"axes[{index}].{'kinds' if axis.kinds else 'values'}", len(axis.values) + len(axis.kinds))
        for index, axis in enumerate(request.axes)
    ]
    if request.seeds:
        factors.append(("seeds", request.seeds))
    return math.prod(count for _, count in factors), factors


def check_sweep(request: pb.StartSweepRequest, settings: Settings) -> int:
    """The sweep's number of points, after every size in the request is checked: the axes and
    each one's values, the seeds, the rungs, the texts that messages quote, and the points
    against SSDRBM_MAX_SWEEP_POINTS (which also bounds any one axis: in a grid it is a factor
    of the points, and a random draw uses at most that many values)."""
    limit = settings.max_sweep_points
    items_at_most("axes", request.axes, MAX_AXES, "one axis per field")
    for index, axis in enumerate(request.axes):
        check_text(axis.field, f"axes[{index}].field", settings.max_string_length)
        for name in ("values", "kinds"):
            _fits_points(f"axes[{index}].{name}", len(getattr(axis, name)), "values", limit)
    _fits_points("seeds", request.seeds, "seeds", limit)
    items_at_most("early_stopping.rungs", request.early_stopping.rungs, MAX_RUNGS, "rung steps")
    check_text(request.rank_metric, "rank_metric", settings.max_string_length)
    points, factors = sweep_points(request)
    if points > limit:
        names = " × ".join(name for name, _ in factors)
        counts = " × ".join(str(count) for _, count in factors)
        value = f"{points} points" if len(factors) == 1 else f"{counts} = {points} points"
        raise over_limit(
            names, value, str(limit), "max_sweep_points", "use fewer values, seeds or samples"
        )
    return points


def _fits_points(field: str, count: int, what: str, limit: int) -> None:
    if count > limit:
        raise over_limit(
            field,
            f"{count} {what}",
            f"{limit} points per sweep",
            "max_sweep_points",
            f"give at most {limit} {what}",
        )


# --- uploads -------------------------------------------------------------------------------------

# (n_examples, n_features) or (n_examples, height, width)
DATASET_DIMENSIONS = (2, 3)


def check_dataset_shape(shape: Sequence[int], itemsize: int, settings: Settings) -> int:
    """The bytes an upload's ``header.shape`` describes, after checking it: its number of
    dimensions before any is read or quoted, each dimension >= 1, then the size against
    SSDRBM_MAX_DATASET_BYTES."""
    if len(shape) not in DATASET_DIMENSIONS:
        raise InvalidArgumentError(
            "header.shape",
            f"has {len(shape)} dimensions; give (n_examples, n_features) or "
            "(n_examples, height, width)",
        )
    if any(dim < 1 for dim in shape):
        raise InvalidArgumentError(
            "header.shape", f"every dimension must be >= 1, got {list(shape)}"
        )
    size = math.prod(shape) * itemsize
    if size > settings.max_dataset_bytes:
        dims = " × ".join(str(dim) for dim in shape)
        raise over_limit(
            "header.shape",
            f"{dims} × {itemsize} bytes = {size} bytes",
            f"{settings.max_dataset_bytes} bytes per dataset",
            "max_dataset_bytes",
            "upload a smaller subset",
        )
    return size


# --- a job's cost on its data --------------------------------------------------------------------


def check_budgets(spec: pb.StartTrainingRequest, n_visible: int, settings: Settings) -> None:
    """Refuse a job whose size or cost exceeds this server's budgets, before anything is
    allocated; each is RESOURCE_EXHAUSTED naming the limit, the computed value and the fix."""
    model, training = spec.model, spec.training
    n_hidden = model.n_hidden
    if n_visible > settings.max_visibles:
        raise over_limit(
            "dataset width",
            f"{n_visible} visible units",
            f"{settings.max_visibles}",
            "max_visibles",
            "reduce the data's dimension (crop, downsample, PCA) before uploading",
        )
    params = model_bytes(model, n_visible)
    if params > settings.max_model_bytes:
        raise over_limit(
            "model size",
            f"{params / MIB:.1f} MiB for {n_visible}×{n_hidden}",
            f"{settings.max_model_bytes / MIB:.1f} MiB",
            "max_model_bytes",
            "lower model.n_hidden",
        )
    state = checkpoint_bytes(model, n_visible, training)
    if state > settings.max_value_bytes:
        raise over_limit(
            "checkpoint size",
            f"about {state / MIB:.1f} MiB of trainer state (model, optimizer buffers, chains)",
            f"{settings.max_value_bytes / MIB:.1f} MiB, the store's largest value",
            "max_value_bytes",
            "lower model.n_hidden (or training.batch_size for PCD)",
        )
    sweeps = training.cd_k * temperatures(training)  # every temperature sweeps cd_k times
    flops = step_flops(n_visible, n_hidden, training.batch_size, sweeps)
    if flops > settings.max_step_flops:
        raise over_limit(
            "training step cost",
            f"about {flops:.3g} FLOPs per step (2·B·V·H·(2·cd_k·T+2) with "
            f"B={training.batch_size}, V={n_visible}, H={n_hidden}, cd_k={training.cd_k}, "
            f"T={sweeps // training.cd_k} temperatures)",
            f"{settings.max_step_flops:.3g}",
            "max_step_flops",
            "lower training.cd_k, training.batch_size, model.n_hidden or the temperatures",
        )
    if spec.eval.ais:
        cost = eval_flops(n_visible, n_hidden, spec.eval.ais_chains, spec.eval.ais_betas)
        if cost > settings.max_eval_flops:
            raise over_limit(
                "AIS evaluation cost",
                f"about {cost:.3g} FLOPs per evaluation (2·chains·betas·V·H with chains="
                f"{spec.eval.ais_chains}, betas={spec.eval.ais_betas})",
                f"{settings.max_eval_flops:.3g}",
                "max_eval_flops",
                "lower eval.ais_chains or eval.ais_betas, or turn eval.ais off",
            )


def temperatures(training: pb.TrainingSpec) -> int:
    """Chain sets a resolved job runs: its ladder's length with parallel tempering, else 1."""
    return training.parallel_tempering.temperatures or 1


def model_bytes(model: pb.ModelSpec, n_visible: int) -> int:
    """float32 bytes of the model's parameters: W, both biases and any variance parameters."""
    count = n_visible * model.n_hidden + n_visible + model.n_hidden
    if model.kind == pb.MODEL_KIND_GAUSSIAN:
        count += {
            pb.VARIANCE_KIND_ISOTROPIC: 1,
            pb.VARIANCE_KIND_DIAGONAL: n_visible,
            pb.VARIANCE_KIND_FULL: n_visible * n_visible,
        }.get(model.variance, 0)
    return 4 * count


def checkpoint_bytes(model: pb.ModelSpec, n_visible: int, training: pb.TrainingSpec) -> int:
    """The trainer state's size, the largest value a checkpoint writes (an estimate that errs
    high): the parameters and their buffers, and the PCD chains (B, V) and (B, H)."""
    chains = 4 * training.batch_size * (n_visible + model.n_hidden) if training.persistent else 0
    chains *= temperatures(training)
    return TRAINER_STATE_COPIES * model_bytes(model, n_visible) + chains


def step_flops(n_visible: int, n_hidden: int, batch_size: int, cd_k: int) -> int:
    """FLOPs of one CD-k step: 2k+2 (B, V)×(V, H)-sized products (the data's hidden units, k
    Gibbs sweeps each way, the gradient), two FLOPs per multiply-add."""
    return 2 * batch_size * n_visible * n_hidden * (2 * cd_k + 2)


def eval_flops(n_visible: int, n_hidden: int, chains: int, betas: int) -> int:
    """FLOPs of one AIS estimate: a Gibbs sweep (two products) per chain and temperature."""
    return 2 * chains * betas * n_visible * n_hidden
