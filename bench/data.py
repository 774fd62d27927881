"""Benchmark inputs: the MNIST images in the shared data directory, loaded through ssdcore."""

from __future__ import annotations

import os
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_directory() -> Path:
    """`SSDRBM_DATA_DIR` when set, else `../shared/data` next to the repository."""
    configured = os.environ.get("SSDRBM_DATA_DIR")
    return Path(configured) if configured else REPO_ROOT.parent / "shared" / "data"


def mnist(mode: str, *, limit: int | None = None) -> torch.Tensor:
    """MNIST images as float32 (N, 784), preprocessed by ssdcore (`binarize`, `scale`, ...).

    `limit` keeps the first N images, so every implementation sees exactly the same data.
    """
    from ssdcore.data import load_mnist, preprocess

    images = load_mnist(data_directory() / "mnist")
    if isinstance(images, tuple):  # (images, labels) when the loader also returns labels
        images = images[0]
    images = images.reshape(images.shape[0], -1)
    if limit is not None:
        images = images[:limit]
    return preprocess(images, mode).to(torch.float32).contiguous()
