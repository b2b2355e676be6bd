"""Push mode's prompt binding in real CPU engines (markers ``engine`` and ``long``: ``make test-long``).

The shipped ``pd-prefill.yaml`` and ``pd-decode.yaml`` with ``mode: push`` (vLLM's
``NixlPushConnector``: the decode registers its blocks with the prefill, which WRITEs the KV it
computed into them), the deployment key (``KVCOMPOSE_PD_KEY``) and UCX, beside the session's
single-engine baseline (docs/security.md, the push rows; ``kvcompose_nixl/push.py``):

* control: prompt A through push P/D answers as the baseline does (token ids and logprobs);
* attack: the decode is sent prompt B with the push params of the prefill's request for A. The
  prefill refuses to write A's KV into B's blocks (its log names the ``prompt`` check), tells the
  decode, which computes B itself (``load_failure: recompute``) and answers B as the baseline;
* A again afterwards is pushed and answers as the baseline: both engines serve on.

**The request ids must be in step.** vLLM matches a decode's push registration to the
prefill's request by request id, without vLLM's random suffix (``push_worker.py``
``_pop_matching_registration``), and an offline ``vllm.LLM`` numbers its requests itself, from 0
(each prompt of a ``generate`` takes the next number). The decode's request for a prompt must
therefore be numbered as the prefill's request that computed it, or the prefill finds no
registration to write (or one of another request's): the load waits for vLLM's push timeout,
and the test would pin nothing about the binding. Each case first brings the two engines'
counters level (:func:`in_step`, short local requests to the one behind), then checks that the
prefill's request (``remote_request_id`` in its params) has the decode's next number, so that a
case that failed half-way (one engine sent a prompt, the other not) does not shift the next.

Measured: 3 passed in 152 s on this 2-core host (vLLM 0.32; the two engine starts included).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.flow import EXTERNAL, Served, decode_request, token_prompt
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

# A long scenario (two engine starts of their own): `make test-long`, not in `make test` or CI.
pytestmark = [pytest.mark.engine, pytest.mark.long]

MAX_TOKENS = 16
A = token_prompt(20, 200)
B = token_prompt(21, 200)  # as long as A: only the prompt binding tells them apart
#: Shorter than a block: a request that only moves an engine's request counter (nothing cached).
STEP = token_prompt(22, BLOCK_SIZE // 2)
#: vLLM's random request-id suffix (``nixl/utils.py`` ``get_base_request_id``).
SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


class PushPair(Nodes):
    """A push prefill and a push decode of the shipped examples, and the baseline's answers."""

    def __init__(self, tmp: Path, baseline: EngineNode) -> None:
        super().__init__()
        model = str(make_model(0))
        prefill_port, decode_port = free_ports(2)
        push = {"mode": "push"}
        self.prefill = EngineNode(
            EngineSpec("prefill-push", model, str(EXAMPLES / "pd-prefill.yaml"), prefill_port, push), tmp
        )
        self.nodes.append(self.prefill)
        self.decode = EngineNode(
            EngineSpec(
                "decode-push",
                model,
                str(EXAMPLES / "pd-decode.yaml"),
                decode_port,
                push,
                kv_load_failure_policy="recompute",
            ),
            tmp,
        )
        self.nodes.append(self.decode)
        # The baseline answers while the two engines start.
        self.expected = {name: baseline.generate([p], MAX_TOKENS)[0] for name, p in (("A", A), ("B", B))}
        wait_all_ready(self.nodes)


@pytest.fixture(scope="module")
def pair(baseline: EngineNode) -> Iterator[PushPair]:
    yield from module_stack(PushPair, "kvcompose-e2e-push-", baseline)


def in_step(prefill: EngineNode, decode: EngineNode) -> None:
    """Level the two engines' request counters: the one behind answers short local requests."""
    p, d = prefill.next_request_id(), decode.next_request_id()
    for node, behind in ((prefill, d - p), (decode, p - d)):
        if behind > 0:
            node.generate([STEP] * behind, 1)
    assert prefill.next_request_id() == decode.next_request_id()


