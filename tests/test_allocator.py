"""The serving process keeps freed large blocks in glibc's heap for reuse
(server/ssdrbm_server/allocator.py)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from ssdrbm_server.allocator import keep_freed_memory

BLOCK = 8 * 1024 * 1024  # larger than glibc's default mapping threshold, under ours


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def mallinfo() -> MallInfo2:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.fail("this test needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2()


def test_a_large_freed_block_stays_in_the_heap() -> None:
    assert keep_freed_memory(), "glibc's mallopt refused the thresholds"
    before = mallinfo()
    block = bytearray(BLOCK)
    during = mallinfo()
    # Served from the heap, not from a mapping of its own (which the kernel takes back on free).
    assert during.hblkhd - before.hblkhd < BLOCK
    assert during.uordblks - before.uordblks >= BLOCK
    del block
    after = mallinfo()
    # Freed, and kept: the heap's free space grew by the block instead of being trimmed away.
    assert after.fordblks - during.fordblks >= 0.9 * BLOCK  # other objects may reuse a little
