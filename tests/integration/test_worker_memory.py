"""A worker process keeps glibc's mmap threshold fixed (issue 7's RSS check, Redis store).

Before :func:`~moorline.worker.process.pin_mmap_threshold`, a worker's RSS grew about 1 MiB per
1,000 runs on the Redis store: asyncio's 256 KiB read buffers were carved from the heap once
glibc had raised its mmap threshold, and the heap fragmented (``bench/memory.py`` shows it
over thousands of runs, too slow for a test). What is checked here is the mechanism, exactly:
in a fresh interpreter, after a large block was freed (which raises a dynamic threshold), a
block the size of a read buffer is mapped on its own only once the threshold is pinned.
"""

import os
import subprocess
import sys

import pytest

PROBE = """
import asyncio.selector_events
import ctypes
import sys

from moorline.worker.process import pin_mmap_threshold

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
READ_BUFFER = asyncio.selector_events._SelectorSocketTransport.max_size

def heap_growth(buffers: int) -> int:
    # Bytes the heap grew by to hold this many read buffers at once.
    large = bytearray(4 * 1024 * 1024)  # freed: a dynamic threshold rises to its size
    del large
    before = libc.mallinfo2().arena
    held = [bytearray(READ_BUFFER) for _ in range(buffers)]
    grown = libc.mallinfo2().arena - before
    del held
    return grown


if sys.argv[1] == "pin":
    assert pin_mmap_threshold()
print(heap_growth(32))
"""


def is_glibc() -> bool:
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return False
    return True


def heap_growth(mode: str) -> int:
    """In a fresh interpreter (``mode`` "pin" or "dynamic"): heap growth for 32 read buffers."""
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(probe.stdout)


@pytest.mark.skipif(not is_glibc(), reason="the mmap threshold is glibc's")
def test_read_buffers_never_grow_the_heap_once_the_threshold_is_pinned() -> None:
    buffers_bytes = 32 * 256 * 1024
    # Without the pin the buffers are carved from the heap, which grows to hold them: the
    # condition the RSS growth needed. Pinned, those that fit no free block get mappings.
    assert heap_growth("dynamic") > buffers_bytes // 2
    assert heap_growth("pin") <= 0
