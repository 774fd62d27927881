"""Data: the paper's synthetic generator, MNIST, Frey Face, plain arrays, preprocessing, splits."""

from __future__ import annotations

from ssdcore.data.arrays import as_data_tensor, check_finite, split, split_sizes
from ssdcore.data.freyface import load_frey_face
from ssdcore.data.mnist import load_mnist
from ssdcore.data.paths import DATA_DIR_ENV, default_data_dir
from ssdcore.data.preprocess import PREPROCESS_MODES, preprocess
from ssdcore.data.synthetic import synthetic_rbm_data, synthetic_rbm_model

__all__ = [
    "DATA_DIR_ENV",
    "PREPROCESS_MODES",
    "as_data_tensor",
    "check_finite",
    "default_data_dir",
    "load_frey_face",
    "load_mnist",
    "preprocess",
    "split",
    "split_sizes",
    "synthetic_rbm_data",
    "synthetic_rbm_model",
]
