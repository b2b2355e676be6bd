"""The host-buffer setting (``WorkerHarness(cfg, **host_buffer_setting())``), pinned to vLLM's surface.

vLLM's NIXL worker turns its host-buffer path off on the CPU platform, and vLLM's copy op cannot
copy there (:mod:`kvcompose_nixl.testing.host_buffer` names the lines). The kit changes the platform
seen by the three modules that decide it, and nothing else. These tests fail when vLLM moves or
changes what the kit relies on: the decision, the modules that read the platform, the copy
functions the stand-in carries. Then the setting is exercised with the fake NIXL agent (fast, one
process); ``plugins/nixl/tests/test_nixl_host_buffer.py`` runs it with real agents in two
processes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
import vllm.distributed.kv_transfer.kv_connector.utils as kv_utils
import vllm.platforms
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import connector as nixl_connector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import _NIXL_SUPPORTED_DEVICE

from kvcompose.testing.copy_op import CopyLog
from kvcompose.testing.harness import assert_scheduler_empty, make_request, prefill_request
from kvcompose.testing.kv import fill_random
from kvcompose.testing.worker import WorkerHarness
from kvcompose_nixl.testing.fake_nixl import FakeNixl, nixl_worker
from kvcompose_nixl.testing.host_buffer import (
    BLOCK_COPIES,
    COPIES_FROM,
    DEVICE_TYPE,
    PLATFORM_READERS,
    HostBufferPlatform,
    host_buffer_platform,
    host_buffer_setting,
    vllm_block_copies,
)

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks
NIXL_PACKAGE = Path(base_worker.__file__).parent


def flat(obj: object) -> str:
    """An object's source with whitespace collapsed, so a pin survives reformatting only."""
    return " ".join(inspect.getsource(obj).split())  # type: ignore[arg-type]


# ---------------------------------------------------------------------- vLLM's surface


def test_vllm_decides_the_host_buffer_from_the_platforms_device_type() -> None:
    worker = flat(base_worker.NixlBaseConnectorWorker.__init__)
    assert "self.device_type = current_platform.device_type" in worker
    assert (
        'if self.device_type == "cpu": self.use_host_buffer = False '
        'else: self.use_host_buffer = self.kv_buffer_device == "cpu"' in worker
    )
    scheduler = flat(base_scheduler.NixlBaseConnectorScheduler.__init__)
    assert 'if current_platform.device_type == "cpu": self.use_host_buffer = False' in scheduler
    assert 'vllm_config.kv_transfer_config.kv_buffer_device == "cpu"' in scheduler
    ops = flat(base_worker.NixlBaseConnectorWorker.set_host_xfer_buffer_ops)
    assert 'if self.device_type == "cpu": return' in ops and "self.copy_blocks = copy_operation" in ops
    # The stand-in's device type takes the host buffer, and only it.
    assert _NIXL_SUPPORTED_DEVICE[DEVICE_TYPE] == ("cpu",)


def test_vllm_copies_through_the_op_on_both_sides() -> None:
    save = flat(nixl_connector.NixlPullConnector.wait_for_save)
    assert (
        "if self.connector_worker.use_host_buffer and self.connector_worker.copy_blocks: "
        "self.connector_worker.save_kv_to_host(self._connector_metadata)" in save
    )
    assert "self.copy_blocks( self.device_kv_caches, self.host_xfer_buffers," in flat(
        base_worker.NixlBaseConnectorWorker.save_kv_to_host
    )
    assert "self.copy_blocks( self.host_xfer_buffers, self.device_kv_caches," in flat(
        base_worker.NixlBaseConnectorWorker.sync_recved_kv_to_device
    )
    copy = flat(kv_utils.copy_kv_blocks)
    assert "copy_fn = current_platform.insert_blocks_to_device" in copy
    assert "copy_fn = current_platform.swap_out_blocks_to_host" in copy


