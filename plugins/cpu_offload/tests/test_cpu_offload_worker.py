"""The portable worker moves real engine-layout KV blocks on CPU and reports like vLLM's worker."""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat
import sysconfig
import threading

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.simple_kv_offload.metadata import (
    SimpleCPUOffloadMetadata,
    SimpleCPUOffloadWorkerMetadata,
)
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

from kvcompose.testing.kv import EngineKV, fill_random, make_engine_kv
from kvcompose_cpu_offload import _streamcopy, block_copy
from kvcompose_cpu_offload.block_copy import as_array, contiguous_runs, copy_blocks, copy_loop, pieces, stack_regions
from kvcompose_cpu_offload.connector import SimpleCPUOffloadConnector
from kvcompose_cpu_offload.copy_threads import ThreadEvent
from kvcompose_cpu_offload.disk_backend import PortableDiskBackend, alloc_staging
from kvcompose_cpu_offload.host_backend import HostCopyBackend
from kvcompose_cpu_offload.host_memory import HUGE_PAGE
from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker, StepMetadata

CONNECTOR = {
    "kv_connector": "SimpleCPUOffloadConnector",
    "kv_connector_module_path": "kvcompose_cpu_offload.connector",
    "kv_role": "kv_both",
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8)


def _snapshot(kv: EngineKV) -> dict[str, torch.Tensor]:
    return {name: view.clone() for name, view in kv.kv_caches.items()}


def _store(worker: SimpleCPUOffloadWorker, event: int, gpu: list[int], cpu: list[int]) -> None:
    worker.bind_connector_metadata(
        SimpleCPUOffloadMetadata(store_event=event, store_gpu_blocks=gpu, store_cpu_blocks=cpu)
    )
    worker.start_load_kv()
    worker.wait_for_save()


def _load(worker: SimpleCPUOffloadWorker, event: int, cpu: list[int], gpu: list[int], reqs: list[str]) -> None:
    worker.bind_connector_metadata(
        SimpleCPUOffloadMetadata(
            load_event=event,
            load_gpu_blocks=gpu,
            load_cpu_blocks=cpu,
            load_event_to_reqs={event: reqs},
        )
    )
    worker.start_load_kv()
    worker.wait_for_save()


def _flush(worker: SimpleCPUOffloadWorker) -> None:
    # vLLM's preemption path: synchronise every event in flight.
    worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))


def _assert_moved(kv: EngineKV, before: dict[str, torch.Tensor], src: list[int], dst: list[int]) -> None:
    """Every layer's ``dst`` blocks now hold the ``src`` bytes; every other block is untouched."""
    for name, view in kv.kv_caches.items():
        for s, d in zip(src, dst):
            assert torch.equal(_bytes(view[d]), _bytes(before[name][s])), (name, s, d)
        for b in range(view.shape[0]):
            if b not in dst:
                assert torch.equal(_bytes(view[b]), _bytes(before[name][b])), (name, b)


# --------------------------------------------------------------------------- copy primitives


def test_contiguous_runs() -> None:
    assert contiguous_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert contiguous_runs([], []) == []
    with pytest.raises(ValueError):
        contiguous_runs([1], [])


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [([2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 6, 7]), ([9, 1, 7, 3], [0, 5, 2, 6])],
    ids=["runs", "scattered"],
)
def test_copy_blocks(src_ids: list[int], dst_ids: list[int]) -> None:
    src = torch.randint(-128, 128, (10, 96), dtype=torch.int8)
    dst = torch.zeros(8, 96, dtype=torch.int8)
    copy_blocks([(as_array(src), as_array(dst))], src_ids, dst_ids, copy_loop())
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[d], src[s])
    untouched = [b for b in range(8) if b not in dst_ids]
    assert not dst[untouched].any()


