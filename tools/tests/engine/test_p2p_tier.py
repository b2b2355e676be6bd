"""vLLM's p2p tier composed as a ``native-offload`` tier, in two real engines on CPU (marker ``engine``).

Each engine composes one child, ``native-offload`` with ``tiers: [{type: p2p, ...}]``: vLLM's
``OffloadingConnector`` with its ``TieringOffloadingSpec`` (the plugin's portable spec on this
CPU platform), whose p2p tier moves KV between the two instances' CPU tiers over NIXL. No NIXL
connector and no MultiConnector: the path llm-d's sidecar drives, with the role keys it sets
(``vllm/v1/kv_offload/tiering/p2p/manager.py``):

* **P/D**: ``remote_decoder`` on the prefill's request, ``remote_prefiller`` (the prefill's
  p2p address) on the decode's. The decode takes the prompt's full blocks from the prefill and
  computes the rest.
* **P/D behind vLLM's router**: the request goes to ``vllm-router`` in P/D mode, which sends
  ``do_remote_decode`` to the prefill and the params of its answer (``remote_prefiller``, mapped
  by the composition: ``kvcompose_cpu_offload/p2p.py``) to the decode as they are.
* **symmetric**: ``remote_kv_source`` (the decode's p2p address) on a later request to the
  prefill, whose prompt extends what the decode computed: the prefill asks which blocks the
  decode holds and fetches them.

* **the fleet's pool**: each tier's ``pool`` names the other engine (its p2p socket, its KV
  events on a Unix socket); a request with no role at all, whose prefix only the other engine's
  CPU tier holds, is given ``remote_kv_source`` by the composition from the peer's events, and
  loads that prefix from it (issue 62). Its control: a prompt nobody holds is computed here.

Every answer must be the single-engine baseline's, token ids and logprobs bit for bit, and the
tokens the p2p tier brought must be counted as loaded (not computed) where they landed.

The role keys are client input (``kvcompose_cpu_offload/p2p.py``): a role naming a peer beyond
loopback (no key here) and a role that is not a mapping (vLLM's tier raises on it in the
scheduler) are refused, the prompt computed here, the engine still serving; the keyed checks are
``plugins/cpu_offload/tests/test_p2p_trust.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.stack import Nodes, module_stack
from kvcompose_tools.e2e.events import EventListener, kv_events_config
from kvcompose_tools.e2e.flow import Served, decode_request, full_blocks, measured, routed_request, token_prompt
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
PD_PROMPT = token_prompt(70, 450)
PROXY_PROMPT = token_prompt(74, 420)
SHARED = token_prompt(71, 300)
EXTENDED = SHARED + token_prompt(72, 60)
POOLED = token_prompt(77, 300)
POOLED_EXTENDED = POOLED + token_prompt(78, 60)
#: How long the decode's CPU-tier stores may take to be published.
EVENTS_WAIT_S = 30.0


def p2p_yaml(port: int, peer_port: int, peer_events: str) -> str:
    """One native-offload child whose only tier behind host memory is vLLM's p2p tier on ``port``,
    its pool the peer whose p2p tier is on ``peer_port`` and who publishes on ``peer_events``."""
    peer = f'{{host: 127.0.0.1, p2p_port: {peer_port}, kv_events: "{peer_events}"}}'
    return (
        "version: 1\n"
        "connectors:\n"
        "  - name: host\n"
        "    type: native-offload\n"
        "    options:\n"
        "      cpu_bytes: 64MiB\n"
        f"      tiers: [{{type: p2p, host: 127.0.0.1, port: {port}, pool: {{peers: [{peer}]}}}}]\n"
    )


class Pair(Nodes):
    """Two API servers with a p2p tier each, ``prefill`` and ``decode`` (names for the P/D roles),
    and vLLM's router in P/D mode in front of them."""

    def __init__(self, tmp: Path, baseline: EngineNode) -> None:
        super().__init__()
        model = str(make_model(0))
        self.baseline = baseline
        ports = free_ports(4)
        self.p2p_ports = {"prefill": ports[2], "decode": ports[3]}
        events = {name: kv_events_config(tmp / f"{name}.events") for name in self.p2p_ports}
        for (name, other), engine_port in zip((("prefill", "decode"), ("decode", "prefill")), ports[:2], strict=True):
            path = tmp / f"{name}.yaml"
            path.write_text(p2p_yaml(self.p2p_ports[name], self.p2p_ports[other], events[other]["endpoint"]))
            spec = EngineSpec(name, model, str(path), engine_port, kv_events=events[name], source_header=True)
            node = ServerNode(spec, tmp)
            self.nodes.append(node)
            setattr(self, name, node)
        wait_all_ready(self.nodes)
        #: what the decode publishes, heard as its peer hears it
        self.decode_events = EventListener(events["decode"]["endpoint"])
        self.nodes.append(self.decode_events)
        self.router = RouterNode([self.prefill], [self.decode], model, tmp)
        self.nodes.append(self.router)
        self.router.wait_ready()

    def address(self, name: str) -> dict[str, Any]:
        return {"remote_host": "127.0.0.1", "remote_port": self.p2p_ports[name]}


