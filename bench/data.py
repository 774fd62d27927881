"""Benchmark inputs: the MNIST images in the shared data directory, loaded through ssdcore."""

from __future__ import annotations

from pathlib import Path

import torch

from ssdcore.data import default_data_dir, load_mnist, preprocess

REPO_ROOT = Path(__file__).resolve().parent.parent


def mnist(mode: str, *, limit: int | None = None) -> torch.Tensor:
    """MNIST images as float32 (N, 784), preprocessed by ssdcore (`binarize`, `scale`, ...).

    `limit` keeps the first N images, so every implementation sees exactly the same data.
    """
    images = load_mnist(default_data_dir() / "mnist")
    images = images.reshape(images.shape[0], -1)
    if limit is not None:
        images = images[:limit]
    return preprocess(images, mode).to(torch.float32).contiguous()