def _engine_and_pool(layers: int, blocks: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two layouts a host-tier copy joins, both layer-outermost (a layer's blocks back to
    back): the engine's, and the pool's with twice the blocks."""
    engine = torch.randint(-(2**15), 2**15, (layers, blocks, page // 2), dtype=torch.int16)
    pool = torch.zeros((layers, 2 * blocks, page // 2), dtype=torch.int16)
    return engine, pool


@pytest.mark.parametrize("pattern", ["scattered", "consecutive", "mixed"])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("path", ["streamed", "numpy"])
def test_copy_blocks_between_engine_and_pool_layouts_moves_exactly_the_blocks(
    pattern: str, direction: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # These transfers are below the size the helper is used from; the streamed path is forced.
    monkeypatch.setattr(block_copy, "STREAM_MIN_BYTES", 0 if path == "streamed" else 1 << 62)
    engine, pool = _engine_and_pool(layers=4, blocks=12, page=4160)  # not a multiple of 64: tails
    ((_, dev),) = stack_regions([engine[i] for i in range(4)])
    ((_, host),) = stack_regions([pool[i] for i in range(4)])
    ids = {"scattered": [9, 1, 7, 3], "consecutive": [2, 3, 4, 5], "mixed": [4, 5, 6, 0, 11]}[pattern]
    slots = [20, 3, 4, 5, 13][: len(ids)]
    if direction == "load":
        pool.copy_(torch.randint(-(2**15), 2**15, pool.shape, dtype=torch.int16))
        src, dst, src_ids, dst_ids = host, dev, slots, ids
    else:
        src, dst, src_ids, dst_ids = dev, host, ids, slots
    before = dst.clone()
    copy_blocks([(as_array(src), as_array(dst))], src_ids, dst_ids, copy_loop())
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(dst[d], src[s])
    untouched = [b for b in range(dst.shape[0]) if b not in dst_ids]
    assert torch.equal(dst[untouched], before[untouched])


def test_pieces_are_whole_blocks_or_layer_pages_and_runs_where_both_sides_allow() -> None:
    engine, pool = _engine_and_pool(layers=4, blocks=12, page=4096)
    ((_, dev),) = stack_regions([engine[i] for i in range(4)])
    ((_, host),) = stack_regions([pool[i] for i in range(4)])
    dst, src, sizes = pieces(as_array(dev), as_array(host), [2, 3, 4, 9], [0, 1, 2, 5])  # type: ignore[misc]
    assert sizes.tolist() == [3 * 4096, 4096] * 4  # both keep a layer's blocks together: a run a layer
    assert src.tolist() == sorted(src.tolist())  # read forwards: a layer's pieces, then the next layer's
    layer_stride = engine[1].data_ptr() - engine[0].data_ptr()
    assert int(src[2]) - int(src[0]) == layer_stride
    assert int(dst[2]) - int(dst[0]) == pool[1].data_ptr() - pool[0].data_ptr()
    # A block-outermost side (a block's layers back to back, as in the disk tier's file): a page a piece.
    staging = torch.zeros((24, 4, 2048), dtype=torch.int16)
    ((_, blocks_first),) = stack_regions([staging[:, i] for i in range(4)])
    dst, _, sizes = pieces(as_array(blocks_first), as_array(dev), [0, 1, 2], [2, 3, 4])  # type: ignore[misc]
    assert len(sizes) == 3 * 4 and set(sizes.tolist()) == {4096} and int(dst[1]) - int(dst[0]) == layer_stride
    whole = torch.zeros(8, 96, dtype=torch.int8)
    _, _, sizes = pieces(as_array(whole), as_array(whole.clone()), [0, 1], [4, 5])  # type: ignore[misc]
    assert sizes.tolist() == [2 * 96]
    assert pieces(as_array(whole), as_array(torch.zeros(8, 48, dtype=torch.int8)), [0], [0]) is None


def test_the_pool_stacks_as_the_engine_does_so_a_run_is_one_piece_a_layer() -> None:
    """The worker lays its pool out as the engine's evenly spaced layers are: a run of consecutive
    blocks on both sides is one contiguous copy per layer."""
    kv = make_engine_kv(num_layers=4, block_size=16, num_blocks=24)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    assert worker.gpu_kv_caches is not None and worker.cpu_kv_caches is not None
    names = list(worker.gpu_kv_caches)
    dev = stack_regions([worker.gpu_kv_caches[n] for n in names])
    host = stack_regions([worker.cpu_kv_caches[n] for n in names])
    assert [(i, v.shape[1]) for i, v in dev] == [(i, v.shape[1]) for i, v in host] == [(0, 4)]
    ((_, d),), ((_, h),) = dev, host
    page = worker.gpu_kv_caches[names[0]][0].nbytes
    _, _, sizes = pieces(as_array(d), as_array(h), [5, 6, 7, 8], [0, 1, 2, 3])  # type: ignore[misc]
    assert sizes.tolist() == [4 * page] * 4
    worker.shutdown()


def test_the_streaming_copy_is_built_here_and_refuses_mismatched_lists() -> None:
    # Built by `pip install` of the plugin wherever a C compiler is (this machine, CI); without it
    # copies fall back to numpy, at about 0.6x memcpy on the Xeon measured (docs/performance.md).
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}): the plugin installs without its streaming copy")
    assert _streamcopy is not None
    src = np.arange(5000, dtype=np.uint8)  # streamed and tail bytes
    dst = np.zeros(5000, dtype=np.uint8)
    addresses = [np.array([a.ctypes.data], np.uint64) for a in (dst, src)]
    _streamcopy.copy_pieces(*addresses, np.array([5000], np.uint64), 64)
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError, match="1 destinations and 2 sources for 1 sizes"):
        _streamcopy.copy_pieces(np.zeros(1, np.uint64), np.zeros(2, np.uint64), np.zeros(1, np.uint64), 0)
    with pytest.raises(ValueError, match="not whole uint64 entries"):
        _streamcopy.copy_pieces(b"123", b"123", b"123", 0)


def test_stack_regions_groups_evenly_spaced_layers_and_nothing_that_could_alias() -> None:
    raw = torch.arange(4 * 6 * 8, dtype=torch.int8)
    layers = [raw[i * 48 : (i + 1) * 48].view(6, 8) for i in range(4)]  # layer-outermost
    ((first, view),) = stack_regions(layers)
    assert first == 0 and view.shape == (6, 4, 8)
    assert all(torch.equal(view[:, i], layers[i]) for i in range(4))
    # Block-outermost: each block holds every layer's row in turn.
    interleaved = [raw.view(6, 4, 8)[:, i] for i in range(4)]
    ((_, view),) = stack_regions(interleaved)
    assert all(torch.equal(view[:, i], interleaved[i]) for i in range(4))
    # Uneven spacing, another allocation, or overlapping rows: groups of one.
    uneven = [layers[0], layers[1], layers[3]]
    assert [i for i, _ in stack_regions(uneven)] == [0, 2]
    other = [layers[0], torch.zeros(6, 8, dtype=torch.int8)]
    assert [i for i, _ in stack_regions(other)] == [0, 1]
    overlapping = [raw[i * 4 : i * 4 + 48].view(6, 8) for i in range(3)]
    assert [i for i, _ in stack_regions(overlapping)] == [0, 1, 2]


# --------------------------------------------------------------------------- host-memory tier


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
@pytest.mark.parametrize(("num_layers", "block_size"), [(1, 16), (2, 32), (4, 16)])
def test_store_then_load_into_other_blocks(layout: str, num_layers: int, block_size: int) -> None:
    kv = make_engine_kv(num_layers=num_layers, block_size=block_size, num_blocks=24, layout=layout)
    fill_random(kv, seed=num_layers * 100 + block_size)
    before = _snapshot(kv)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    assert worker.num_cpu_blocks >= 8

    src, host = [3, 4, 5, 11, 17], [0, 1, 2, 6, 7]
    _store(worker, 0, src, host)
    _flush(worker)  # the copy runs on the store thread
    # Stores are reported as vLLM's worker reports them: no finished ids, one count per event.
    assert worker.get_finished(set()) == (None, None)
    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, SimpleCPUOffloadWorkerMetadata)
    assert meta.completed_store_events == {0: 1}
    assert worker.build_connector_worker_meta() is None
    worker.clear_connector_metadata()

    dst = [20, 21, 22, 8, 1]
    _load(worker, 0, host, dst, ["req-a", "req-b"])
    _flush(worker)
    # Loads are reported by request id in finished_recving.
    assert worker.get_finished(set()) == (None, {"req-a", "req-b"})
    assert worker.build_connector_worker_meta() is None
    worker.clear_connector_metadata()
    _assert_moved(kv, before, src, dst)


def test_overlaid_groups_are_copied_once() -> None:
    """A full-attention and a sliding-window group share bytes; vLLM's derivation dedups them."""
    kv = make_engine_kv(num_layers=2, block_size=16, num_blocks=16, sliding_window=32)
    fill_random(kv, seed=7)
    before = _snapshot(kv)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    assert worker.gpu_kv_caches is not None and len(worker.gpu_kv_caches) == 2
    _store(worker, 0, [1, 2, 3], [4, 5, 6])
    _flush(worker)
    worker.get_finished(set())
    _load(worker, 0, [4, 5, 6], [10, 11, 12], ["r"])
    _flush(worker)
    assert worker.get_finished(set()) == (None, {"r"})
    _assert_moved(kv, before, [1, 2, 3], [10, 11, 12])


def test_events_complete_in_order_across_steps() -> None:
    """Several store and load events over steps; high-water marks advance as in vLLM."""
    kv = make_engine_kv(num_blocks=16)
    fill_random(kv, seed=3)
    before = _snapshot(kv)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    for event in range(3):
        _store(worker, event, [event + 1], [event])
        _flush(worker)
        assert worker.get_finished(set()) == (None, None)
        assert worker.build_connector_worker_meta().completed_store_events == {event: 1}
    _load(worker, 0, [0, 1, 2], [13, 14, 15], ["x"])
    _flush(worker)
    assert worker.get_finished(set()) == (None, {"x"})
    _assert_moved(kv, before, [1, 2, 3], [13, 14, 15])
    # A preemption flush with nothing in flight is a no-op, as in vLLM.
    worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))


