"""Input transforms: none, binarize, scale to [0, 1], standardize."""

from __future__ import annotations

import torch

from ssdcore.data.arrays import check_finite

PREPROCESS_MODES = ("none", "binarize", "scale", "standardize")
# Features whose standard deviation is below this (e.g. MNIST's always-black border) are only
# centred, not divided, so they stay at 0 instead of blowing up.
_MIN_STD = 1e-6


def preprocess(x: torch.Tensor, mode: str, *, threshold: float = 0.5) -> torch.Tensor:
    """Return a transformed float32 copy of `x` (N, V).

    - "none": unchanged values;
    - "scale": min-max over the whole array to [0, 1] (e.g. pixel intensities 0..255);
    - "binarize": "scale", then 1 where the value exceeds `threshold`, else 0;
    - "standardize": per feature, zero mean and unit variance (constant features become 0).
    """
    if mode not in PREPROCESS_MODES:
        raise ValueError(
            f"preprocess mode must be one of {', '.join(PREPROCESS_MODES)}; got {mode!r}"
        )
    x = x.to(torch.float32)
    check_finite(x)
    if mode == "none":
        return x.clone()
    if mode in ("scale", "binarize"):
        low, high = x.min(), x.max()
        span = high - low
        scaled = (x - low) / span if float(span) > 0 else torch.zeros_like(x)
        if mode == "scale":
            return scaled
        return (scaled > threshold).to(torch.float32)
    mean = x.mean(dim=0)
    std = x.std(dim=0, unbiased=False)
    std = torch.where(std < _MIN_STD, torch.ones_like(std), std)
    return (x - mean) / std
