"""Checkpoints as safetensors: tensors in the body, JSON config and scalars in the metadata.

Nothing here unpickles: a checkpoint can come from storage or over the network, and loading it
must never run code. Model checkpoints (:func:`model_to_bytes`) hold the ``state_dict`` and the
JSON config (``model_from_config`` rebuilds it); trainer checkpoints (:func:`trainer_to_bytes`)
add the trainer's settings and full state, so a resumed run continues bit for bit. Nested state
is stored as JSON whose tensors are references ``{"tensor": name}`` into the body.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import Tensor

from ssdcore.centering import CenteringConfig
from ssdcore.models import model_from_config
from ssdcore.models.base import RBM
from ssdcore.optim.config import OptimizerConfig
from ssdcore.tempering import TemperingConfig
from ssdcore.training import Trainer

MODEL_FORMAT = "ssdrbm.model.v1"
TRAINER_FORMAT = "ssdrbm.trainer.v1"
_MODEL_PREFIX = "model."
_STATE_PREFIX = "state."


# --- nested state <-> (JSON, tensors) -------------------------------------------------------


def _encode(value: Any, name: str, tensors: dict[str, Tensor]) -> Any:
    """JSON-able form of ``value``; tensors go to ``tensors`` under unique names."""
    if isinstance(value, Tensor):
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()  # see _model_tensors
        return {"tensor": name}
    if isinstance(value, dict):
        return {
            "dict": [[key, _encode(item, f"{name}.{key}", tensors)] for key, item in value.items()]
        }
    if isinstance(value, list | tuple):
        items = [_encode(item, f"{name}.{i}", tensors) for i, item in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store {type(value).__name__} at {name!r} in a checkpoint")


def _decode(value: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of :func:`_encode`."""
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        return tensors[value["tensor"]]
    if "dict" in value:
        return {key: _decode(item, tensors) for key, item in value["dict"]}
    if "tuple" in value:
        return tuple(_decode(item, tensors) for item in value["tuple"])
    return [_decode(item, tensors) for item in value["list"]]


def _read(data: bytes, expected_format: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors and metadata of safetensors ``data``; ``ValueError`` when it is not one of ours."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ValueError(f"checkpoint must be bytes, got {type(data).__name__}")
    data = bytes(data)
    try:
        tensors = load_tensors(data)
        header_size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_size])
    except (SafetensorError, ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"not a safetensors checkpoint ({error})") from error
    metadata = header.get("__metadata__") or {}
    if metadata.get("format") != expected_format:
        raise ValueError(
            f"checkpoint format is {metadata.get('format')!r}; expected {expected_format!r}"
        )
    return tensors, metadata


# --- models ---------------------------------------------------------------------------------


def _model_tensors(model: RBM, prefix: str = "") -> dict[str, Tensor]:
    # Own, contiguous CPU copies: safetensors refuses views that share storage.
    return {
        prefix + name: t.detach().to("cpu", copy=True).contiguous()
        for name, t in model.state_dict().items()
    }


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def model_to_bytes(model: RBM) -> bytes:
    """The model's parameters as safetensors, its config JSON under metadata ``config``."""
    metadata = {"format": MODEL_FORMAT, "config": _json(model.config())}
    return save_tensors(_model_tensors(model), metadata=metadata)


def model_from_bytes(data: bytes, *, device: str | torch.device | None = None) -> RBM:
    """Rebuild a model written by :func:`model_to_bytes` (on ``device``, default CPU)."""
    tensors, metadata = _read(data, MODEL_FORMAT)
    model = model_from_config(json.loads(metadata["config"]), device=device)
    model.load_state_dict(tensors)
    return model


def save_model(path: str | Path, model: RBM) -> None:
    """Write :func:`model_to_bytes` to ``path``."""
    Path(path).write_bytes(model_to_bytes(model))


def load_model(path: str | Path, *, device: str | torch.device | None = None) -> RBM:
    """Read a model saved by :func:`save_model`."""
    return model_from_bytes(Path(path).read_bytes(), device=device)


# --- trainers -------------------------------------------------------------------------------


