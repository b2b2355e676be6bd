"""The native-offload portable worker: pinned to vLLM's surface it stands in for, and moving real
engine-layout KV blocks through vLLM's own ``OffloadingConnector`` worker path byte for byte."""

from __future__ import annotations

import ast
import glob
import inspect
import os
import textwrap
import time
from typing import Any

import numpy as np
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu import gpu_worker
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvcompose.testing.kv import EngineKV, fill_random, make_engine_kv
from kvcompose_cpu_offload import native
from kvcompose_cpu_offload.native import (
    PortableCPUOffloadingSpec,
    PortableCPUOffloadingWorker,
    PortableOffloadingHandler,
    PortableTieringOffloadingSpec,
)


def _config(block_size: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "PortableCPUOffloadingSpec",
            "spec_module_path": "kvcompose_cpu_offload.native",
            "cpu_bytes_to_use": 1 << 22,
            "block_size": block_size,
            **extra,
        },
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8)  # random bytes hold NaNs as floats: compare bytes


def _worker(kv: EngineKV) -> tuple[OffloadingConnector, OffloadingWorker]:
    """vLLM's OffloadingConnector in the worker role, its KV caches registered as the model runner does."""
    connector = OffloadingConnector(kv.vllm_config, KVConnectorRole.WORKER, kv.kv_cache_config)
    connector.register_kv_caches(kv.kv_caches)
    assert connector.connector_worker is not None and connector.connector_worker.worker is not None
    return connector, connector.connector_worker.worker


def _results(worker: OffloadingWorker, count: int) -> list[TransferResult]:
    out: list[TransferResult] = []
    deadline = time.monotonic() + 10
    while len(out) < count and time.monotonic() < deadline:
        out += worker.get_finished()
        time.sleep(0.001)
    return out


# --- pins: the surface the portable path replaces -----------------------------------------


