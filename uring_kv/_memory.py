"""Page-aligned host memory from anonymous mmap: what staging slots and tests read into.

Anonymous mmap (not ``cudaHostAlloc``/``pin_memory``) because io_uring buffer registration works on it
on every kernel, and CUDA can pin it afterwards with ``cudaHostRegister``. This module never pins or
registers anything itself.
"""

from __future__ import annotations

import ctypes
import mmap


class HostBuffer:
    """``size`` bytes of zeroed, page-aligned memory at a fixed address until :meth:`close`.

    Keep the buffer alive (and un-closed) until every I/O or copy using it has completed.
    """

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size}")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
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
