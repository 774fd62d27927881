"""The built-in datasets a job may name, with their options, widths and example counts.

The resolver needs a dataset's width (n_visible) and size (examples, for epochs → steps) before
the job is queued, without loading it. Real datasets are read from the server's data directory
(``data_directory``: the one place it is decided, for the API and the training process alike).
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ssdcore.data.paths import default_data_dir
from ssdrbm_server.config import Settings
from ssdrbm_server.errors import FailedPreconditionError, InvalidArgumentError

FREY_FACE_FILE = "frey_rawface.mat"
FREY_FACE_EXAMPLES = 1965
FREY_FACE_WIDTH = 20 * 28
MNIST_WIDTH = 28 * 28
MNIST_IMAGE_FILES = ("train-images-idx3-ubyte", "t10k-images-idx3-ubyte")
IDX3_MAGIC = 2051
# Where each real dataset's files go, relative to the data directory, as a missing one names them.
EXPECTED_FILES = {
    "mnist": " and/or ".join(f"mnist/{stem}[.gz]" for stem in MNIST_IMAGE_FILES),
    "freyface": f"freyface/{FREY_FACE_FILE}",
}


@dataclass(frozen=True)
class IntOption:
    """An integer option of a built-in dataset, as the string map carries it."""

    default: int
    low: int
    high: int


SYNTHETIC_OPTIONS = {
    "n_visible": IntOption(100, 1, 4096),
    "n_hidden": IntOption(25, 1, 4096),
    "n_samples": IntOption(5000, 2, 1_000_000),
    "seed": IntOption(0, 0, 2**32 - 1),
}
LIMIT_OPTION = {"limit": IntOption(0, 0, 10_000_000)}  # 0 = all examples

OPTIONS = {"synthetic": SYNTHETIC_OPTIONS, "mnist": LIMIT_OPTION, "freyface": LIMIT_OPTION}
IMAGE_DATASETS = frozenset({"mnist", "freyface"})  # pixel intensities: their natural preprocessing


@dataclass(frozen=True)
class DatasetShape:
    """What validation needs to know about a dataset before training: width and size."""

    n_visible: int
    n_examples: int


def data_directory(settings: Settings) -> Path:
    """Where the real datasets are: SSDRBM_DATA_DIR, else ssdcore's default (../shared/data)."""
    return Path(settings.data_dir) if settings.data_dir else default_data_dir()


def parse_options(name: str, options: Mapping[str, str], field: str) -> dict[str, int]:
    """Options of built-in dataset ``name`` with defaults filled; unknown or bad ones refused."""
    if name not in OPTIONS:
        raise InvalidArgumentError(
            f"{field}.name", f"unknown dataset {name!r}; choose one of {sorted(OPTIONS)}"
        )
    known = OPTIONS[name]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InvalidArgumentError(
            f"{field}.options",
            f"unknown option(s) {unknown} for {name!r}; allowed: {sorted(known)}",
        )
    parsed: dict[str, int] = {}
    for key, spec in known.items():
        raw = options.get(key)
        if raw is None:
            parsed[key] = spec.default
            continue
        try:
            value = int(raw)
        except ValueError:
            raise InvalidArgumentError(
                f"{field}.options[{key}]", f"must be an integer, got {raw!r}"
            ) from None
        if not spec.low <= value <= spec.high:
            raise InvalidArgumentError(
                f"{field}.options[{key}]",
                f"must be between {spec.low} and {spec.high}, got {value}",
            )
        parsed[key] = value
    return parsed


def builtin_shape(name: str, options: Mapping[str, int], settings: Settings) -> DatasetShape:
    """Width and example count of a built-in dataset, given its parsed options."""
    if name == "synthetic":
        return DatasetShape(options["n_visible"], options["n_samples"])
    if name == "mnist":
        count = _mnist_count(mnist_directory(settings))
        width = MNIST_WIDTH
    else:
        path = frey_face_path(settings)
        if not path.is_file():
            raise not_installed("freyface", f"{path} is missing")
        count, width = FREY_FACE_EXAMPLES, FREY_FACE_WIDTH
    limit = options.get("limit", 0)
    if limit:
        count = min(count, limit)
    return DatasetShape(width, count)


def mnist_directory(settings: Settings) -> Path:
    return data_directory(settings) / "mnist"


def frey_face_path(settings: Settings) -> Path:
    return data_directory(settings) / "freyface" / FREY_FACE_FILE


def _mnist_count(directory: Path) -> int:
    total = 0
    for stem in MNIST_IMAGE_FILES:
        for path in (directory / stem, directory / f"{stem}.gz"):
            if path.is_file():
                total += _idx3_count(path)
                break
    if total == 0:
        raise not_installed("mnist", f"no IDX image files in {directory}")
    return total


def not_installed(name: str, found: str) -> FailedPreconditionError:
    """Built-in dataset ``name`` has no files here: what was looked for, where, and what instead."""
    return FailedPreconditionError(
        f"dataset {name!r} is not installed on this server ({found}); it needs "
        f"{EXPECTED_FILES[name]} under the data directory (SSDRBM_DATA_DIR on the server), "
        "or train on your own array instead: `ssdrbm train --data x.npy`, or "
        "`ssdrbm upload x.npy` then `ssdrbm train --dataset-id ID` (UploadDataset)",
        precondition="DATASET_NOT_INSTALLED",
        subject=f"dataset:{name}",
    )


def _idx3_count(path: Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        magic, count = struct.unpack(">ii", handle.read(8))
    if magic != IDX3_MAGIC:
        raise FailedPreconditionError(f"{path} is not an IDX image file (magic {magic})")
    return count