def _trainer_settings(trainer: Trainer) -> dict[str, Any]:
    settings = {
        "optimizer": trainer.optimizer_config.to_dict(),
        "batch_size": trainer.batch_size,
        "cd_k": trainer.cd_k,
        "persistent": trainer.persistent,
        "seed": trainer.seed,
        "check_every": trainer.check_every,
    }
    # Only when on, so other checkpoints keep the settings they always had.
    centering = trainer.centering and trainer.centering.config
    for name, config in (("tempering", trainer.tempering), ("centering", centering)):
        if config:
            settings[name] = config.to_dict()
    return settings


def trainer_to_bytes(trainer: Trainer) -> bytes:
    """The model, the trainer's settings and its full state, as safetensors."""
    tensors = _model_tensors(trainer.model, _MODEL_PREFIX)
    state = _encode(trainer.state_dict(), _STATE_PREFIX.rstrip("."), tensors)
    metadata = {
        "format": TRAINER_FORMAT,
        "config": _json(trainer.model.config()),
        "settings": _json(_trainer_settings(trainer)),
        "state": json.dumps(state),
    }
    return save_tensors(tensors, metadata=metadata)


def load_trainer_state(trainer: Trainer, data: bytes) -> None:
    """Load :func:`trainer_to_bytes` output into ``trainer`` (built with the same settings);
    ``ValueError`` when the checkpoint's model config or settings differ from the trainer's."""
    tensors, metadata = _read(data, TRAINER_FORMAT)
    config = json.loads(metadata["config"])
    if config != json.loads(_json(trainer.model.config())):
        raise ValueError(
            f"checkpoint is for model {config}, not {trainer.model.config()}; build the trainer "
            "with the checkpoint's model config (or use trainer_from_bytes)"
        )
    settings = json.loads(metadata["settings"])
    if settings != json.loads(_json(_trainer_settings(trainer))):
        raise ValueError(
            f"checkpoint was trained with settings {settings}, not {_trainer_settings(trainer)}"
        )
    model_state = {
        name[len(_MODEL_PREFIX) :]: t
        for name, t in tensors.items()
        if name.startswith(_MODEL_PREFIX)
    }
    with torch.no_grad():
        trainer.model.load_state_dict(model_state)
    trainer.load_state_dict(_decode(json.loads(metadata["state"]), tensors))


def trainer_from_bytes(
    data: bytes,
    train_data: Tensor,
    *,
    valid_data: Tensor | None = None,
    device: str | torch.device | None = None,
) -> Trainer:
    """A new :class:`Trainer` (and model) resumed from :func:`trainer_to_bytes` output. The training
    data is not stored in checkpoints; pass the same ``train_data`` (its order is)."""
    _, metadata = _read(data, TRAINER_FORMAT)
    model = model_from_config(json.loads(metadata["config"]), device=device)
    settings = json.loads(metadata["settings"])
    tempering, centering = settings.get("tempering"), settings.get("centering")
    trainer = Trainer(
        model,
        train_data,
        optimizer=OptimizerConfig.from_dict(settings["optimizer"]),
        batch_size=settings["batch_size"],
        cd_k=settings["cd_k"],
        persistent=settings["persistent"],
        seed=settings["seed"],
        valid_data=valid_data,
        check_every=settings["check_every"],
        tempering=None if tempering is None else TemperingConfig.from_dict(tempering),
        centering=None if centering is None else CenteringConfig.from_dict(centering),
    )
    load_trainer_state(trainer, data)
    return trainer


def save_trainer(path: str | Path, trainer: Trainer) -> None:
    """Write :func:`trainer_to_bytes` to ``path``."""
    Path(path).write_bytes(trainer_to_bytes(trainer))


def load_trainer(
    path: str | Path,
    train_data: Tensor,
    *,
    valid_data: Tensor | None = None,
    device: str | torch.device | None = None,
) -> Trainer:
    """Read a trainer saved by :func:`save_trainer` (see :func:`trainer_from_bytes`)."""
    return trainer_from_bytes(
        Path(path).read_bytes(), train_data, valid_data=valid_data, device=device
    )
