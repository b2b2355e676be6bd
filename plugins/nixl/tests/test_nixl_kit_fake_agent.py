"""The fake NIXL agent follows the real nixl_agent and vLLM's NIXL worker, and drives that worker."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from kvcompose_nixl.testing.fake_nixl import PATCH_TARGET, FakeNixl, FakeNixlAgent, FakeNixlError


def _vllm_nixl_calls() -> set[str]:
    """Every attribute vLLM's NIXL worker code calls on ``self.nixl_wrapper`` (AST walk)."""
    import vllm.distributed.kv_transfer.kv_connector.v1.nixl as pkg

    called: set[str] = set()
    for path in Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "nixl_wrapper"
            ):
                called.add(node.attr)
    assert called, "vLLM's NIXL code no longer calls self.nixl_wrapper: update the kit's fake"
    return called


def test_fake_covers_every_call_vllm_makes() -> None:
    missing = {c for c in _vllm_nixl_calls() if not callable(getattr(FakeNixlAgent, c, None))}
    assert not missing, f"vLLM's NIXL worker calls {sorted(missing)}, which the fake lacks"


def test_fake_signatures_match_the_real_agent() -> None:
    nixl_api = pytest.importorskip("nixl._api")
    real = nixl_api.nixl_agent
    public = {n for n, f in inspect.getmembers(FakeNixlAgent, inspect.isfunction) if not n.startswith("_")}
    ours = public - {"called"}  # the fake's own inspection helper
    for name in sorted(ours | {"__init__"}):
        assert hasattr(real, name), f"nixl_agent has no {name}: the fake follows a NIXL that is not installed"
        real_params = list(inspect.signature(getattr(real, name)).parameters.values())
        fake_params = [
            p
            for p in inspect.signature(getattr(FakeNixlAgent, name)).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY
        ]
        assert [(p.name, p.default) for p in fake_params] == [(p.name, p.default) for p in real_params], name


def test_fake_has_the_real_agents_memory_types() -> None:
    nixl_api = pytest.importorskip("nixl._api")
    real = nixl_api.nixl_agent("kit-memory-types", nixl_api.nixl_agent_config(backends=[]))
    assert FakeNixl().agent_class()("fake").nixl_mems == real.nixl_mems


def test_patch_target_is_what_vllm_instantiates() -> None:
    import importlib

    module, _, attr = PATCH_TARGET.rpartition(".")
    src = inspect.getsource(importlib.import_module(module))
    assert f"nixl_wrapper_cls = {attr}" in src


def _pair(fake: FakeNixl) -> tuple[FakeNixlAgent, FakeNixlAgent, torch.Tensor, torch.Tensor]:
    cls = fake.agent_class()
    p, d = cls("prefill"), cls("decode")
    src = torch.arange(64, dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.int32)
    p.register_memory(p.get_reg_descs(src, "DRAM"))
    d.register_memory(d.get_reg_descs(dst, "DRAM"))
    d.add_remote_agent(p.get_agent_metadata())
    blocks = lambda t: [(t.data_ptr() + i * 64, 64, 0) for i in range(4)]  # noqa: E731
    local = d.prep_xfer_dlist("NIXL_INIT_AGENT", d.get_xfer_descs(blocks(dst), "DRAM"))
    remote = d.prep_xfer_dlist("prefill", d.get_xfer_descs(blocks(src), "DRAM"))
    return p, d, src, dst, local, remote  # type: ignore[return-value]


def test_read_moves_bytes_after_the_configured_cycles_and_notifies() -> None:
    fake = FakeNixl(cycles_before_done=2)
    p, d, src, dst, local, remote = _pair(fake)  # type: ignore[misc]
    h = d.make_prepped_xfer("READ", local, [0, 1], remote, [3, 2], b"req-1")
    states = [d.transfer(h)] + [d.check_xfer_state(h) for _ in range(3)]
    assert states == ["PROC", "PROC", "PROC", "DONE"]
    assert torch.equal(dst[:32], torch.cat([src[48:64], src[32:48]]))
    assert p.get_new_notifs() == {"decode": [b"req-1"]}
    assert d.get_xfer_telemetry(h).totalBytes == 128
    d.release_xfer_handle(h)


@pytest.mark.parametrize("kind", ["err", "raise", "drop-notif"])
def test_failures_on_demand(kind: str) -> None:
    fake = FakeNixl()
    p, d, src, dst, local, remote = _pair(fake)  # type: ignore[misc]
    fake.fail_next(kind)
    h = d.make_prepped_xfer("READ", local, [0], remote, [0], b"n")
    if kind == "raise":
        with pytest.raises(FakeNixlError, match="injected"):
            d.transfer(h)
        return
    state = d.transfer(h)
    if kind == "err":
        assert state == "ERR" and not dst.any() and p.get_new_notifs() == {}
    else:
        assert state == "DONE" and torch.equal(dst[:16], src[:16]) and p.get_new_notifs() == {}


def test_unknown_remote_and_unregistered_memory_are_errors() -> None:
    a = FakeNixl().agent_class()("a")
    with pytest.raises(FakeNixlError, match="unknown remote agent 'nobody'"):
        a.prep_xfer_dlist("nobody", [(0, 8, 0)])
    with pytest.raises(FakeNixlError, match="not registered"):
        a.deregister_memory([(1, 8, 0)])


def test_vllm_nixl_worker_registers_its_kv_through_the_fake(fake_nixl: FakeNixl, kvcompose_worker) -> None:  # type: ignore[no-untyped-def]
    h = kvcompose_worker("version: 1\nconnectors:\n  - {name: pd, type: nixl, role: consumer}\n", block_size=32)
    (agent,) = fake_nixl.agents.values()
    assert agent.called("register_memory")
    registered = {addr for regs in agent.registered for addr, _, _ in regs}
    assert next(iter(h.kv_caches.values())).untyped_storage().data_ptr() in registered
    h.step(h.idle_metadata())  # a step with nothing to move makes no transfer
    assert not agent.called("transfer")
    h.shutdown()
    assert agent.called("deregister_memory") and not agent.registered
