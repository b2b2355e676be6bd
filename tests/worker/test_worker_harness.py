"""The worker harness replays a model-runner step's connector calls, in vLLM's order, on real KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm.v1.core.sched.output import SchedulerOutput

from kvcompose.testing.harness import make_request
from kvcompose.testing.kv import layer_name
from kvcompose.testing.worker import WorkerHarness

TWO = """
version: 1
connectors:
  - {name: a, type: record}
  - {name: b, type: record}
"""

STEP = ["handle_preemptions", "bind_connector_metadata"]  # vLLM hands every step to both


def _names(calls: list[tuple[str, tuple]]) -> list[str]:
    return [m for m, _ in calls]


def _per_layer(n: int) -> list[str]:
    return [c for i in range(n) for c in ("wait_for_layer_load", "save_kv_layer")]


TAIL = [
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]


def test_one_step_calls_every_child_in_vllm_order() -> None:
    h = WorkerHarness.from_yaml(TWO, num_layers=3)
    assert h.layer_names == [layer_name(i) for i in range(3)]
    meta = h.idle_metadata()
    for name in ("a", "b"):
        h.child(name).calls.clear()  # type: ignore[attr-defined]
    out = h.step(meta)
    assert not out.finished_recving and not out.finished_sending and out.kv_connector_worker_meta is None
    for name in ("a", "b"):
        calls = h.child(name).calls  # type: ignore[attr-defined]
        # Async loads start after the forward, as vLLM orders them when no load is synchronous.
        assert _names(calls) == STEP + _per_layer(3) + ["start_load_kv"] + TAIL
        saved = [a[0] for m, a in calls if m == "save_kv_layer"]
        assert saved == h.layer_names


def test_sync_loads_start_before_the_forward_and_layers_can_be_skipped() -> None:
    h = WorkerHarness.from_yaml(TWO)
    meta = h.idle_metadata()
    h.child("a").calls.clear()  # type: ignore[attr-defined]
    h.step(meta, sync_loads=True, layers=False, finished_req_ids={"r9"})
    calls = h.child("a").calls  # type: ignore[attr-defined]
    assert _names(calls) == STEP + ["start_load_kv"] + TAIL
    assert ("get_transfer_results", ({"r9"},)) in calls


def test_an_engine_step_without_a_scheduled_token_makes_no_per_layer_call() -> None:
    """vLLM runs such a step through ``kv_connector_no_forward``: no forward pass, no layer hooks."""
    h = WorkerHarness.from_yaml(TWO, num_layers=2)
    r = make_request(prompt=list(range(3, 40)), max_tokens=1, block_size=16, request_id="r")
    h.scheduler.add_request(r)
    calls = h.child("a").calls  # type: ignore[attr-defined]
    calls.clear()
    ran, _ = h.engine_step()
    assert ran.total_num_scheduled_tokens > 0 and r.is_finished()
    assert _names(calls).count("save_kv_layer") == 2
    calls.clear()
    idle, _ = h.engine_step()
    assert idle.total_num_scheduled_tokens == 0
    assert _names(calls) == STEP + ["start_load_kv"] + TAIL


def test_registration_hands_over_every_engine_layer() -> None:
    h = WorkerHarness.from_yaml(TWO, num_layers=32, num_blocks=8)
    (registered,) = h.child("b").called("register_kv_caches")  # type: ignore[attr-defined]
    assert registered == (tuple(layer_name(i) for i in range(32)),)
    assert len(h.child("b").called("set_host_xfer_buffer_ops")) == 0  # record does not own host buffers
    view = h.kv_caches[layer_name(0)]
    assert view.shape[0] == 8 and view.device.type == "cpu"
    # All layers live in one backing allocation, as vLLM allocates them.
    assert len({v.untyped_storage().data_ptr() for v in h.kv_caches.values()}) == 1


def test_the_write_hook_runs_between_wait_and_save(tmp_path: Path) -> None:
    path = tmp_path / "compose.yaml"
    path.write_text(TWO)
    h = WorkerHarness.from_yaml(path, num_layers=2)
    seen: list[str] = []

    def write(name: str, kv: torch.Tensor) -> None:
        seen.append(name)
        kv[1].fill_(7)

    h.step(h.idle_metadata(), write=write)
    assert seen == h.layer_names
    assert all(bool((h.kv_caches[n][1] == 7).all()) for n in h.layer_names)


def test_missing_composition_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        WorkerHarness.from_yaml(str(tmp_path / "nope.yaml"))


def test_vllm_multiconnector_is_driven_the_same_way() -> None:
    record = {
        "kv_connector": "RecordConnector",
        "kv_connector_module_path": "kvcompose.testing.connectors",
        "kv_role": "kv_both",
    }
    h = WorkerHarness(
        {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [record]}},
        num_layers=4,
    )
    assert type(h.connector).__module__.startswith("vllm.")
    child = h.child("RecordConnector")
    child.calls.clear()  # type: ignore[attr-defined]
    h.step(h.idle_metadata())
    assert _names(child.calls)[: len(STEP) + 8 + 1] == STEP + _per_layer(4) + ["start_load_kv"]  # type: ignore[attr-defined]


def test_engine_step_stores_a_finished_prompt_in_the_cpu_tier() -> None:
    h = WorkerHarness.from_yaml(
        """