@pytest.fixture(scope="module")
def pair(baseline: EngineNode) -> Iterator[Pair]:
    yield from module_stack(Pair, "kvcompose-e2e-p2p-", baseline)


def full(prompt: list[int]) -> int:
    return full_blocks(prompt, BLOCK_SIZE)


def show(label: str, s: Served) -> None:
    print(
        f"{label}: loaded {s.served_by()}, computed {s.computed_tokens}, {s.host_bytes:,} B from host, "
        f"vLLM's sources {s.cached_by_source()}"
    )


def test_pd_through_the_p2p_tier_loads_the_prefills_blocks_and_answers_as_one_engine(pair: Pair) -> None:
    expected = pair.baseline.generate([PD_PROMPT], MAX_TOKENS)[0]
    kv_request_id = "p2p-pd-1"
    prefill = decode_request(pair.prefill, PD_PROMPT, 1, {"remote_decoder": {"kv_request_id": kv_request_id}}, "P")
    assert prefill.computed_tokens == len(PD_PROMPT)
    params = {"remote_prefiller": {"kv_request_id": kv_request_id, **pair.address("prefill")}}
    served = decode_request(pair.decode, PD_PROMPT, MAX_TOKENS, params, "D", ("host",))
    show("P/D", served)
    assert served.loaded == {"host": full(PD_PROMPT)}, served.loaded
    assert served.computed_tokens == len(PD_PROMPT) - full(PD_PROMPT)
    assert served.equals(expected)


def test_pd_behind_vllms_router_the_prefill_answers_with_the_p2p_role_the_decode_loads(pair: Pair) -> None:
    expected = pair.baseline.generate([PROXY_PROMPT], MAX_TOKENS)[0]
    served = routed_request(
        pair.router, [pair.decode], PROXY_PROMPT, MAX_TOKENS, "router", ("host",), prefills=[pair.prefill]
    )
    show("P/D behind the router", served)
    assert served.prefill_computed_tokens == len(PROXY_PROMPT)
    assert served.loaded == {"host": full(PROXY_PROMPT)}, served.loaded
    assert served.cached_by_source() == {"p2p": full(PROXY_PROMPT)}
    assert served.equals(expected)


@pytest.mark.parametrize(
    ("seed", "label", "role"),
    [
        (75, "peer", {"kv_request_id": "x", "remote_host": "10.9.9.9", "remote_port": 5711}),
        (76, "malformed", 5),
    ],
)
def test_a_refused_role_computes_the_prompt_here_and_the_engine_serves_on(
    pair: Pair, seed: int, label: str, role: Any
) -> None:
    """The engine's log names the check that refused (``p2p roles refused (REASON)``)."""
    prompt = token_prompt(seed, 300)  # a prompt of its own: no tier holds it
    expected = pair.baseline.generate([prompt], MAX_TOKENS)[0]
    served = decode_request(pair.decode, prompt, MAX_TOKENS, {"remote_prefiller": role}, label, ("host",))
    show(label, served)
    assert served.loaded == {} and served.computed_tokens == len(prompt) and served.equals(expected)
    refusals = [line for line in pair.decode.log_tail(200).splitlines() if "p2p roles refused" in line]
    assert refusals and f"p2p roles refused ({label})" in refusals[-1], refusals


def test_symmetric_the_prefill_pulls_what_the_decode_holds_and_answers_as_one_engine(pair: Pair) -> None:
    expected_shared = pair.baseline.generate([SHARED], MAX_TOKENS)[0]
    expected = pair.baseline.generate([EXTENDED], MAX_TOKENS)[0]
    local = decode_request(pair.decode, SHARED, MAX_TOKENS, None, "D local", ("host",))
    assert local.loaded == {} and local.equals(expected_shared)
    pair.decode.generate([token_prompt(73, BLOCK_SIZE)], 1)  # a step: vLLM starts the deferred stores
    params = {"remote_kv_source": {"kv_request_id": "p2p-sym-1", **pair.address("decode")}}
    pulled = decode_request(pair.prefill, EXTENDED, MAX_TOKENS, params, "P pulls", ("host",))
    show("symmetric", pulled)
    assert pulled.loaded == {"host": full(SHARED)}, pulled.loaded
    assert pulled.computed_tokens == len(EXTENDED) - full(SHARED)
    assert pulled.equals(expected)


