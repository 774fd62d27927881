"""Plain arrays as training data: validation, conversion to float32 tensors, train/valid split."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def check_finite(x: torch.Tensor, name: str = "data") -> None:
    """Raise ValueError if `x` holds NaN or Inf, saying how many and where the first one is."""
    finite = torch.isfinite(x)
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()
    first = tuple(int(i) for i in bad[0])
    raise ValueError(
        f"{name} contains {bad.shape[0]} NaN/Inf value(s), the first at index {first}; "
        "remove or impute them before training"
    )


def as_data_tensor(x: Any, name: str = "data") -> torch.Tensor:
    """Convert a numpy array / tensor / nested list of examples to a finite float32 (N, V) tensor.
    Images (N, rows, cols, ...) are flattened to one row per example."""
    if isinstance(x, torch.Tensor):
        tensor = x.detach()
    else:
        array = np.asarray(x)
        if array.dtype == object or not (
            np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_
        ):
            raise ValueError(f"{name} must be numeric, got dtype {array.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.ndim < 2:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}; expected (examples, features) — "
            "add a leading example axis (e.g. x[None]) for a single example"
        )
    if tensor.shape[0] == 0:
        raise ValueError(f"{name} has no examples")
    tensor = tensor.reshape(tensor.shape[0], -1).to(torch.float32)
    check_finite(tensor, name)
    return tensor.contiguous()


def split_sizes(n: int, valid_fraction: float) -> tuple[int, int]:
    """(n_train, n_valid) that `split` gives for `n` examples: round(valid_fraction · n) rows
    validate; both parts keep at least one row."""
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    n_valid = round(valid_fraction * n)
    if n_valid < 1 or n_valid >= n:
        raise ValueError(
            f"valid_fraction={valid_fraction} leaves an empty part of {n} examples; "
            "use more data or a fraction nearer 0.5"
        )
    return n - n_valid, n_valid


def split(
    x: torch.Tensor, valid_fraction: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shuffle the rows of `x` (seeded) and split them into (train, valid). The validation part has
    round(valid_fraction · N) rows; both parts keep at least one row."""
    n = x.shape[0]
    _, n_valid = split_sizes(n, valid_fraction)
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator).to(x.device)
    return x[order[n_valid:]], x[order[:n_valid]]