version: 1
connectors:
  - {name: host, type: cpu-offload, options: {cpu_bytes: 4MiB}}
""",
        num_blocks=32,
    )
    req = make_request(64)
    h.scheduler.add_request(req)
    metas = []

    def stored(_outs: list[SchedulerOutput]) -> bool:
        out = h.last_output
        if out is not None and out.kv_connector_worker_meta is not None:
            metas.append(out.kv_connector_worker_meta.children["host"])
        return any(m.completed_store_events for m in metas if m is not None)

    # The CPU tier's worker stores the prompt's blocks (on its copy thread) and tells its
    # scheduler so in a later step's worker metadata.
    h.step_until(stored, "no store reported", max_steps=4, eos=True)
    assert not h.scheduler.requests
    h.shutdown()


def test_write_blocks_fills_each_completed_block_with_its_prefix_bytes() -> None:
    h = WorkerHarness.from_yaml(TWO, num_layers=2, num_blocks=16)
    h.kv.raw.fill_(5)  # what no write produces: a block the forward did not complete keeps it
    req = make_request(40, max_tokens=12)  # two full blocks and a partial one
    h.scheduler.add_request(req)
    hooked: list[str] = []
    h.engine_step(write_blocks=True, write=lambda name, kv: hooked.append(name))
    assert hooked == h.layer_names  # a caller's write hook still runs, after the block writes
    ids = h.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
    tokens = list(req.prompt_token_ids)
    assert h.holds_prefix(ids[0], tokens[:16]) and h.holds_prefix(ids[1], tokens[:32])
    # Each layer gets its own bytes, and the prefix (not the block's own tokens) decides them.
    a, b = h.layer_names
    assert not torch.equal(h.expected_block(tokens[:16], a), h.expected_block(tokens[:16], b))
    assert not h.holds_prefix(ids[1], tokens[16:32])
    assert bool((h.block_bytes(a, ids[2]) == 5).all())
    # Decode steps complete the third block (prompt tail + sampled tokens) on its 48th token.
    while req.num_computed_tokens < 47:
        h.engine_step(write_blocks=True)
    assert bool((h.block_bytes(a, ids[2]) == 5).all())
    h.engine_step(write_blocks=True)
    assert req.num_computed_tokens == 48 and h.holds_prefix(ids[2], req.all_token_ids[:48])
    # Without write_blocks the step writes nothing.
    h.kv.raw.fill_(5)
    h.engine_step(eos=True)
    assert bool((h.kv.raw == 5).all())
    h.shutdown()


def test_drain_steps_until_stores_are_acknowledged() -> None:
    h = WorkerHarness.from_yaml(
        """
version: 1
connectors:
  - {name: host, type: cpu-offload, options: {cpu_bytes: 4MiB}}
""",
        num_blocks=32,
    )
    req = make_request(64, max_tokens=1)
    h.scheduler.add_request(req)
    h.engine_step(write_blocks=True)
    assert req.is_finished() and h.scheduler.connector.has_pending_push_work()
    outs = h.drain(write_blocks=True)
    assert outs and not h.scheduler.connector.has_pending_push_work()
    assert h.drain() == []  # nothing pending: no step
    h.scheduler.connector.has_pending_push_work = lambda: True  # type: ignore[method-assign]
    with pytest.raises(AssertionError, match="still pending after 2 engine steps"):
        h.drain(max_steps=2, timeout_s=0)
    h.shutdown()
