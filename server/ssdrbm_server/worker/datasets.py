"""The data a job trains on: a built-in dataset or an uploaded array, preprocessed and split.

Built-ins: "synthetic" (the paper's generator; options n_visible, n_hidden, n_samples, seed),
"mnist" and "freyface" (read from the data directory; option limit). Uploaded arrays arrive as
raw little-endian bytes with dtype and shape and are rebuilt with numpy.frombuffer. The spec was
resolved (options and preprocessing filled in) before the job was queued; it is read as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from ssdrbm.datasets import UPLOAD_DTYPES_BY_NAME
from ssdrbm.v1 import rbm_pb2

from ssdcore import data as ssdata
from ssdrbm_server import catalog
from ssdrbm_server.config import Settings
from ssdrbm_server.vocabulary import PREPROCESS_NAMES

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """The dataset reference cannot be resolved; the message says what to change."""


@dataclass
class Uploaded:
    """An uploaded array as stored: dtype name, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass
class SplitData:
    """Preprocessed training and validation examples, float32 (N, V)."""

    train: torch.Tensor
    valid: torch.Tensor | None

    @property
    def n_visible(self) -> int:
        return int(self.train.shape[1])


def load_builtin(builtin: rbm_pb2.BuiltinDataset, settings: Settings) -> torch.Tensor:
    """Examples (N, V) of a built-in dataset, before preprocessing."""
    options = {key: int(value) for key, value in builtin.options.items()}
    if builtin.name == "synthetic":
        return ssdata.synthetic_rbm_data(**options)
    if builtin.name == "mnist":
        examples = ssdata.load_mnist(catalog.mnist_directory(settings))
    elif builtin.name == "freyface":
        examples = ssdata.load_frey_face(catalog.frey_face_path(settings))
    else:
        raise DatasetError(f"unknown built-in dataset {builtin.name!r}")
    limit = options["limit"]
    return examples[:limit] if limit else examples


def load_uploaded(uploaded: Uploaded) -> torch.Tensor:
    """Examples (N, V) of an uploaded array; images (N, H, W) are flattened."""
    if uploaded.dtype not in UPLOAD_DTYPES_BY_NAME:
        raise DatasetError(f"uploaded dataset has unsupported dtype {uploaded.dtype!r}")
    array = np.frombuffer(uploaded.data, dtype=UPLOAD_DTYPES_BY_NAME[uploaded.dtype])
    array = array.reshape(uploaded.shape[0], -1).astype(np.float32)
    return torch.from_numpy(array)


def prepare(
    spec: rbm_pb2.StartTrainingRequest, settings: Settings, uploaded: Uploaded | None
) -> SplitData:
    """Load, preprocess and split a job's data."""
    ref = spec.dataset
    if ref.WhichOneof("source") == "dataset_id":
        if uploaded is None:
            raise DatasetError(f"dataset {ref.dataset_id!r} was not provided to the trainer")
        examples = load_uploaded(uploaded)
    else:
        examples = load_builtin(ref.builtin, settings)
    if not torch.isfinite(examples).all():
        raise DatasetError("the dataset holds NaN or infinite values")
    examples = ssdata.preprocess(examples, PREPROCESS_NAMES[ref.preprocess])
    if spec.model.kind == rbm_pb2.MODEL_KIND_BERNOULLI:
        _check_probabilities(examples)
    train, valid = ssdata.split(examples, spec.eval.validation_fraction, spec.training.seed)
    if train.shape[0] == 0:
        raise DatasetError("no training examples remain after the validation split")
    logger.info(
        "dataset: %d training and %d validation examples of %d visibles",
        train.shape[0],
        0 if valid is None else valid.shape[0],
        train.shape[1],
    )
    return SplitData(train, valid if valid is not None and valid.shape[0] > 0 else None)


def _check_probabilities(examples: torch.Tensor) -> None:
    """Binary visible units model values in [0, 1]; anything else would train on nonsense."""
    low, high = float(examples.min()), float(examples.max())
    if low < 0 or high > 1:
        raise DatasetError(
            f"a Bernoulli model needs visible values in [0, 1], but this dataset holds values "
            f"from {low:g} to {high:g}; set dataset.preprocess to SCALE or BINARIZE, or use a "
            "Gaussian model"
        )
