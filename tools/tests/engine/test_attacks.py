"""An attacker on the cluster network against the shipped P/D pair (marker ``engine``; issue 51).

Three hosts (:mod:`kvcompose_tools.e2e.hosts`): the prefill server and the decode server of the
shipped examples, each in its own, and the attacker in a third, without the deployment key. The
attacker (``python -m kvcompose_tools.e2e.attacks``) reaches what any pod of a flat network
reaches: both APIs and the prefill's side channel; the test opens the prefill's sealed agent
metadata with the key and hands it over, as a leak, for the NIXL notifications. After every
attack the decode must have answered the prompt with its own answer (the single-engine baseline,
token ids and logprobs), pulled nothing, connected nowhere, and counted one refusal, for the
reason :data:`REASONS` pins (a malformed field with the params' own prompt: ``malformed``; the
params of ``a`` with a prompt near it or another one: ``prompt``); the pair must serve the
legitimate requests between and after them, the control among them: ``a``'s params unaltered,
with ``a``, pulled. Then hypothesis draws ``kv_transfer_params`` for the decode from the test
process, with ``a``'s own prompt or another: the engine stays up, and every answer is the
prompt's own. Skipped, with the kit's one-line reason, where namespaces cannot be made, unless
``$KVCOMPOSE_REQUIRE_HOSTS=1`` (CI): then it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_nixl.trust import SEALED, Keyring, prompt_digest
from kvcompose_tools.e2e.attacks import (
    CACHED_ATTACK,
    CACHED_BLOCKS,
    CACHED_PREFIX,
    GET_META,
    MALFORMED,
    MISFITS,
    PROMPT_ATTACKS,
    Outcome,
    Plan,
    prompt_variants,
    refusals,
    side_channel_answer,
)
from kvcompose_tools.e2e.flow import decode_request, same_output, token_prompt
from kvcompose_tools.e2e.hosts import Hosts, kit_namespaces, skip_reason
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, PD_KEY_ENV, EngineSpec

NO_HOSTS = skip_reason()
pytestmark = [pytest.mark.engine, pytest.mark.skipif(NO_HOSTS is not None, reason=NO_HOSTS or "")]

MAX_TOKENS = 8
#: The prefill's lease (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``): short, for the replay after it.
LEASE_S = 5
PROMPTS = {
    "a": token_prompt(20, 200),
    "b": token_prompt(21, 200),
    "c": token_prompt(22, 200),
    "replay": token_prompt(23, 150),
    "after": token_prompt(24, 120),
}
PROMPTS |= prompt_variants(PROMPTS["a"], BLOCK_SIZE)
#: The fuzz's prompt that does not fit a's params by a few tokens.
PROMPTS["a+3"] = PROMPTS["a+10"][:203]
#: The reason each attack on the decode is refused for (the trust checks' order: the fields, the
#: prompt, the signature, its end, the replay, the side channel).
REASONS: dict[str, str] = {
    "its own side channel, its own params": "unsigned",
    "its own side channel in real params": "signature",
    "made-up block ids": "signature",
    "real params unsigned": "unsigned",
    "a forged signature": "signature",
    "a's params, the digest of prompt b": "signature",
    **{f"malformed: {name}": "malformed" for name in [*MALFORMED, *MISFITS]},
    **{attack: "prompt" for attack, _ in (*PROMPT_ATTACKS, CACHED_ATTACK)},
    "replay of replay's params": "replayed",
    "replay after the lease": "expired",
}
#: The attacker's longest run: the attacks, a lease and its skew, engine calls.
ATTACKER_TIMEOUT_S = 600


class Stack(Nodes):
    """The baseline's answers, and the shipped prefill and decode, each in its host."""

    def __init__(self, logs: Path, baseline: EngineNode, hosts: Hosts) -> None:
        self.model = make_model(0)
        self.hosts = hosts
        super().__init__()
        lease = {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(LEASE_S)}
        p_port, d_port = free_ports(2)
        self.prefill = ServerNode(
            EngineSpec("prefill", str(self.model), str(EXAMPLES / "pd-prefill.yaml"), p_port),
            logs,
            extra_env=lease,
            host=hosts["prefill"],
        )
        self.decode = ServerNode(
            EngineSpec("decode", str(self.model), str(EXAMPLES / "pd-decode.yaml"), d_port), logs, host=hosts["decode"]
        )
        self.nodes += [self.prefill, self.decode]
        self.expected = {k: baseline.generate([ids], MAX_TOKENS)[0] for k, ids in PROMPTS.items()}
        wait_all_ready([self.prefill, self.decode])
        self.baseline = baseline

    @property
    def side_channel(self) -> tuple[str, int]:
        port = self.prefill.spec.side_channel_port
        assert port is not None
        return self.hosts["prefill"].address, port