def test_small_loads_and_small_stores_of_steps_without_a_forward_pass_are_copied_in_the_engine_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy of at most ``inline_copy_bytes`` is done in the engine's thread, and reported in
    that step, when no token waits on the step: a load, or a store in a step without a forward
    pass (``StepMetadata(forward=False)``), including one deferred from the step before. A store
    of a step with a forward pass runs on the store thread however small, and so does a larger
    copy. All move the same bytes."""
    kv = make_engine_kv(num_layers=2, block_size=16, num_blocks=24)
    fill_random(kv, seed=11)
    before = _snapshot(kv)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)
    block_bytes = sum(_bytes(view[0]).numel() for view in kv.kv_caches.values())
    monkeypatch.setattr(HostCopyBackend, "inline_copy_bytes", 2 * block_bytes)
    threads: list[str] = []
    for method in ("store", "load"):
        original = getattr(HostCopyBackend, method)

        def recorded(backend: HostCopyBackend, src: list[int], dst: list[int], _original=original) -> None:
            threads.append(threading.current_thread().name)
            _original(backend, src, dst)

        monkeypatch.setattr(HostCopyBackend, method, recorded)
    engine_thread = threading.current_thread().name

    def reported_stores() -> dict[int, int]:
        worker.get_finished(set())
        meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        return {} if meta is None else meta.completed_store_events

    for event, (gpu, cpu) in enumerate([([3], [0]), ([4, 5, 6, 7], [1, 2, 3, 4])]):
        _store(worker, event, gpu, cpu)
        _flush(worker)
        assert threads[-1] == "kv-offload-host-copy-store"
        assert reported_stores() == {event: 1}

    # A step without a forward pass: its small store is done in place, its large one is not.
    no_forward = StepMetadata(store_event=2, store_gpu_blocks=[8, 9], store_cpu_blocks=[5, 6], forward=False)
    worker.bind_connector_metadata(no_forward)
    worker.wait_for_save()
    assert threads[-1] == engine_thread and reported_stores() == {2: 1}
    worker.bind_connector_metadata(
        dataclasses.replace(no_forward, store_event=3, store_gpu_blocks=[10, 11, 15], store_cpu_blocks=[7, 8, 9])
    )
    worker.wait_for_save()
    _flush(worker)
    assert threads[-1] == "kv-offload-host-copy-store" and reported_stores() == {3: 1}
    # A store from a step with a forward pass, started by a step without one: in place.
    worker.bind_connector_metadata(StepMetadata(store_event=4, store_gpu_blocks=[16], store_cpu_blocks=[10]))
    worker.wait_for_save()
    assert len(threads) == 4 and reported_stores() == {}  # not started yet
    worker.bind_connector_metadata(StepMetadata(forward=False))
    assert threads[-1] == engine_thread
    worker.wait_for_save()
    assert reported_stores() == {4: 1}

    _load(worker, 0, [0, 1], [20, 21], ["small"])
    assert threads[-1] == engine_thread
    assert worker.get_finished(set()) == (None, {"small"})  # the same step: already complete
    worker.clear_connector_metadata()
    _load(worker, 1, [2, 3, 4], [12, 13, 14], ["large"])
    _flush(worker)
    assert threads[-1] == "kv-offload-host-copy-load"
    assert worker.get_finished(set()) == (None, {"large"})
    _assert_moved(kv, before, [3, 4, 5, 6, 7], [20, 21, 12, 13, 14])
    assert worker.cpu_kv_caches is not None and worker.gpu_kv_caches is not None
    for name, region in worker.gpu_kv_caches.items():  # those device blocks were left alone
        assert torch.equal(worker.cpu_kv_caches[name][[5, 6, 7, 8, 9, 10]], region[[8, 9, 10, 11, 15, 16]]), name
    worker.shutdown()


def test_an_in_place_load_error_surfaces_through_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed in-place load is reported as a thread's is: by the event, on the engine thread."""
    kv = make_engine_kv(num_blocks=16)
    worker = PortableSimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20)
    worker.register_kv_caches(kv.kv_caches)

    def broken(backend: HostCopyBackend, src: list[int], dst: list[int]) -> None:
        raise OSError("pool gone")

    monkeypatch.setattr(HostCopyBackend, "load", broken)
    _load(worker, 0, [0], [1], ["x"])
    with pytest.raises(RuntimeError, match="host copy load failed: pool gone"):
        worker.get_finished(set())
    worker.shutdown()


