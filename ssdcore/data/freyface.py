"""The Frey Face data set from Sam Roweis's `frey_rawface.mat`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import torch

from ssdcore.data.paths import default_data_dir

FREY_ROWS, FREY_COLS = 28, 20
FILE_NAME = "frey_rawface.mat"


def load_frey_face(path: str | Path | None = None) -> torch.Tensor:
    """Frey Face images as a float32 tensor (1965, 560) of raw intensities (0..255). Each row is one
    upright 28×20 image flattened row-major. `path` defaults to `freyface/frey_rawface.mat` in the
    data directory."""
    path = Path(path) if path is not None else default_data_dir() / "freyface" / FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found; pass the path to {FILE_NAME} or set SSDRBM_DATA_DIR"
        )
    contents = scipy.io.loadmat(path)
    if "ff" not in contents:
        raise ValueError(f"{path} has no variable 'ff'; is it frey_rawface.mat?")
    faces = np.asarray(contents["ff"])
    if faces.ndim != 2 or faces.shape[0] != FREY_ROWS * FREY_COLS:
        raise ValueError(
            f"{path}: 'ff' has shape {faces.shape}; expected ({FREY_ROWS * FREY_COLS}, N)"
        )
    # Columns are images stored row-major as 28×20 once transposed.
    images = np.ascontiguousarray(faces.T).reshape(-1, FREY_ROWS * FREY_COLS)
    return torch.from_numpy(images.astype(np.float32))
