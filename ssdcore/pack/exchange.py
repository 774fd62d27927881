"""A pack's run ⇄ the solo :class:`~ssdcore.Trainer` ⇄ ordinary checkpoint bytes.

A run taken out of a pack becomes a Trainer built as the service builds one, with the run's
parameters, momentum buffers, chains, random states, data order, step, step-size scale and wall
time loaded; its :func:`~ssdcore.checkpoint.trainer_to_bytes` is an ordinary solo checkpoint.
The other way, any solo Trainer (or its checkpoint) with the pack's settings and a compatible
optimizer can be put into a pack slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ssdcore.checkpoint import trainer_from_bytes, trainer_to_bytes
from ssdcore.models.bernoulli import BernoulliRBM
from ssdcore.models.gaussian import GaussianRBM
from ssdcore.optim.sgd import MOMENTUM_BUFFER
from ssdcore.pack.models import parameter_names
from ssdcore.pack.state import RunState
from ssdcore.training import Trainer

if TYPE_CHECKING:
    from ssdcore.pack.pack import TrainingPack


# RunState fields that are entries of Trainer.state_dict(), under these keys.
_TRAINER_STATE_KEYS = {
    "step": "step",
    "epoch": "epoch",
    "position": "position",
    "wall_time_s": "wall_time_s",
    "permutation": "permutation",
    "order_generator": "generator",
    "lr_scale": "lr_scale",
}


def _loop_settings(source: Trainer | TrainingPack) -> dict[str, Any]:
    """The training-loop settings a pack has once for all its runs and each run's solo
    Trainer has the same: what one is built with when made from the other."""
    return {
        name: getattr(source, name) for name in ("batch_size", "cd_k", "persistent", "check_every")
    }


def run_to_trainer(pack: TrainingPack, run: int, *, valid_data: Tensor | None = None) -> Trainer:
    """A solo Trainer continuing run ``run`` exactly (on the pack's device and data); also the
    way to the full :meth:`Trainer.evaluate` metrics of a run (``valid_data`` for the held-out
    ones)."""
    state = pack.run_state(run)
    trainer = Trainer(
        pack.model(run),
        pack.train_data,
        optimizer=state.optimizer,
        seed=state.seed,
        valid_data=valid_data,
        **_loop_settings(pack),
    )
    for group in trainer.optimizer.param_groups:
        buffer = state.momentum.get(group["name"])
        if buffer is not None:
            trainer.optimizer.state[group["params"][0]][MOMENTUM_BUFFER] = buffer.to(
                pack.device
            ).clone()
    estimator = {f"rng.{name}": tensor for name, tensor in state.random.items()}
    if state.chains is not None:
        estimator["chains"] = state.chains
    saved = {key: getattr(state, field) for field, key in _TRAINER_STATE_KEYS.items()}
    optimizer = trainer.optimizer.state_dict()
    trainer.load_state_dict({**saved, "estimator": estimator, "optimizer": optimizer})
    return trainer


def trainer_to_run_state(trainer: Trainer) -> RunState:
    """The :class:`RunState` of a solo Trainer (own copies), for :func:`insert_trainer`."""
    if trainer.centering is not None:
        raise ValueError("a centered run cannot be packed; train it with the solo Trainer")
    if trainer.tempering is not None:
        raise ValueError(
            "a parallel-tempering run cannot be packed; train it with the solo Trainer"
        )
    saved = trainer.state_dict()
    estimator = saved["estimator"]
    momentum = {}
    for group in trainer.optimizer.param_groups:
        buffer = trainer.optimizer.state.get(group["params"][0], {}).get(MOMENTUM_BUFFER)
        if buffer is not None:
            momentum[group["name"]] = buffer.detach().cpu().clone()
    chains = estimator.get("chains")
    return RunState(
        model_config=trainer.model.config(),
        parameters={
            name: getattr(trainer.model, name).detach().clone()
            for name in parameter_names(trainer.model.config())
        },
        optimizer=trainer.optimizer_config,
        seed=trainer.seed,
        random={k[4:]: v.clone() for k, v in estimator.items() if k.startswith("rng.")},
        chains=None if chains is None else chains.clone(),
        momentum=momentum,
        **{field: saved[key] for field, key in _TRAINER_STATE_KEYS.items()},
    )


def insert_trainer(pack: TrainingPack, run: int, trainer: Trainer) -> None:
    """Put a solo Trainer's run into pack slot ``run``; ValueError names what does not fit."""
    model = trainer.model
    if type(model) not in (BernoulliRBM, GaussianRBM):
        raise ValueError(
            f"the trainer's model is a {type(model).__name__}; packs hold BernoulliRBM and "
            "GaussianRBM models"
        )
    mismatches = [
        f"{what} {theirs!r} (pack: {ours!r})"
        for what, theirs, ours in (
            ("n_visible", model.n_visible, pack.n_visible),
            ("n_hidden", model.n_hidden, pack.n_hidden),
            ("batch_size", trainer.batch_size, pack.batch_size),
            ("cd_k", trainer.cd_k, pack.cd_k),
            ("persistent", trainer.persistent, pack.persistent),
        )
        if theirs != ours
    ]
    if mismatches:
        raise ValueError(f"the trainer does not fit this pack: {', '.join(mismatches)}")
    pack.load_run_state(run, trainer_to_run_state(trainer))


def pack_trainers(trainers: Sequence[Trainer], *, independent_streams: bool = True) -> TrainingPack:
    """One pack continuing every solo Trainer exactly where it stands (same data, shape, batch
    size, CD-k and persistence; compatible optimizers, see :func:`~ssdcore.pack.pack_key`):
    e.g. a worker's claimed jobs, each built or resumed as the solo worker would."""
    from ssdcore.pack.pack import PackRun, TrainingPack

    if not trainers:
        raise ValueError("trainers must hold at least one Trainer")
    first = trainers[0]
    for index, trainer in enumerate(trainers):
        if trainer.train_data is not first.train_data and not torch.equal(
            trainer.train_data, first.train_data
        ):
            raise ValueError(f"trainers[{index}] trains on other data than trainers[0]")
    runs = [PackRun(t.model, t.optimizer_config, t.seed) for t in trainers]
    pack = TrainingPack(
        runs,
        first.train_data,
        independent_streams=independent_streams,
        **_loop_settings(first),
    )
    for run, trainer in enumerate(trainers):
        insert_trainer(pack, run, trainer)
    return pack


def run_to_bytes(pack: TrainingPack, run: int) -> bytes:
    """Run ``run`` as an ordinary solo trainer checkpoint (:func:`trainer_to_bytes`)."""
    return trainer_to_bytes(run_to_trainer(pack, run))


def insert_bytes(pack: TrainingPack, run: int, data: bytes) -> None:
    """Put a solo trainer checkpoint (:func:`trainer_to_bytes` output) into slot ``run``."""
    insert_trainer(pack, run, trainer_from_bytes(data, pack.train_data, device=pack.device))
