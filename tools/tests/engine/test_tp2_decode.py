"""Heterogeneous tensor parallelism (marker ``engine``): a decode server at TP 2 pulls from a
prefill server at TP 1 through the composite, behind vLLM's router.

The tiny model has 2 KV heads: each decode worker holds one, and NIXL's heterogeneous-TP mapping
reads that head's half of every block from the prefill worker that holds both. The composite runs
once per worker, so the completion accounting is where it could break: each worker's NIXL child
and host tier report their own loads and stores, and vLLM's scheduler (one, on top) must see each
request's load finish exactly once. Checked: the whole prompt pulled over NIXL (the same bytes as
TP 1, counted over both workers), then, decode's prefix cache dropped, the host tier's blocks
(stored by both workers) plus the tail over NIXL; token ids equal to a TP 1 engine's. Logprobs
are compared with a tolerance: TP 2 sums the attention output's projection over two workers, which
rounds differently from TP 1.

On this 2-core machine each decode worker gets a core of its own (``VLLM_CPU_OMP_THREADS_BIND
0|1``, :meth:`~kvcompose_tools.e2e.spec.EngineSpec.env`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.flow import drop_prefix_cache, routed_request, token_prompt
from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

# 130 s of engine starts (a TP 2 decode): `make test-long`, to keep `make test`'s CI run under the hour.
pytestmark = [pytest.mark.engine, pytest.mark.long]

MAX_TOKENS = 16
PROMPT = token_prompt(20, 500)
#: float32 logits summed in another order across two workers: the logprobs' gap seen here is ~1e-6.
LOGPROB_TOLERANCE = 1e-4


class Stack(Nodes):
    def __init__(self, logs: Path, baseline: EngineNode) -> None:
        self.model = make_model(0)
        p_port, d_port = free_ports(2)
        super().__init__()
        prefill = self.prefill_server(self.model, logs, p_port)
        spec = EngineSpec(
            "decode-tp2", str(self.model), str(EXAMPLES / "pd-decode.yaml"), d_port, tensor_parallel_size=2
        )
        self.decode = ServerNode(spec, logs)
        self.nodes += [prefill, self.decode]  # starting while the baseline answers
        self.expected = baseline.generate([PROMPT], MAX_TOKENS)[0]
        wait_all_ready([prefill, self.decode])
        self.router = RouterNode([prefill], [self.decode], str(self.model), logs)
        self.nodes.append(self.router)
        self.router.wait_ready()


@pytest.fixture(scope="module")
def stack(baseline: EngineNode) -> Iterator[Stack]:
    yield from module_stack(Stack, "kvcompose-e2e-tp2-", baseline)


def test_a_tp2_decode_pulls_from_a_tp1_prefill_and_its_host_tier_serves_the_repeat(stack: Stack) -> None:
    first = routed_request(stack.router, [stack.decode], PROMPT, MAX_TOKENS)
    blocks = -(-len(PROMPT) // BLOCK_SIZE)
    assert first.loaded == {"pd": len(PROMPT)} and first.failed_transfers == 0 and first.computed_tokens == 0
    assert first.nixl_bytes == blocks * BLOCK_SIZE * kv_bytes_per_token(stack.model)
    drop_prefix_cache(stack.decode)
    again = routed_request(stack.router, [stack.decode], PROMPT, MAX_TOKENS)
    full = len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE
    assert again.loaded == {"host": full, "pd": len(PROMPT) - full} and again.computed_tokens == 0
    assert again.host_blocks == full // BLOCK_SIZE
    for s in (first, again):
        assert s.token_ids == stack.expected["token_ids"], s.label
        gap = max(abs(a - b) for a, b in zip(s.logprobs, stack.expected["logprobs"], strict=True))
        assert gap < LOGPROB_TOLERANCE, gap