def test_vllm_worker_fails_here_and_the_connector_swaps_it() -> None:
    """Why this package exists: vLLM's own worker cannot register caches on the CPU platform."""
    # A 1 MiB pool: without it vLLM's default (8 GiB) is zeroed, which costs seconds and proves nothing here.
    small = {**CONNECTOR, "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20}}
    kv = make_engine_kv(num_blocks=8, kv_transfer_config=small)
    with pytest.raises(AttributeError, match="priority_range|Stream"):
        SimpleCPUOffloadWorker(kv.vllm_config, kv.kv_cache_config, 1 << 20).register_kv_caches(kv.kv_caches)
    connector = SimpleCPUOffloadConnector(kv.vllm_config, KVConnectorRole.WORKER, kv.kv_cache_config)
    assert isinstance(connector.worker_handler, PortableSimpleCPUOffloadWorker)
    stream_cls = torch.cuda.Stream
    connector.register_kv_caches(kv.kv_caches)
    # The stream stand-in used during registration is undone.
    assert torch.cuda.Stream is stream_cls
    connector.shutdown()


def test_num_cpu_blocks_sizes_both_sides_alike() -> None:
    """num_cpu_blocks (ignored by vLLM 0.32) gives the scheduler N blocks and the worker >= N."""
    extra = {"num_cpu_blocks": 37}
    kv = make_engine_kv(num_blocks=10, kv_transfer_config={**CONNECTOR, "kv_connector_extra_config": extra})
    sched = SimpleCPUOffloadConnector(kv.vllm_config, KVConnectorRole.SCHEDULER, kv.kv_cache_config)
    worker = SimpleCPUOffloadConnector(kv.vllm_config, KVConnectorRole.WORKER, kv.kv_cache_config)
    worker.register_kv_caches(kv.kv_caches)
    assert sched.scheduler_manager is not None and sched.scheduler_manager.num_cpu_blocks == 37
    assert isinstance(worker.worker_handler, PortableSimpleCPUOffloadWorker)
    assert worker.worker_handler.num_cpu_blocks == 37
    # The caller's config is not modified.
    assert kv.vllm_config.kv_transfer_config.kv_connector_extra_config == extra


# --------------------------------------------------------------------------- disk tier


def _disk_worker(kv: EngineKV, path: str, **kw: object) -> PortableSimpleCPUOffloadWorker:
    worker = PortableSimpleCPUOffloadWorker(
        kv.vllm_config,
        kv.kv_cache_config,
        0,
        kv_offload_backend="disk",
        disk_path=path,
        disk_capacity_bytes=1 << 22,
        **kw,  # type: ignore[arg-type]
    )
    worker.register_kv_caches(kv.kv_caches)
    return worker


@pytest.mark.parametrize(
    ("use_page_cache", "buffer_slots", "head_size", "block_size"),
    # 16 KiB blocks suit O_DIRECT; 512-byte ones need the page cache.
    [(False, 2, 32, 32), (True, 3, 8, 16), (True, 1, 32, 16)],
    ids=["o_direct", "page_cache", "one_slot"],
)
def test_disk_round_trip(
    tmp_path: os.PathLike[str],
    use_page_cache: bool,
    buffer_slots: int,
    head_size: int,
    block_size: int,
) -> None:
    kv = make_engine_kv(num_layers=2, block_size=block_size, num_kv_heads=1, head_size=head_size, num_blocks=16)
    fill_random(kv, seed=11)
    before = _snapshot(kv)
    path = os.path.join(tmp_path, "sub", "kv.bin")
    worker = _disk_worker(kv, path, use_page_cache=use_page_cache, disk_buffer_slots=buffer_slots)
    rank_file = path + ".rank_0"
    assert stat.S_IMODE(os.stat(rank_file).st_mode) == 0o600

    src, slots = [1, 2, 3, 9, 12], [7, 8, 9, 0, 3]
    _store(worker, 0, src, slots)
    _flush(worker)
    assert worker.get_finished(set()) == (None, None)
    assert worker.build_connector_worker_meta().completed_store_events == {0: 1}
    worker.clear_connector_metadata()

    dst = [13, 14, 15, 4, 5]
    _load(worker, 0, slots, dst, ["d"])
    _flush(worker)
    assert worker.get_finished(set()) == (None, {"d"})
    _assert_moved(kv, before, src, dst)

    worker.shutdown()
    assert not os.path.exists(rank_file)


def test_disk_staging_buffers_sit_on_huge_page_boundaries() -> None:
    """O_DIRECT needs aligned buffers; a huge-page boundary is one, and lets the kernel back the
    buffer with huge pages where it grants them."""
    a, b = alloc_staging(3, 8192), alloc_staging(1, 3 * 4096)
    assert a.shape == (3, 8192) and a.dtype == np.int8 and a.flags.c_contiguous
    assert a.ctypes.data % HUGE_PAGE == 0 and b.ctypes.data % HUGE_PAGE == 0
    assert not a.any()
    a[2, -1] = 7  # writable, and apart from the other buffer
    assert a[2, -1] == 7 and not b.any()


def test_disk_o_direct_rejects_unaligned_blocks(tmp_path: os.PathLike[str]) -> None:
    kv = make_engine_kv(num_layers=2, block_size=16, num_kv_heads=1, head_size=8, num_blocks=8)
    with pytest.raises(ValueError, match="use_page_cache"):
        _disk_worker(kv, os.path.join(tmp_path, "kv.bin"))


def test_disk_io_error_surfaces_on_the_engine_thread(tmp_path: os.PathLike[str]) -> None:
    kv = make_engine_kv(num_layers=1, block_size=16, head_size=16, num_blocks=8)
    worker = _disk_worker(kv, os.path.join(tmp_path, "kv.bin"), use_page_cache=True)
    backend = worker._backend
    assert isinstance(backend, PortableDiskBackend)
    os.close(backend._fd)  # the next pwritev fails with EBADF
    _store(worker, 0, [1], [0])
    with pytest.raises(RuntimeError, match="disk store failed"):
        _flush(worker)
    backend._fd = -1  # already closed above
    backend.shutdown()


def test_events() -> None:
    ev = ThreadEvent("load")
    assert ev.query() is False
    ev.set_done()
    assert ev.query() is True
    ev.synchronize()
    bad = ThreadEvent("store")
    bad.set_done(OSError("disk full"))
    with pytest.raises(RuntimeError, match="store failed: disk full"):
        bad.query()


@pytest.mark.parametrize(
    ("page_cache", "offset", "helper"),
    [(True, 64, True), (False, 0, True), (False, 64, True), (False, 64, False)],
    ids=["in_place", "staged_aligned", "staged", "staged_by_numpy"],
)
def test_disk_file_layout_is_vllms_whether_in_place_or_staged(
    tmp_path: os.PathLike[str], page_cache: bool, offset: int, helper: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slot ``k`` of the file holds every region's block in order (vLLM's format), and loads bring
    it back, whether the blocks are written from the KV cache itself (through the page cache) or
    through staging buffers (``O_DIRECT``; filled by the compiled helper, or by numpy in a build
    without one). Regions of unequal block sizes, off a 4 KiB boundary: only a slot of all of
    them must be a multiple of it."""
    if not helper:
        monkeypatch.setattr(block_copy, "_streamcopy", None)
    nb, sizes = 8, [4096, 1024, 3072]
    raw = torch.randint(-128, 128, (nb * sum(sizes) + 2 * 4096,), dtype=torch.int8)
    start = -raw.data_ptr() % 4096 + offset
    regions = {}
    for i, bpb in enumerate(sizes):
        regions[f"r{i}"] = raw[start : start + nb * bpb].view(nb, bpb)
        start += nb * bpb
    before = {n: r.clone() for n, r in regions.items()}
    path = os.path.join(tmp_path, "kv.bin")
    backend = PortableDiskBackend()
    slot = sum(sizes)
    backend.init(regions, path, 6, slot, num_buffer_slots=2, use_page_cache=page_cache)
    events: list[tuple[int, object]] = []
    backend.launch_copy([5, 1, 2, 7], [3, 0, 1, 4], True, 0, events)
    events[-1][1].synchronize()  # type: ignore[attr-defined]
    data = open(path, "rb").read()
    for blk, k in zip([5, 1, 2, 7], [3, 0, 1, 4]):
        want = b"".join(before[f"r{i}"][blk].numpy().tobytes() for i in range(len(sizes)))
        assert data[k * slot : (k + 1) * slot] == want, (blk, k)
    for r in regions.values():
        r.fill_(0)
    backend.launch_copy([4, 3, 0], [2, 6, 0], False, 1, events)
    events[-1][1].synchronize()  # type: ignore[attr-defined]
    for n, r in regions.items():
        assert torch.equal(r[[2, 6, 0]], before[n][[7, 5, 1]]), n
        assert not r[[1, 3, 4, 5, 7]].any(), n
    backend.shutdown()
