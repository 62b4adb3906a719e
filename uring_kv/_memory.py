"""Page-aligned host memory from anonymous mmap: what staging slots and tests read into.

Anonymous mmap (not ``cudaHostAlloc``/``pin_memory``) because io_uring buffer registration works on it
on every kernel, and CUDA can pin it afterwards with ``cudaHostRegister``. This module never pins or
registers anything itself.
"""

from __future__ import annotations

import ctypes
import mmap

HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)


class HostBuffer:
    """``size`` bytes of zeroed, page-aligned memory at a fixed address until :meth:`close`.

    ``huge_pages``: ask the kernel for transparent huge pages (``MADV_HUGEPAGE``) where the buffer
    spans one; they are honoured when THP is ``always`` or ``madvise``, and the request is a no-op
    otherwise. An O_DIRECT read into 4 KiB pages needs a segment per page the kernel could not find
    physically contiguous, and a block device takes a bounded number per request (254 on the CPU
    machine's virtio disk): a 2 MiB read into fragmented memory splits into several requests. Seen
    there, 2026-12-06: 2 MiB O_DIRECT load batches took 210–240 ms in some processes and 340–410 ms
    in others (3 of 8), by how fragmented the staging slots' pages happened to be; with huge pages
    8 of 8 ran at 184–238 ms.

    Keep the buffer alive (and un-closed) until every I/O or copy using it has completed.
    """

    def __init__(self, size: int, huge_pages: bool = False) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = huge_pages and size >= HUGE_PAGE and _advise_huge(self._map)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)

    def view_at(self, addr: int, length: int) -> memoryview:
        start = addr - self.addr
        if start < 0 or start + length > self.size:
            raise ValueError("range outside the buffer")
        return self.view[start : start + length]

    @property
    def closed(self) -> bool:
        return self._map.closed

    def close(self) -> None:
        if self._map.closed:
            return
        self.view.release()
        del self._anchor
        self._map.close()


def view_of(addr: int, length: int) -> memoryview:
    """A writable view of raw memory the caller guarantees stays mapped while it is used."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _advise_huge(region: mmap.mmap) -> bool:
    """MADV_HUGEPAGE on ``region``: whether the kernel took the advice (it refuses where THP is
    not built in; the buffer works the same either way)."""
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no MADV_HUGEPAGE in this Python, or EINVAL from the kernel
        return False
    return True