def _reads_platform_in_functions(path: Path) -> bool:
    """Whether code inside a function of ``path`` reads ``current_platform`` (not module level)."""
    tree = ast.parse(path.read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return any(isinstance(n, ast.Name) and n.id == "current_platform" for f in funcs for n in ast.walk(f))


def test_the_stand_in_reaches_every_module_of_the_path_that_reads_the_platform() -> None:
    """If vLLM reads the platform in another module of its NIXL connector, the kit must follow."""
    readers = {
        f"{base_worker.__package__}.{path.stem}"
        for path in NIXL_PACKAGE.glob("*.py")
        if _reads_platform_in_functions(path)
    }
    assert readers | {kv_utils.__name__} == set(PLATFORM_READERS)
    assert _reads_platform_in_functions(Path(kv_utils.__file__))
    for name in PLATFORM_READERS:
        assert importlib.import_module(name).current_platform is vllm.platforms.current_platform


def test_the_stand_ins_block_copies_are_the_cuda_platforms_classmethods() -> None:
    """Compiled from ``vllm/platforms/cuda.py`` (which does not import without CUDA): vLLM's code."""
    spec = importlib.util.find_spec(COPIES_FROM)
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name in BLOCK_COPIES}
    for name in BLOCK_COPIES:  # classmethods: the stand-in binds its class as their first argument
        assert [ast.unparse(d) for d in defs[name].decorator_list] == ["classmethod"], name
        assert defs[name].args.args[0].arg == "cls", name
    with host_buffer_platform() as stand_in:
        for name in BLOCK_COPIES:
            code = getattr(stand_in, name).__func__.__code__
            assert (code.co_filename, code.co_firstlineno) == (spec.origin, defs[name].lineno), name


def test_block_copies_missing_from_vllm_are_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"expected one definition each of \['no_such_copy'\] in .*cuda.py"):
        vllm_block_copies(names=("no_such_copy",))


def test_vllms_copy_op_cannot_copy_on_the_cpu_platform() -> None:
    """The failure the stand-in works around (kv_connector/utils.py:235-241): the CPU platform
    answers ``None`` for the block copies. When this stops failing, the stand-in can drop them."""
    src = {"l": torch.arange(8.0).view(4, 2)}
    dst = {"l": torch.zeros(4, 2)}
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        kv_utils.copy_kv_blocks(src, dst, [1], [2], "d2h")


# ---------------------------------------------------------------------- the stand-in


def test_the_stand_in_is_vllms_platform_but_for_device_type_and_the_copies() -> None:
    real = vllm.platforms.current_platform
    with host_buffer_platform() as stand_in:
        assert isinstance(stand_in, HostBufferPlatform)
        assert all(importlib.import_module(n).current_platform is stand_in for n in PLATFORM_READERS)
        assert stand_in.device_type == DEVICE_TYPE != real.device_type
        assert stand_in.get_nixl_memory_type() == real.get_nixl_memory_type()
        assert stand_in.is_rocm() is False and stand_in.device_name == real.device_name
        src = {"l": torch.arange(12.0).view(6, 2)}
        dst = {"l": torch.full((6, 2), -1.0)}
        kv_utils.copy_kv_blocks(src, dst, [1, 4], [2, 5], "d2h")
        kv_utils.copy_kv_blocks(src, dst, [0], [0], "h2d")
        assert dst["l"].tolist() == [[0, 1], [-1, -1], [2, 3], [-1, -1], [-1, -1], [8, 9]]
    assert all(importlib.import_module(n).current_platform is real for n in PLATFORM_READERS)


def test_overlapping_blocks_restore_vllms_platform_when_the_last_closes() -> None:
    real = vllm.platforms.current_platform
    outer, inner = host_buffer_platform(), host_buffer_platform()
    first = outer.__enter__()
    assert inner.__enter__() is first
    outer.__exit__(None, None, None)  # the first opened closes first: the other still needs it
    assert base_worker.current_platform is first
    inner.__exit__(None, None, None)
    assert base_worker.current_platform is real


def test_copy_log_counts_what_vllms_op_copied() -> None:
    log = CopyLog()
    with host_buffer_platform():
        device = {"a": torch.randn(4, 8), "b": torch.randn(4, 8)}
        host = {name: torch.zeros_like(t) for name, t in device.items()}
        log(device, host, [1, 3], [1, 3], "d2h")
    assert [(c.direction, c.blocks, c.nbytes) for c in log.copies] == [("d2h", (1, 3), 2 * 2 * 8 * 4)]
    assert log.blocks("d2h") == [1, 3] and log.blocks("h2d") == [] and log.nbytes("d2h") == 128
    assert all(torch.equal(host[n][[1, 3]], device[n][[1, 3]]) and not host[n][[0, 2]].any() for n in device)


# ---------------------------------------------------------------------- the harness setting

PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}


