"""Run small LAPACK factorizations on one CPU thread.

Measured on 2-core machines shared with other work, a threaded ``eigh`` / ``qr`` / ``svd`` of a
200×200 matrix ran 2× to several hundred times slower with two OpenMP threads than with one (the
threads spin waiting for a core), while the large products around them gain from both cores. So
the spectral step drops to one thread for its k×k factorizations only (``set_num_threads`` is
process-wide: other torch work at that moment runs single-threaded too; results are unaffected).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """Within the block, CPU torch ops use one intra-op thread (no-op for other devices)."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