def fresh(node: EngineNode, tries: int = 50) -> None:
    """Drop the engine's prefix cache and its connectors' (the host tier's), so that a prompt
    asked before is loaded again, not found; vLLM refuses while blocks are held: asked again."""
    for _ in range(tries):
        if node.reset_prefix_cache(connectors=True):
            return
        time.sleep(0.1)
    raise AssertionError(f"{node.name} refused reset_prefix_cache {tries} times")


def pushed(pair: PushPair, prefill_prompt: list[int], decode_prompt: list[int], label: str) -> tuple[Served, str]:
    """The prefill computes ``prefill_prompt`` for a remote decode; the decode is sent
    ``decode_prompt`` with its params, as the same request number. Returns the decode's answer
    and that number."""
    fresh(pair.decode)
    in_step(pair.prefill, pair.decode)
    (p,) = pair.prefill.generate([prefill_prompt], 1, [{"do_remote_decode": True}])
    params: dict[str, Any] = p["kv_transfer_params"]
    assert params.get("transfer_mode") == "push", params
    number = SUFFIX.sub("", params["remote_request_id"])
    assert number == str(pair.decode.next_request_id()), (params["remote_request_id"], "out of step")
    served = decode_request(pair.decode, decode_prompt, MAX_TOKENS, params, label)
    print(
        f"{label}: request {number}, loaded {served.served_by()}, computed {served.computed_tokens}, "
        f"external {served.counters.get(EXTERNAL, 0):.0f}, failed transfers {served.failed_transfers}"
    )
    return served, number


def assert_pushed(served: Served, prompt: list[int]) -> None:
    """The decode loaded the whole prompt from the prefill's write and computed none of it."""
    assert "pd" in served.loaded, served.loaded
    assert served.counters.get(EXTERNAL) == len(prompt), served.counters
    assert served.computed_tokens == 0
    assert served.failed_transfers == 0


def test_control_a_through_push_pd_answers_as_the_single_engine(pair: PushPair) -> None:
    served, _ = pushed(pair, A, A, "control A")
    assert_pushed(served, A)
    assert served.equals(pair.expected["A"]), (served.token_ids, pair.expected["A"]["token_ids"])


def test_attack_b_with_as_push_params_is_refused_by_the_prefill_and_computed_by_the_decode(pair: PushPair) -> None:
    """The decode registers B's digest under A's request number; the prefill computed A: it
    writes nothing (``refused (prompt)`` in its log), the decode is told and computes B."""
    served, number = pushed(pair, A, B, "attack: B with A's push params")
    assert served.computed_tokens == len(B), served.counters
    assert served.counters.get(EXTERNAL, 0) == 0, served.counters
    assert served.equals(pair.expected["B"]), (served.token_ids, pair.expected["B"]["token_ids"])
    assert served.token_ids != pair.expected["A"]["token_ids"]  # not A's answer
    decode_id = re.compile(rf"push to decode request {number}-[0-9a-f]{{8}} refused \((\w+)\)")
    refusals = [m.group(1) for m in map(decode_id.search, pair.prefill.log_tail(2000).splitlines()) if m]
    assert refusals == ["prompt"], refusals
    told = [line for line in pair.decode.log_tail(2000).splitlines() if "the prefill refused to write" in line]
    assert len(told) == 1 and re.search(rf"\b{number}-[0-9a-f]{{8}}: the prefill refused", told[0]), told


def test_control_a_again_after_the_refusal_is_pushed_and_answers_as_the_single_engine(pair: PushPair) -> None:
    served, _ = pushed(pair, A, A, "control A again")
    assert_pushed(served, A)
    assert served.equals(pair.expected["A"]), (served.token_ids, pair.expected["A"]["token_ids"])
