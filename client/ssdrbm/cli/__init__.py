"""The ``ssdrbm`` command-line interface (entry point :func:`main`)."""

from __future__ import annotations

from ssdrbm.cli.main import main

__all__ = ["main"]
