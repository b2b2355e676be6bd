"""Block ids are checked before any copy, and both loops of the compiled copy are exercised.

The id checks are tested with a stand-in for the compiled helper on its path (:class:`_SpyHelper`):
an unchecked id there is an address out of bounds, which a test must not write to.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from kvcompose.testing.kv import fill_random, make_engine_kv
from kvcompose_cpu_offload import _streamcopy, block_copy
from kvcompose_cpu_offload.block_copy import (
    COPY_LOOP_ENV,
    as_array,
    check_block_ids,
    copy_blocks,
    copy_loop,
    stack_regions,
)
from kvcompose_cpu_offload.copy_threads import ThreadEvent
from kvcompose_cpu_offload.disk_backend import PortableDiskBackend
from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker

STREAMS = bool(_streamcopy is not None and _streamcopy.STREAMS)
needs_helper = pytest.mark.skipif(_streamcopy is None, reason="the compiled helper is not built here")
#: The helper's two loops; the AVX-512 one runs only where the CPU has AVX-512F.
LOOPS = [
    pytest.param("avx512", marks=pytest.mark.skipif(not STREAMS, reason="no AVX-512F here")),
    pytest.param("plain", marks=needs_helper),
]


class _SpyHelper:
    """Stands in for ``_streamcopy``: counts calls and copies nothing."""

    STREAMS = 1

    def __init__(self) -> None:
        self.calls = 0

    def copy_pieces(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream_min: int) -> int:
        self.calls += 1
        return len(sizes)


def _path(monkeypatch: pytest.MonkeyPatch, path: str) -> _SpyHelper | None:
    """Send every copy down ``path``: ``"helper"`` (the spy, from any size) or ``"numpy"``."""
    if path == "numpy":
        monkeypatch.setattr(block_copy, "_streamcopy", None)
        return None
    spy = _SpyHelper()
    monkeypatch.setattr(block_copy, "_streamcopy", spy)
    monkeypatch.setattr(block_copy, "STREAM_MIN_BYTES", 0)
    return spy


# --------------------------------------------------------------------------- block id checks


def test_check_block_ids_names_the_bad_id_and_the_range() -> None:
    check_block_ids([], 0, "source block")
    check_block_ids([0, 7, 3], 8, "source block")
    with pytest.raises(IndexError, match=r"source block id 8 is outside \[0, 8\); nothing of the transfer's 2 blocks"):
        check_block_ids([1, 8], 8, "source block")
    with pytest.raises(IndexError, match=r"disk slot id -1 is outside \[0, 8\)"):
        check_block_ids([9, -1], 8, "disk slot")  # a negative id is named first
    with pytest.raises(IndexError, match=r"id 18446744073709551616 is outside"):
        check_block_ids([1, 2**64], 8, "destination block")


@pytest.mark.parametrize("path", ["numpy", "helper"])
@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "error"),
    [
        ([1, 2], [3, 24], r"destination block id 24 is outside \[0, 24\)"),
        ([1, 2], [3, -1], r"destination block id -1 is outside \[0, 24\)"),  # numpy would wrap it
        ([1, 12], [3, 4], r"source block id 12 is outside \[0, 12\)"),
        ([-2, 1], [3, 4], r"source block id -2 is outside \[0, 12\)"),
    ],
    ids=["dst_past_end", "dst_negative", "src_past_end", "src_negative"],
)
def test_copy_blocks_checks_every_id_before_copying_anything(
    path: str, src_ids: list[int], dst_ids: list[int], error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _path(monkeypatch, path)
    engine = torch.randint(-128, 128, (4, 12, 256), dtype=torch.int8)  # [layer, block, bytes]
    pool = torch.zeros((4, 24, 256), dtype=torch.int8)
    ((_, dev),) = stack_regions([engine[i] for i in range(4)])
    ((_, host),) = stack_regions([pool[i] for i in range(4)])
    pairs = [(as_array(dev), as_array(host))]
    with pytest.raises(IndexError, match=error):
        copy_blocks(pairs, src_ids, dst_ids, copy_loop())
    assert not pool.any()  # the good id before the bad one was not copied either
    if spy is not None:
        assert spy.calls == 0
        copy_blocks(pairs, [1, 2], [3, 4], copy_loop())  # the same transfer, good ids: down the helper's path
        assert spy.calls == 1


def _worker(blocks: int = 16) -> PortableSimpleCPUOffloadWorker:
    kv = make_engine_kv(num_blocks=blocks)
    fill_random(kv)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    return worker


@pytest.mark.parametrize("path", ["numpy", "helper"])
@pytest.mark.parametrize("direction", ["store", "load"])
def test_a_bad_block_id_fails_its_transfer_through_the_event(
    path: str, direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error reaches vLLM the way a failed copy does (the event raises on the engine's
    thread, where a composition settles the transfer as failed), and nothing was copied."""
    spy = _path(monkeypatch, path)
    worker = _worker()
    assert worker.cpu_kv_caches is not None and worker.gpu_kv_caches is not None
    pool_blocks = worker.num_cpu_blocks
    gpu_before = {n: r.clone() for n, r in worker.gpu_kv_caches.items()}
    if direction == "store":
        meta = SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[1, 2], store_cpu_blocks=[0, -3])
        error = rf"host copy store failed: destination block id -3 is outside \[0, {pool_blocks}\)"
    else:
        meta = SimpleCPUOffloadMetadata(
            load_event=0, load_cpu_blocks=[0, pool_blocks], load_gpu_blocks=[1, 2], load_event_to_reqs={0: ["r"]}
        )
        error = rf"host copy load failed: source block id {pool_blocks} is outside \[0, {pool_blocks}\)"
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    worker.wait_for_save()
    with pytest.raises(RuntimeError, match=error):
        worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
    for name, region in worker.gpu_kv_caches.items():
        assert torch.equal(region, gpu_before[name]), name
        assert not worker.cpu_kv_caches[name].any(), name
    if spy is not None:
        assert spy.calls == 0
    worker.shutdown()


