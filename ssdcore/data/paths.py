"""Where real data sets are found: ../shared/data next to the repository, or $SSDRBM_DATA_DIR."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SSDRBM_DATA_DIR"
_REPOSITORY_ROOT = Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """$SSDRBM_DATA_DIR if set, else `../shared/data` relative to the repository root."""
    configured = os.environ.get(DATA_DIR_ENV)
    if configured:
        return Path(configured)
    return _REPOSITORY_ROOT.parent / "shared" / "data"
