"""Host buffers for direct (``O_DIRECT``) disk I/O, in huge pages where the kernel grants them."""

from __future__ import annotations

import contextlib
import ctypes
import mmap

#: A transparent huge page (x86-64, arm64 with 4 KiB base pages).
HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of zeroed, writable memory starting on a huge-page boundary (so on any
    ``O_DIRECT`` boundary too), asked of the kernel in huge pages (``MADV_HUGEPAGE``).

    A disk request carries one scatter-gather segment per physically contiguous span of its
    buffer, so a buffer in scattered 4 KiB pages is cut into small requests
    (docs/performance.md, benchmark 4). The view keeps its private mapping alive; on a kernel
    without transparent huge pages the memory is in 4 KiB pages.
    """
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            area.madvise(mmap.MADV_HUGEPAGE)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(area)) % HUGE_PAGE
    return memoryview(area)[start : start + nbytes]
