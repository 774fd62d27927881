"""The data a job trains on: a built-in dataset or an uploaded array, preprocessed and split.

Built-ins: "synthetic" (the paper's generator; options n_visible, n_hidden, n_samples, seed),
"mnist" and "freyface" (read from the data directory; option limit). Uploaded arrays arrive as
raw little-endian bytes with dtype and shape and are rebuilt with numpy.frombuffer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from ssdrbm.v1 import rbm_pb2

from ssdcore import data as ssdata
from ssdrbm_server import catalog
from ssdrbm_server.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

FREYFACE_FILE = "frey_rawface.mat"
# numpy dtypes of the upload formats, explicitly little-endian.
UPLOAD_DTYPES = {"float32": "<f4", "float64": "<f8", "uint8": "u1"}
PREPROCESS_MODES = {
    rbm_pb2.PREPROCESS_NONE: "none",
    rbm_pb2.PREPROCESS_BINARIZE: "binarize",
    rbm_pb2.PREPROCESS_SCALE: "scale",
    rbm_pb2.PREPROCESS_STANDARDIZE: "standardize",
}


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


def load_builtin(builtin: rbm_pb2.BuiltinDataset, data_dir: Path) -> torch.Tensor:
    """Examples (N, V) of a built-in dataset, before preprocessing.

    Options are parsed by the same catalog that validated the request, so a spec the server
    accepted (defaults filled in, e.g. limit 0 = every example) is read the same way here.
    """
    name = builtin.name
    try:
        options = catalog.parse_options(name, builtin.options, "dataset.builtin")
    except InvalidArgumentError as error:
        raise DatasetError(error.message) from None
    if name == "synthetic":
        return ssdata.synthetic_rbm_data(**options)
    if name == "mnist":
        examples = ssdata.load_mnist(data_dir / "mnist")
    else:
        examples = ssdata.load_frey_face(data_dir / "freyface" / FREYFACE_FILE)
    limit = options["limit"]
    return examples[:limit] if limit else examples


def load_uploaded(uploaded: Uploaded) -> torch.Tensor:
    """Examples (N, V) of an uploaded array; images (N, H, W) are flattened."""
    if uploaded.dtype not in UPLOAD_DTYPES:
        raise DatasetError(f"uploaded dataset has unsupported dtype {uploaded.dtype!r}")
    array = np.frombuffer(uploaded.data, dtype=UPLOAD_DTYPES[uploaded.dtype])
    array = array.reshape(uploaded.shape[0], -1).astype(np.float32)
    return torch.from_numpy(array)


def preprocess_mode(ref: rbm_pb2.DatasetRef, model_kind: str) -> str:
    """The preprocessing to apply: as asked, or the dataset's natural default.

    Synthetic data is already binary. Images (MNIST, Frey Face, uploads) are binarized for a
    Bernoulli RBM and standardized per pixel for a Gaussian one.
    """
    if ref.preprocess in PREPROCESS_MODES:
        return PREPROCESS_MODES[ref.preprocess]
    if ref.WhichOneof("source") == "builtin" and ref.builtin.name == "synthetic":
        return "none"
    return "binarize" if model_kind == "bernoulli" else "standardize"


def prepare(
    ref: rbm_pb2.DatasetRef,
    *,
    model_kind: str,
    data_dir: Path,
    uploaded: Uploaded | None,
    validation_fraction: float,
    seed: int,
) -> SplitData:
    """Load, preprocess and split a job's data."""
    if ref.WhichOneof("source") == "dataset_id":
        if uploaded is None:
            raise DatasetError(f"dataset {ref.dataset_id!r} was not provided to the trainer")
        examples = load_uploaded(uploaded)
    elif ref.WhichOneof("source") == "builtin":
        examples = load_builtin(ref.builtin, data_dir)
    else:
        raise DatasetError("the job names no dataset; set dataset.builtin or dataset.dataset_id")
    if not torch.isfinite(examples).all():
        raise DatasetError("the dataset holds NaN or infinite values")
    examples = ssdata.preprocess(examples, preprocess_mode(ref, model_kind))
    train, valid = ssdata.split(examples, validation_fraction, seed)
    if train.shape[0] == 0:
        raise DatasetError("no training examples remain after the validation split")
    logger.info(
        "dataset: %d training and %d validation examples of %d visibles",
        train.shape[0],
        0 if valid is None else valid.shape[0],
        train.shape[1],
    )
    return SplitData(train, valid if valid is not None and valid.shape[0] > 0 else None)