@pytest.mark.parametrize("mode", ["in_place", "staged_helper", "staged_numpy"])
@pytest.mark.parametrize(
    ("blocks", "slots", "error"),
    [
        ([1, 2], [0, 6], r"disk slot id 6 is outside \[0, 6\)"),  # would extend the file
        ([1, 2], [-1, 0], r"disk slot id -1 is outside \[0, 6\)"),
        ([1, 8], [0, 1], r"device block id 8 is outside \[0, 8\)"),
        ([-1, 2], [0, 1], r"device block id -1 is outside \[0, 8\)"),
    ],
    ids=["slot_past_end", "slot_negative", "block_past_end", "block_negative"],
)
@pytest.mark.parametrize("is_store", [True, False], ids=["store", "load"])
def test_the_disk_tier_checks_blocks_and_slots_before_any_io(
    tmp_path: os.PathLike[str],
    mode: str,
    blocks: list[int],
    slots: list[int],
    error: str,
    is_store: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = None if mode == "in_place" else _path(monkeypatch, "helper" if mode == "staged_helper" else "numpy")
    nb, slot = 8, 4096
    raw = torch.randint(-128, 128, (nb * slot + 4096,), dtype=torch.int8)
    start = -raw.data_ptr() % 4096
    regions = {"r0": raw[start : start + nb * slot].view(nb, slot)}
    before = regions["r0"].clone()
    path = os.path.join(tmp_path, "kv.bin")
    backend = PortableDiskBackend()
    backend.init(regions, path, 6, slot, use_page_cache=mode == "in_place")
    events: list[tuple[int, ThreadEvent]] = []
    src, dst = (blocks, slots) if is_store else (slots, blocks)
    backend.launch_copy(src, dst, is_store, 0, events)
    with pytest.raises(RuntimeError, match=f"disk {'store' if is_store else 'load'} failed: {error}"):
        events[-1][1].synchronize()
    assert os.path.getsize(path) == 6 * slot and not any(open(path, "rb").read())
    assert torch.equal(regions["r0"], before)
    if spy is not None:
        assert spy.calls == 0
    backend.shutdown()


# --------------------------------------------------------------------------- the two copy loops


#: Around each step of the loops: a 64-byte line, the 512-byte loop, the four 4 KiB spans (16 KiB).
PIECE_SIZES = [1, 63, 64, 65, 511, 512, 513, 4095, 4096, 16383, 16384, 16385, 2 * 16384 + 77, 3 * 16384 + 4095, 70001]


@pytest.mark.parametrize("loop", LOOPS)
def test_each_copy_loop_copies_pieces_of_every_size_and_alignment(loop: str) -> None:
    """Every piece lands whole and nothing around it is written, at offsets off a 64-byte line
    (the loops' aligned head) that differ between source and destination."""
    gap = 128
    offsets = np.cumsum([gap] + [n + gap for n in PIECE_SIZES[:-1]]) + np.arange(len(PIECE_SIZES)) * 7 % 64
    src = np.random.default_rng(0).integers(0, 256, int(offsets[-1]) + PIECE_SIZES[-1] + gap, dtype=np.uint8)
    dst = np.zeros(len(src) + 64, dtype=np.uint8)
    want = dst.copy()
    for off, n in zip(offsets.tolist(), PIECE_SIZES):
        want[off + 5 : off + 5 + n] = src[off : off + n]
    streamed = _streamcopy.copy_pieces(
        (dst.ctypes.data + 5 + offsets).astype(np.uint64),
        (src.ctypes.data + offsets).astype(np.uint64),
        np.array(PIECE_SIZES, dtype=np.uint64),
        0 if loop == "avx512" else -1,
    )
    assert streamed == (len(PIECE_SIZES) if loop == "avx512" else 0)
    assert np.array_equal(dst, want)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("shift", [1, 64, 4096 + 3, 40000, -1, -64, -(4096 + 3)])
def test_a_piece_that_overlaps_itself_is_copied_as_memmove_does(loop: str, shift: int) -> None:
    """The streamed loop copies four spans in lockstep, which overlapping bytes do not survive in
    either direction: such a piece is left to memmove, so both loops keep its semantics."""
    n = 70001
    buf = np.random.default_rng(1).integers(0, 256, n + 2 * 65536, dtype=np.uint8)
    s = 65536
    want = buf.copy()
    want[s + shift : s + shift + n] = buf[s : s + n].copy()
    addr = [np.array([buf.ctypes.data + off], dtype=np.uint64) for off in (s + shift, s)]
    streamed = _streamcopy.copy_pieces(*addr, np.array([n], dtype=np.uint64), 0 if loop == "avx512" else -1)
    assert np.array_equal(buf, want)
    assert streamed == 0


@needs_helper
@pytest.mark.parametrize("setting", ["plain", "PLAIN ", "auto", None, "fast"])
def test_the_environment_switch_forces_the_plain_loop_on_any_cpu(
    setting: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``KVCOMPOSE_COPY_LOOP=plain`` sends the helper's copies through memmove even where the CPU
    streams; any other value (a warning for an unknown one) leaves the loop to the CPU."""
    if setting is None:
        monkeypatch.delenv(COPY_LOOP_ENV, raising=False)
    else:
        monkeypatch.setenv(COPY_LOOP_ENV, setting)
    want = "plain" if setting and setting.strip().lower() == "plain" else "avx512" if STREAMS else "plain"
    assert copy_loop() == want
    monkeypatch.setattr(block_copy, "STREAM_MIN_BYTES", 0)
    engine = torch.randint(-128, 128, (4, 12, 4160), dtype=torch.int8)
    pool = torch.zeros((4, 24, 4160), dtype=torch.int8)
    ((_, dev),) = stack_regions([engine[i] for i in range(4)])
    ((_, host),) = stack_regions([pool[i] for i in range(4)])
    assert copy_blocks([(as_array(dev), as_array(host))], [9, 1, 7, 3], [0, 5, 2, 6], copy_loop()) == {want}
    assert torch.equal(host[[0, 5, 2, 6]], dev[[9, 1, 7, 3]])


def test_without_the_helper_the_loop_is_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copy, "_streamcopy", None)
    assert copy_loop() == "numpy"
    src, dst = torch.arange(40, dtype=torch.int8).view(4, 10), torch.zeros(4, 10, dtype=torch.int8)
    assert copy_blocks([(as_array(src), as_array(dst))], [3], [0], copy_loop()) == {"numpy"}
    assert torch.equal(dst[0], src[3])


@needs_helper
@pytest.mark.parametrize("setting", ["plain", "auto"])
def test_the_worker_reports_the_loops_its_transfers_used(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COPY_LOOP_ENV, setting)
    monkeypatch.setattr(block_copy, "STREAM_MIN_BYTES", 0)
    worker = _worker()
    # Read once, when the worker's copies were set up: a later change does not reach them.
    monkeypatch.setenv(COPY_LOOP_ENV, "auto" if setting == "plain" else "plain")
    assert worker.take_copy_loops() == set()
    worker.bind_connector_metadata(
        SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[1, 2, 5], store_cpu_blocks=[0, 1, 4])
    )
    worker.start_load_kv()
    worker.wait_for_save()
    worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
    assert worker.take_copy_loops() == {"avx512" if setting == "auto" and STREAMS else "plain"}
    assert worker.take_copy_loops() == set()  # taken
    worker.shutdown()