@pytest.fixture(scope="module")
def stack(baseline: EngineNode) -> Iterator[Stack]:
    with Hosts(["prefill", "decode", "attacker"]) as hosts:  # no namespaces here: HostsUnavailable says why
        assert sorted(kit_namespaces(os.getpid())) == sorted(hosts.namespaces), "an earlier kit's hosts outlived it"
        yield from module_stack(Stack, "kvcompose-e2e-attacks-", baseline, hosts)
    assert kit_namespaces(os.getpid()) == [], "the hosts' namespaces outlived the module"


def leaked_agent(stack: Stack) -> bytes:
    """The prefill's NIXL agent metadata, opened with the deployment key (what the attacker
    would hold had it leaked): vLLM's handshake payload, its agent metadata, sealed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    answer = side_channel_answer(*stack.side_channel, GET_META, wait_s=5)
    assert answer is not None
    payload = msgspec.msgpack.decode(answer, type=NixlHandshakePayload)
    meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
    keys = Keyring.load(env=PD_KEY_ENV)
    assert keys is not None
    return keys.open(meta.agent_metadata)


def attack(stack: Stack, tmp_path: Path) -> list[Outcome]:
    attacker = stack.hosts["attacker"]
    plan = Plan(
        prefill_url=stack.prefill.url,
        decode_url=stack.decode.url,
        side_channel=stack.side_channel,
        own_address=attacker.address,
        prompts=PROMPTS,
        max_tokens=MAX_TOKENS,
        digests={"b": prompt_digest(PROMPTS["b"], (None, None, []))},  # a plain request's context
        leaked_agent=leaked_agent(stack).hex(),
    )
    path = tmp_path / "plan.json"
    path.write_bytes(msgspec.json.encode(plan))
    env = {k: v for k, v in attacker.environ().items() if k != PD_KEY_ENV}  # no key
    proc = attacker.popen(
        [sys.executable, "-m", "kvcompose_tools.e2e.attacks", str(path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=ATTACKER_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return msgspec.json.decode(out.strip().splitlines()[-1], type=list[Outcome])


def own_answer(stack: Stack, o: Outcome) -> bool:
    assert o.prompt is not None
    return o.status == "answered" and same_output(o.token_ids, o.logprobs, stack.expected[o.prompt])


def test_an_attacker_on_the_network_steers_nothing_and_the_pair_serves_on(stack: Stack, tmp_path: Path) -> None:
    outcomes = {o.attack: o for o in attack(stack, tmp_path)}
    print()
    for o in outcomes.values():
        if o.prompt is None:
            answer = f"{len(o.answer) // 2} bytes back" if o.answer and o.attack.startswith("side") else o.answer
        else:
            answer = "own answer" if own_answer(stack, o) else "NOT its own answer"
        print(
            f"{o.attack:72} {o.status:8} {answer or '-':36} pulled {o.pulled_tokens:3} "
            f"computed {o.computed_tokens:3} refused {o.refused}"
        )
    # The side channel: garbage dropped (no answer), vLLM's request after it answered, sealed.
    side = [o for name, o in outcomes.items() if name.startswith("side channel: ")]
    assert [o.answer for o in side[:-1]] == [None] * (len(side) - 1)
    assert side[-1].answer is not None and SEALED in bytes.fromhex(side[-1].answer)
    # Every attack on the decode: the prompt's own answer, nothing pulled, no connection, one
    # refusal, for the reason pinned.
    plain = ("legitimate", "plain")
    decode_attacks = [o for o in outcomes.values() if o.prompt is not None and not o.attack.startswith(plain)]
    assert sorted(o.attack for o in decode_attacks) == sorted(REASONS)
    for o in decode_attacks:
        assert own_answer(stack, o), (o.attack, o.status)
        assert o.pulled_tokens == 0 and o.nixl_bytes == 0, o.attack
        assert o.refused == {REASONS[o.attack]: 1}, (o.attack, o.refused)
        assert o.connections == 0, o.attack
    # The last prompt attack met the decode's prefix cache holding the prompt's first blocks
    # (the plain request before it): it computed only the rest.
    cached = outcomes[CACHED_ATTACK[0]]
    assert cached.computed_tokens == len(PROMPTS[CACHED_ATTACK[1]]) - CACHED_BLOCKS * BLOCK_SIZE, cached
    setup = outcomes[f"plain: {CACHED_PREFIX}"]
    assert own_answer(stack, setup) and setup.refused == {} and setup.pulled_tokens == 0, setup
    # NIXL notifications from an agent the prefill never loaded: they arrived, were dropped, each
    # under the kind of the check that dropped it (the first of each kind is logged), and got no
    # answer.
    assert outcomes["NIXL notification: answers received"].answer == "{}"
    prefill_log = stack.prefill.log_path.read_text(errors="replace")
    for dropped in (
        "NIXL notification vLLM cannot parse",  # not utf-8, no colon
        "NIXL notification of an unknown kvcompose kind",
        "NIXL lease hello that the deployment key does not open",  # a hello in clear
        "NIXL lease question from an agent that said no hello",  # without a MAC, 10,000 ids
    ):
        assert f"dropped a {dropped}" in prefill_log, dropped
    # The legitimate requests before, between and after the attacks (a's the control for the
    # malformed fields): pulled whole, their own answers.
    legitimate = [o for name, o in outcomes.items() if name.startswith("legitimate")]
    assert len(legitimate) == 3
    for o in legitimate:
        assert own_answer(stack, o) and o.pulled_tokens == len(PROMPTS[o.prompt or ""]), (o.attack, o.status)
        assert o.refused == {}, o.attack
    # Both engines alive.
    assert stack.prefill.proc.poll() is None and stack.decode.proc.poll() is None


#: What a fuzzed field may hold: JSON's values, numbers at the edges included.
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = (
    "do_remote_prefill",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "tp_size",
    "remote_blocks_expiry_time",
    "kvcompose_sig",
    "kvcompose_expires",
    "kvcompose_prompt",
)


@pytest.fixture(scope="module")
def real_params(stack: Stack) -> dict[str, Any]:
    """Params of the prefill for ``a`` that the decode has read once (legitimately): no draw can
    then pull with them, whatever it keeps (at best ``replayed``, or ``expired`` later)."""
    (p,) = stack.prefill.generate([PROMPTS["a"]], 1, [{"do_remote_decode": True}])
    params = dict(p["kv_transfer_params"])
    s = decode_request(stack.decode, PROMPTS["a"], MAX_TOKENS, params)
    assert s.equals(stack.expected["a"]) and refusals(s.counters) == {}, (s.loaded, s.counters)
    return params


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    changes=st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3),
    dropped=st.sets(st.sampled_from(FIELDS), max_size=2),
    prompt=st.sampled_from(["a", "b", "c", "a+3"]),  # a's own, others, a + 3 tokens
)
# Drawn examples lean to a's own prompt: the others, each once for sure (a: replayed; a + 3 with
# a's params whole, then with their token count made to fit: prompt).
@example(changes={}, dropped=set(), prompt="a")
@example(changes={}, dropped=set(), prompt="a+3")
@example(changes={"remote_num_tokens": 203}, dropped=set(), prompt="a+3")
@example(changes={}, dropped=set(), prompt="b")
def test_fuzzed_params_never_stop_the_decode_and_every_answer_is_the_prompts_own(
    stack: Stack, real_params: dict[str, Any], changes: dict[str, Any], dropped: set[str], prompt: str
) -> None:
    params = {k: v for k, v in {**real_params, **changes}.items() if k not in dropped}
    s = decode_request(stack.decode, PROMPTS[prompt], MAX_TOKENS, params)
    event(f"prompt {prompt}, refused {sorted(refusals(s.counters))}")  # --hypothesis-show-statistics
    assert s.equals(stack.expected[prompt]), (changes, dropped, prompt)
    assert s.nixl_bytes == 0 and "pd" not in s.loaded, (refusals(s.counters), s.loaded)
    assert stack.decode.proc.poll() is None
