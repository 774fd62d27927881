"""MNIST from a directory of the standard IDX files (gzip-compressed or not)."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import numpy as np
import torch

from ssdcore.data.paths import default_data_dir

logger = logging.getLogger(__name__)

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
# The standard file stems, training set first; a directory may hold either or both.
SUBSETS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def load_mnist(
    directory: str | Path | None = None,
    *,
    subset: str = "all",
    with_labels: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """MNIST images as a float32 tensor (N, 784) of raw intensities 0..255. Reads whichever standard
    IDX files `directory` holds (default: the data directory's `mnist/`; plain or `.gz`):
    `subset="all"` concatenates the training files (if present) and the test files (if present);
    "train" or "test" picks one. With `with_labels=True` returns `(images, labels)` with int64
    labels (N,). Use `preprocess` to binarize or scale."""
    directory = Path(directory) if directory is not None else default_data_dir() / "mnist"
    if subset not in ("all", *SUBSETS):
        raise ValueError(f"subset must be 'all', 'train' or 'test', got {subset!r}")
    names = list(SUBSETS) if subset == "all" else [subset]
    images, labels = [], []
    for name in names:
        image_stem, label_stem = SUBSETS[name]
        image_path = _find(directory, image_stem)
        if image_path is None:
            continue
        images.append(_read_images(image_path))
        if with_labels:
            label_path = _find(directory, label_stem)
            if label_path is None:
                raise FileNotFoundError(
                    f"{image_path.name} has no labels file {label_stem}[.gz] in {directory}"
                )
            labels.append(_read_labels(label_path, expected=images[-1].shape[0]))
    if not images:
        wanted = ", ".join(f"{SUBSETS[name][0]}[.gz]" for name in names)
        raise FileNotFoundError(
            f"no MNIST image file ({wanted}) in {directory}; point `directory` (or "
            "SSDRBM_DATA_DIR) at a folder holding the IDX files"
        )
    x = torch.from_numpy(np.concatenate(images)).reshape(-1, 28 * 28).to(torch.float32)
    logger.debug("loaded %d MNIST images from %s", x.shape[0], directory)
    if not with_labels:
        return x
    return x, torch.from_numpy(np.concatenate(labels)).to(torch.int64)


def _find(directory: Path, stem: str) -> Path | None:
    for candidate in (directory / stem, directory / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _read_idx(path: Path, magic: int, kind: str, dimensions: int) -> tuple[bytes, list[int]]:
    """An IDX file's bytes (gunzipped) and its header's ``dimensions`` sizes, magic checked."""
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as handle:
            raw = handle.read()
    else:
        raw = path.read_bytes()
    words = 1 + dimensions
    header = np.frombuffer(raw, dtype=">i4", count=words) if len(raw) >= 4 * words else None
    if header is None or header[0] != magic:
        raise ValueError(f"{path} is not an IDX {kind} file (magic {magic} expected)")
    return raw, [int(v) for v in header[1:]]


def _read_images(path: Path) -> np.ndarray:
    raw, (count, rows, cols) = _read_idx(path, IMAGES_MAGIC, "image", dimensions=3)
    if (rows, cols) != (28, 28) or len(raw) != 16 + count * rows * cols:
        raise ValueError(
            f"{path}: header says {count} images of {rows}x{cols} but the file has "
            f"{len(raw) - 16} pixel bytes; the file is truncated or not MNIST"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(count, rows, cols)


def _read_labels(path: Path, expected: int) -> np.ndarray:
    raw, (count,) = _read_idx(path, LABELS_MAGIC, "label", dimensions=1)
    if count != expected or len(raw) != 8 + count:
        raise ValueError(f"{path}: {count} labels for {expected} images, or a truncated file")
    return np.frombuffer(raw, dtype=np.uint8, offset=8)
