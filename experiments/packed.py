"""Runs of one experiment trained as packs: `common.execute` for many `RunSpec`s at once.

Runs that `ssdcore.pack.pack_key` finds compatible (RBMs of one kind, variance form and shape,
one update rule per parameter, one batch size, CD-k and length) are trained together as one
`ssdcore.pack.TrainingPack`; each keeps its own seed, initial model and step size. On the CPU a
packed run follows its solo `Trainer` bit for bit (docs/ARCHITECTURE.md, "Packed training"), so
the records are those `common.execute` would give, measured by the same `EvalPlan` at the same
steps. The rest (full-covariance Gaussian RBMs, centered runs, plain torch optimizers,
preconditioned SSD, a run alone in its group) go through `common.execute` unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from experiments import common
from experiments.common import EvalPlan, RunResult, RunSpec
from ssdcore.optim import OptimizerConfig
from ssdcore.pack import PackRun, TrainingPack, pack_key

logger = logging.getLogger(__name__)


def group_key(spec: RunSpec, n_visible: int) -> tuple | None:
    """The key of the runs `spec` can share a pack with (on the same data), None when it cannot
    be packed."""
    if (
        spec.centered
        or spec.tempering is not None
        or not isinstance(spec.optimizer, OptimizerConfig)
    ):
        return None
    try:
        key = pack_key(
            spec.model.build(n_visible).config(),
            spec.optimizer,
            batch_size=spec.batch_size,
            cd_k=spec.cd_k,
            persistent=spec.persistent,
            device="cpu",
        )
    except ValueError as error:
        logger.info("%s trains alone: %s", spec.label, error)
        return None
    return (key, spec.steps)  # a pack's runs are measured at the same steps


def groups(specs: Sequence[RunSpec], n_visible: int) -> list[list[int]]:
    """Indices of `specs` by pack: runs with equal keys together (first-seen order), every
    run that cannot be packed alone."""
    by_key: dict[tuple, list[int]] = {}
    alone: list[list[int]] = []
    for index, spec in enumerate(specs):
        key = group_key(spec, n_visible)
        if key is None:
            alone.append([index])
        else:
            by_key.setdefault(key, []).append(index)
    return list(by_key.values()) + alone


def execute_all(
    specs: Sequence[RunSpec], plan: EvalPlan, *, packed: bool = True
) -> list[RunResult]:
    """One result per spec, in their order: packed where runs can share a pack (`packed`),
    otherwise each through `common.execute`."""
    if not packed:
        return [common.execute(spec, plan) for spec in specs]
    results: list[RunResult | None] = [None] * len(specs)
    for group in groups(specs, plan.train.shape[1]):
        members = [specs[i] for i in group]
        done = execute_pack(members, plan) if len(group) > 1 else [common.execute(members[0], plan)]
        for index, result in zip(group, done, strict=True):
            results[index] = result
    return [r for r in results if r is not None]


def execute_pack(specs: Sequence[RunSpec], plan: EvalPlan) -> list[RunResult]:
    """`common.execute` for runs of one pack group, trained as one `TrainingPack`.

    Each model starts as its solo run's does (`seed_everything(seed)`, then built). A run whose
    parameters turn non-finite, or whose validation error does, stops there as a diverged
    solo run does, while the others go on. `train_seconds` is the pack's training time while
    the run was in it (the whole pack's, not a share).
    """
    first = specs[0]
    models = []
    for spec in specs:
        common.seed_everything(spec.seed)
        models.append(spec.model.build(plan.train.shape[1]))
    pack = TrainingPack(
        [
            PackRun(model, spec.optimizer, spec.seed)
            for model, spec in zip(models, specs, strict=True)
        ],
        plan.train,
        batch_size=first.batch_size,
        cd_k=first.cd_k,
        persistent=first.persistent,
    )
    records: list[list[dict[str, float]]] = [[] for _ in specs]
    diverged_at: list[int | None] = [None] * len(specs)
    for step in plan.steps(first.steps):
        running = [i for i in range(len(specs)) if diverged_at[i] is None]
        if not running:
            break
        for event in pack.train_steps(step - pack.step_counts[running[0]]):
            logger.warning(
                "%s diverged before step %d: %s", specs[event.run].label, step, event.what
            )
            diverged_at[event.run] = event.restored_step
        for i in running:
            if diverged_at[i] is not None:
                continue
            record = {"step": float(step), "train_seconds": pack.wall_times[i]}
            record.update(plan.measure(pack.model(i), step))
            records[i].append(record)
            if not math.isfinite(record["test_recon"]):
                diverged_at[i] = step
                pack.hold(i)
    logger.info(
        "pack of %d runs (%s ...): %d steps in %.1f s",
        len(specs),
        first.label,
        first.steps,
        max(pack.wall_times),
    )
    return [
        RunResult(
            spec,
            records[i],
            pack.model(i),
            pack.wall_times[i],
            diverged_at[i],
            extra={"pack_size": len(specs)},
        )
        for i, spec in enumerate(specs)
    ]