def test_spec_is_found_through_vllms_factory() -> None:
    extra = _config()["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra) is PortableCPUOffloadingSpec
    tiering = {**extra, "spec_name": "PortableTieringOffloadingSpec"}
    assert OffloadingSpecFactory.get_spec_cls(tiering) is PortableTieringOffloadingSpec
    assert issubclass(PortableCPUOffloadingSpec, CPUOffloadingSpec)
    assert issubclass(PortableTieringOffloadingSpec, TieringOffloadingSpec)


def test_vllms_worker_refuses_this_platform() -> None:
    """What the portable spec replaces: vLLM's get_worker raises off CUDA/XPU (cpu/spec.py)."""
    assert not native.vllm_worker_runs_here()
    with pytest.raises(Exception, match="only supported on CUDA-alike and XPU"):
        _worker(make_engine_kv(kv_transfer_config=_config(spec_name="CPUOffloadingSpec")))


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_worker_contract_is_vllms() -> None:
    abstract = {n for n, f in vars(OffloadingWorker).items() if getattr(f, "__isabstractmethod__", False)}
    assert abstract == {"submit_store", "submit_load", "get_finished", "wait"}
    assert issubclass(PortableCPUOffloadingWorker, CPUOffloadingWorker)
    assert _params(PortableCPUOffloadingWorker.__init__) == _params(CPUOffloadingWorker.__init__)
    # Everything but __init__ is vLLM's own code.
    for name in ("submit_store", "submit_load", "get_finished", "wait", "shutdown"):
        assert name not in vars(PortableCPUOffloadingWorker), name
    own = set(vars(PortableOffloadingHandler)) - {"__module__", "__doc__", "__qualname__", "__firstlineno__"}
    assert own <= {"__init__", "_queue_copy", "transfer_async", "take_copy_loops", "shutdown", "__static_attributes__"}
    assert _params(PortableOffloadingHandler.__init__)[:-1] == _params(SingleDirectionOffloadingHandler.__init__)[:-1]
    # host_memory_is_pinned: vLLM's default True (pinned, GPU-readable); host memory here is not.
    assert _params(SingleDirectionOffloadingHandler.__init__)[-1] == ("host_memory_is_pinned", True)


def _self_assignments(fn: Any) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_handler_sets_every_attribute_vllms_init_sets() -> None:
    """PortableOffloadingHandler.__init__ stands in for vLLM's (whose is_cuda assertion no CPU
    tensor passes): it must set every attribute vLLM's sets, or vLLM's inherited methods break."""
    vllm_attrs = _self_assignments(SingleDirectionOffloadingHandler.__init__)
    assert vllm_attrs, "vLLM's handler __init__ changed shape"
    assert vllm_attrs <= _self_assignments(PortableOffloadingHandler.__init__)
    worker_attrs = _self_assignments(CPUOffloadingWorker.__init__)
    assert worker_attrs <= _self_assignments(PortableCPUOffloadingWorker.__init__)


def test_transfer_async_takes_stream_and_events_from_its_pools() -> None:
    """The hook the portable handler uses: vLLM's transfer_async reuses pooled streams/events
    and copies through ``self._swap_blocks_batch`` inside ``current_platform.stream``."""
    src = inspect.getsource(SingleDirectionOffloadingHandler.transfer_async)
    for needle in (
        "self._stream_pool.pop() if self._stream_pool",
        "self._event_pool.pop()",
        "current_platform.stream(stream)",
        "self._swap_blocks_batch(",
        "stream.wait_stream(current_platform.current_stream())",
        "start_event.record(stream)",
        "end_event.record(stream)",
    ):
        assert needle in src, needle
    finished = inspect.getsource(SingleDirectionOffloadingHandler.get_finished)
    assert "end_event.query()" in finished and "elapsed_time" in finished
    assert "assert gpu_tensor.is_cuda or gpu_tensor.is_xpu" in inspect.getsource(
        SingleDirectionOffloadingHandler.__init__
    )
    assert hasattr(gpu_worker, "_build_copy_plan") and hasattr(gpu_worker, "_canonical_block_sizes")


def test_extra_config_keys_vllm_reads() -> None:
    spec_src = inspect.getsource(CPUOffloadingSpec)
    for key in ("cpu_bytes_to_use", "eviction_policy", "store_threshold"):
        assert f'"{key}"' in spec_src, key
    assert '"secondary_tiers"' in inspect.getsource(TieringOffloadingSpec)
    fs = inspect.signature(FileSystemTierManager.__init__).parameters
    assert {"root_dir", "n_read_threads", "n_write_threads"} <= set(fs)
    assert fs["root_dir"].default is inspect.Parameter.empty


# --- bytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("offload_block_size", [16, 32, 64])
def test_store_then_load_into_other_blocks_byte_equal(offload_block_size: int) -> None:
    """Store device blocks 3..7 of a request (its blocks 1..5: the first chunk only partly
    matched when a chunk holds several blocks), load them back into blocks 11..15, compare bytes."""
    kv = make_engine_kv(kv_transfer_config=_config(offload_block_size), block_size=16)
    fill_random(kv)
    connector, worker = _worker(kv)
    assert isinstance(worker, PortableCPUOffloadingWorker)
    before = kv.snapshot()
    per_chunk = offload_block_size // 16
    src, dst, first = [3, 4, 5, 6, 7], [11, 12, 13, 14, 15], 1
    chunks = list(range(2, 2 + (first % per_chunk + len(src) + per_chunk - 1) // per_chunk))
    assert worker.submit_store(1, GPULoadStoreSpec(src, [len(src)], [first]), CPULoadStoreSpec(chunks))
    # As vLLM's scheduler does: a chunk is loaded only once its store is reported (stores and
    # loads run on separate streams / copy threads, unordered against each other).
    worker.wait({1})
    assert worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(dst, [len(dst)], [first]))
    worker.wait({2})
    results = _results(worker, 2)
    block_bytes = sum(v[0].numel() * v.element_size() for v in kv.kv_caches.values())
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [
        (1, True, len(src) * block_bytes),
        (2, True, len(src) * block_bytes),
    ]
    assert all(r.transfer_time is not None and r.transfer_time >= 0 for r in results)
    for name, view in kv.kv_caches.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(_bytes(view[d]), _bytes(before[name][s])), (name, s, d)
        for b in range(view.shape[0]):
            if b not in dst:
                assert torch.equal(_bytes(view[b]), _bytes(before[name][b])), (name, b)
    assert worker.take_copy_loops()
    connector.shutdown()


def test_loads_wait_for_earlier_transfers_and_results_come_in_order() -> None:
    """vLLM chains each transfer's stream behind the previous one's end event (per direction):
    later loads into the same block land after earlier ones, and results keep job order."""
    kv = make_engine_kv(kv_transfer_config=_config(16), block_size=16)
    fill_random(kv)
    connector, worker = _worker(kv)
    before = kv.snapshot()
    for job in range(1, 21):
        assert worker.submit_store(job, GPULoadStoreSpec([job % 20 + 1], [1], [0]), CPULoadStoreSpec([job]))
    worker.wait(set(range(1, 21)))
    for job in range(21, 41):
        assert worker.submit_load(job, CPULoadStoreSpec([job - 20]), GPULoadStoreSpec([(job - 20) % 3 + 21], [1], [0]))
    results = _results(worker, 40)
    stores = [r.job_id for r in results if r.job_id <= 20]
    loads = [r.job_id for r in results if r.job_id > 20]
    assert stores == list(range(1, 21)) and loads == list(range(21, 41))
    # block 21 + k was last written by the load of chunk 18 + k (k = 0, 1, 2)
    for name, view in kv.kv_caches.items():
        for k in range(3):
            chunk = 18 + k if 18 + k <= 20 else k
            assert torch.equal(_bytes(view[21 + k]), _bytes(before[name][chunk % 20 + 1])), (name, k)
    connector.shutdown()


def test_tiering_spec_worker_stores_where_the_secondary_tiers_read(tmp_path: Any) -> None:
    """With a secondary tier the worker's host tensors are views of vLLM's shared region: a block
    the worker stores into chunk 3 is in chunk 3 of the scheduler side's view of that region, which
    is what every secondary tier reads (``TieringOffloadingManager`` hands ``view[c]`` to them);
    chunk 4, never stored, holds none of it. A load from chunk 3 brings the block back. Once the
    scheduler side has mapped the region (the engine's order: workers first), its file in
    ``/dev/shm`` is gone, so no exit of the engine leaves it behind; the mappings still share it."""
    cfg = _config(
        16,
        spec_name="PortableTieringOffloadingSpec",
        secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}],
    )
    kv = make_engine_kv(kv_transfer_config=cfg, block_size=16)
    fill_random(kv)
    others = set(glob.glob("/dev/shm/vllm_offload_*.mmap"))
    connector, worker = _worker(kv)
    assert isinstance(worker, PortableCPUOffloadingWorker)
    spec = connector.connector_worker.spec  # type: ignore[union-attr]
    before = kv.snapshot()
    assert worker.submit_store(1, GPULoadStoreSpec([5], [1], [0]), CPULoadStoreSpec([3]))
    worker.wait({1})
    mine = set(glob.glob("/dev/shm/vllm_offload_*.mmap")) - others  # the worker's region, by name
    assert len(mine) == 1, mine
    manager = spec.get_manager()  # the scheduler side: its own mapping of the region
    assert not any(os.path.exists(path) for path in mine), "the region's name outlives the engine"
    view = manager.primary_tier.get_kv_memoryview()
    rows = np.asarray(view)  # (chunks, bytes a chunk), as the tiers index it
    stored, untouched = rows[3].tobytes(), rows[4].tobytes()
    for name in kv.kv_caches:
        block = _bytes(before[name][5]).numpy().tobytes()
        assert block in stored and block not in untouched, name
    assert worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([9], [1], [0]))
    assert len(_results(worker, 2)) == 2
    for name, view_ in kv.kv_caches.items():
        assert torch.equal(_bytes(view_[9]), _bytes(before[name][5])), name
    manager.shutdown()
    connector.shutdown()