def wait_for_cpu_store(events: EventListener, prompt: list[int]) -> None:
    """Until the publisher has said that its CPU tier holds ``prompt``'s last full block."""
    end = full(prompt)
    deadline = time.monotonic() + EVENTS_WAIT_S
    while time.monotonic() < deadline:
        for block in events.stored():
            size = len(block.token_ids)
            if block.medium == "CPU" and size and block.token_ids == prompt[end - size : end]:
                return
        time.sleep(0.1)
    raise AssertionError(f"no CPU store of the prompt's last full block published in {EVENTS_WAIT_S} s")


def test_the_pool_loads_a_prefix_from_the_peer_its_events_say_holds_it(pair: Pair) -> None:
    """No role from anyone: the prefill's pool reads the decode's KV events, names the decode as
    the request's ``remote_kv_source``, and vLLM's tier loads the prefix from it."""
    expected_pooled = pair.baseline.generate([POOLED], MAX_TOKENS)[0]
    expected = pair.baseline.generate([POOLED_EXTENDED], MAX_TOKENS)[0]
    local = decode_request(pair.decode, POOLED, MAX_TOKENS, None, "D local", ("host",))
    assert local.loaded == {} and local.equals(expected_pooled)
    pair.decode.generate([token_prompt(79, BLOCK_SIZE)], 1)  # a step: vLLM starts the deferred stores
    wait_for_cpu_store(pair.decode_events, POOLED)
    pooled = decode_request(pair.prefill, POOLED_EXTENDED, MAX_TOKENS, None, "P from the pool", ("host",))
    show("pool", pooled)
    assert pooled.loaded == {"host": full(POOLED)}, pooled.loaded
    assert pooled.cached_by_source() == {"p2p": full(POOLED)}
    assert pooled.computed_tokens == len(POOLED_EXTENDED) - full(POOLED)
    assert pooled.equals(expected)


def test_a_routers_header_names_the_source_and_one_naming_no_peer_is_refused(pair: Pair) -> None:
    """llm-d's ``x-kv-cache-source-host-port`` through vLLM's server (the middleware): naming the
    decode, the prefill loads the prefix from it; naming a host that is no peer (the control), the
    header reaches the ``peer`` check and is refused there, the engine serving on (its pool then
    finds the decode by the events)."""
    cases = ((81, f"127.0.0.1:{pair.p2p_ports['decode']}", False), (83, "10.9.9.9:5710", True))
    for seed, source, refused in cases:
        held, prompt = token_prompt(seed, 300), token_prompt(seed, 300) + token_prompt(seed + 1, 40)
        expected = pair.baseline.generate([prompt], MAX_TOKENS)[0]
        decode_request(pair.decode, held, MAX_TOKENS, None, "D local", ("host",))
        pair.decode.generate([token_prompt(seed + 100, BLOCK_SIZE)], 1)  # a step: vLLM starts the deferred stores
        wait_for_cpu_store(pair.decode_events, held)
        header = {"x-kv-cache-source-host-port": source}
        served = measured(
            pair.prefill,
            lambda p=prompt, h=header: pair.prefill.generate([p], MAX_TOKENS, headers=h)[0],
            len(prompt),
            f"P, header {source}",
            ("host",),
        )
        show(f"header {source}", served)
        refusals = [line for line in pair.prefill.log_tail(200).splitlines() if "p2p roles refused" in line]
        said = bool(refusals) and "p2p roles refused (peer)" in refusals[-1] and "10.9.9.9" in refusals[-1]
        assert said is refused, refusals
        assert served.cached_by_source() == {"p2p": full(held)}
        assert served.equals(expected)


def test_the_pools_control_a_prefix_no_peer_holds_is_computed_here(pair: Pair) -> None:
    """The control of the test above: the same flow with a prompt the decode never saw."""
    prompt = token_prompt(80, 360)
    expected = pair.baseline.generate([prompt], MAX_TOKENS)[0]
    served = decode_request(pair.prefill, prompt, MAX_TOKENS, None, "P, nobody holds it", ("host",))
    show("pool control", served)
    assert served.loaded == {} and served.computed_tokens == len(prompt) and served.equals(expected)
