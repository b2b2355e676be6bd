from __future__ import annotations

import numpy as np

from kvcompose_cpu_offload.host_memory import HUGE_PAGE, huge_page_buffer


def test_a_huge_page_buffer_is_zeroed_writable_and_starts_on_a_huge_page() -> None:
    a, b = huge_page_buffer(3 * 4096), huge_page_buffer(HUGE_PAGE + 4096)
    assert (a.nbytes, b.nbytes) == (3 * 4096, HUGE_PAGE + 4096) and not a.readonly
    arr = np.frombuffer(a, dtype=np.int8)
    assert arr.ctypes.data % HUGE_PAGE == 0 and np.frombuffer(b, dtype=np.int8).ctypes.data % HUGE_PAGE == 0
    assert not arr.any()
    a[-1] = 7  # its own memory: the other buffer stays zero
    assert arr[-1] == 7 and not np.frombuffer(b, dtype=np.int8).any()
