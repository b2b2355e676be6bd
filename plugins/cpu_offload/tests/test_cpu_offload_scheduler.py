"""vLLM's real Scheduler with the cpu-offload connector as its only connector: store, evict, load.

Both halves run: the scheduler builds its connector through vLLM's factory (our module path),
and a worker-role connector with the portable worker moves the bytes of engine-layout KV caches.
Each step does what the model runner's connector mixin does (bind metadata, forward, start
loads, issue stores, collect finished ids and worker metadata), with a stand-in forward that
writes, into every block it completes, bytes determined by the block's token prefix. A block
that comes back from the host tier must therefore hold exactly its prefix's bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvcompose.testing.kv import EngineKV, make_engine_kv, pattern_for
from kvcompose_cpu_offload.connector import SimpleCPUOffloadConnector
from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from kvcompose.testing.harness import (
    assert_scheduler_empty,
    make_request,
    make_scheduler,
    model_runner_output,
)

BLOCK = 16
PROMPT = 4 * BLOCK + 8  # four full blocks and a partial one


class MiniEngine:
    """A scheduler, a worker-side connector and KV caches, stepped like EngineCore steps."""

    def __init__(self, extra: dict[str, Any], num_blocks: int = 12) -> None:
        ktc = {
            "kv_connector": "SimpleCPUOffloadConnector",
            "kv_connector_module_path": "kvcompose_cpu_offload.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        self.kv: EngineKV = make_engine_kv(
            num_layers=2, block_size=BLOCK, num_blocks=num_blocks, kv_transfer_config=ktc
        )
        self.scheduler: Scheduler = make_scheduler(self.kv.vllm_config, self.kv.kv_cache_config)
        self.worker = SimpleCPUOffloadConnector(
            self.kv.vllm_config, KVConnectorRole.WORKER, self.kv.kv_cache_config
        )
        self.worker.register_kv_caches(self.kv.kv_caches)
        self.layers = list(self.kv.kv_caches)
        self.loads: list[SimpleCPUOffloadMetadata] = []
        self.stored_blocks = 0

    def expected_block(self, prefix: list[int], layer: int) -> torch.Tensor:
        view = self.kv.kv_caches[self.layers[layer]][0]
        nbytes = view.numel() * view.element_size()
        return pattern_for([*prefix, -1 - layer], nbytes)

    def _forward(self, out: SchedulerOutput) -> None:
        """Write each block completed this step with bytes that depend on its token prefix."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            tokens = req.all_token_ids
            for b in range((end - n) // BLOCK, end // BLOCK):
                for layer, name in enumerate(self.layers):
                    dst = self.kv.kv_caches[name][block_ids[b]]
                    src = self.expected_block(tokens[: (b + 1) * BLOCK], layer)
                    dst.copy_(src.view(dst.dtype).view(dst.shape))

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert isinstance(meta, SimpleCPUOffloadMetadata)
        if meta.load_gpu_blocks:
            self.loads.append(meta)
        self.stored_blocks += len(meta.store_gpu_blocks)
        # The order of KVConnectorModelRunnerMixin._get_kv_connector_output (async loads).
        self.worker.bind_connector_metadata(meta)
        self._forward(out)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(out.finished_req_ids)
        worker_meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        running = [self.scheduler.requests[r] for r in out.num_scheduled_tokens]
        self.scheduler.update_from_output(
            out,
            model_runner_output(
                running,
                finished_sending=sending,
                finished_recving=recving,
                worker_meta=worker_meta,
            ),
        )
        return out

    def run(self, req: Request, max_steps: int = 20) -> None:
        self.scheduler.add_request(req)
        for _ in range(max_steps):
            self.step()
            if req.is_finished():
                return
        raise AssertionError(f"{req.request_id} did not finish in {max_steps} steps")

    def drain(self, max_steps: int = 5) -> None:
        """Steps until every store is acknowledged (eager mode holds blocks until then)."""
        for _ in range(max_steps):
            if not self.scheduler.connector.has_pending_push_work():
                return
            self.step()
        raise AssertionError("stores still pending")


def prompt(seed: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % 500 for i in range(PROMPT)]


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_store_evict_load(lazy: bool) -> None:
    eng = MiniEngine({"cpu_bytes_to_use": 1 << 20, "lazy_offload": lazy})
    assert isinstance(eng.scheduler.connector, SimpleCPUOffloadConnector)
    assert isinstance(eng.worker.worker_handler, PortableSimpleCPUOffloadWorker)

    a = prompt(0)
    eng.run(make_request(prompt=a, max_tokens=2, block_size=BLOCK, request_id="A1"))
    # Three other prompts need the whole 11-block pool between them and push A out.
    for seed in (1, 2, 3):
        eng.run(
            make_request(prompt=prompt(seed), max_tokens=2, block_size=BLOCK, request_id=f"E{seed}")
        )
    eng.drain()
    assert eng.stored_blocks >= 4 and not eng.loads

    a2 = make_request(prompt=a, max_tokens=2, block_size=BLOCK, request_id="A2")
    _, local_hit, _ = eng.scheduler.kv_cache_manager.get_computed_blocks(a2)
    assert local_hit == 0, "A is still in the device prefix cache; nothing was evicted"

    eng.scheduler.add_request(a2)
    first = eng.step()
    # The host tier hit: A2 waits for its KV, nothing is computed this step.
    assert first.num_scheduled_tokens == {}
    (load,) = eng.loads
    assert len(load.load_gpu_blocks) == 4 and load.load_event_to_reqs[load.load_event] == ["A2"]

    # The portable worker finished the load in that step and reported A2 in finished_recving;
    # the scheduler now computes only the tail of the prompt.
    second = eng.step()
    assert second.num_scheduled_tokens == {"A2": PROMPT - 4 * BLOCK}
    assert a2.num_computed_tokens == PROMPT and a2.status == RequestStatus.RUNNING

    # The loaded blocks hold exactly A's prefix bytes.
    block_ids = eng.scheduler.kv_cache_manager.get_block_ids("A2")[0]
    for b in range(4):
        for layer, name in enumerate(eng.layers):
            got = eng.kv.kv_caches[name][block_ids[b]].contiguous().view(torch.int8).reshape(-1)
            assert torch.equal(got, eng.expected_block(a[: (b + 1) * BLOCK], layer)), (b, name)

    while not a2.is_finished():
        eng.step()
    eng.drain()
    assert_scheduler_empty(eng.scheduler)


def test_no_hit_without_a_store() -> None:
    """A prompt the tier never saw gets no external tokens and is computed normally."""
    eng = MiniEngine({"cpu_bytes_to_use": 1 << 20})
    req = make_request(prompt=prompt(9), max_tokens=1, block_size=BLOCK, request_id="fresh")
    eng.scheduler.add_request(req)
    out = eng.step()
    assert out.num_scheduled_tokens == {"fresh": PROMPT}
    assert not eng.loads
    eng.drain()
    assert_scheduler_empty(eng.scheduler)