def _registered(fake: FakeNixl, h: WorkerHarness) -> set[int]:
    """Base addresses the harness's NIXL agent registered."""
    (agent,) = [a for a in fake.agents.values() if a.name == nixl_worker(h).nixl_wrapper.name]
    return {addr for regs in agent.registered for addr, _, _ in regs}


@pytest.mark.parametrize("host_buffer", [True, False])
def test_the_setting_turns_vllms_host_buffer_path_on_and_only_it(fake_nixl: FakeNixl, host_buffer: bool) -> None:
    h = WorkerHarness(PRODUCER, block_size=BLOCK, **(host_buffer_setting() if host_buffer else {}))
    try:
        w = nixl_worker(h)
        assert w.use_host_buffer is host_buffer
        assert h.scheduler.connector.connector_scheduler.use_host_buffer is host_buffer
        kv = {t.untyped_storage().data_ptr() for t in h.kv_caches.values()}
        if host_buffer:
            assert w.copy_blocks is h.copy_op and isinstance(h.copy_op, CopyLog)
            assert h.host_buffer_ops_to == [type(h.connector).__name__]  # NixlPullConnector: the connector itself
            buffers = {t.untyped_storage().data_ptr() for t in w.host_xfer_buffers.values()}
            assert _registered(fake_nixl, h) == buffers and buffers.isdisjoint(kv)  # NIXL sees host buffers only
        else:
            assert w.copy_blocks is None and not w.host_xfer_buffers and h.host_buffer_ops_to is None
            assert _registered(fake_nixl, h) == kv
    finally:
        h.shutdown()
    assert base_worker.current_platform is vllm.platforms.current_platform


def composition(role: str, port: int) -> str:
    """``pd`` (NIXL over host buffers) and a host tier beside it."""
    nixl = f"{{buffer_device: cpu, side_channel_host: 127.0.0.1, side_channel_port: {port}}}"
    return (
        "version: 1\nconnectors:\n"
        f"  - {{name: pd, type: nixl, role: {role}, options: {nixl}}}\n"
        "  - {name: host, type: cpu-offload, options: {cpu_bytes: 4MiB}}\n"
    )


def test_pd_read_through_host_buffers_with_a_host_tier_beside_nixl(fake_nixl: FakeNixl) -> None:
    """The path in one process with the fake agent: prefill saves device -> host buffer, the read
    copies host buffer to host buffer, decode copies host -> device; the copy op goes to ``pd``
    only, on both sides. Every byte of every pulled block is checked."""
    p, d = fake_nixl.pair(composition("producer", 5651), composition("consumer", 5652), num_blocks=24, host_buffer=True)
    assert p.host_buffer_ops_to == d.host_buffer_ops_to == ["pd"]
    prompt = [3 + (i * 37) % 490 for i in range(3 * BLOCK)]
    p.scheduler.add_request(prefill_request(len(prompt), block_size=BLOCK, prompt=prompt, request_id="P"))
    _, eco = p.engine_step(write_blocks=True)
    (params,) = [o.kv_transfer_params for outs in eco.values() for o in outs.outputs]
    (remote,) = params["remote_block_ids"]
    assert isinstance(p.copy_op, CopyLog) and p.copy_op.blocks("d2h") == list(remote)
    fill_random(d.kv, seed=2)
    d.scheduler.add_request(
        make_request(len(prompt), block_size=BLOCK, prompt=prompt, request_id="D", kv_transfer_params=params)
    )
    released: set[str] = set()

    def loaded(_: object) -> bool:
        p.engine_step()  # the prefill answers the read (its blocks were held for it) and frees them
        released.update(p.last_output.finished_sending or ())
        return d.last_output is not None and "D" in (d.last_output.finished_recving or ())

    d.step_until(loaded, "no load")
    assert not d.last_output.failed_recving
    (ids,) = d.scheduler.kv_cache_manager.get_block_ids("D")
    assert isinstance(d.copy_op, CopyLog) and d.copy_op.blocks("h2d") == list(ids)
    assert d.copy_op.nbytes("h2d") == p.copy_op.nbytes("d2h")
    for k, b in enumerate(ids):
        assert d.holds_prefix(b, prompt[: (k + 1) * BLOCK]), k
        assert d.holds_prefix(b, prompt[: (k + 1) * BLOCK], host_buffer=True), k
    d.step_until(lambda _: not d.scheduler.requests, "decode did not finish", eos=True)
    d.drain()
    assert_scheduler_empty(d.scheduler)
    assert released == {"P"}
