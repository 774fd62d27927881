"""Which device ssdcore computes on: CUDA when present, else the CPU."""

from __future__ import annotations

import torch


def default_device() -> torch.device:
    """The first CUDA device when one is available, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` as a ``torch.device``; ``None`` or ``"auto"`` picks :func:`default_device`.

    Raises ``ValueError`` when CUDA is requested on a machine without it.
    """
    if device is None or device == "auto":
        return default_device()
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available; use 'cpu'")
    return resolved
