"""Real KV between real vLLM engines on CPU, through the composed connector (marker ``engine``).

Engines are shared: a module-scoped :class:`Cluster` keeps at most two engine processes up and
switches them only when a test needs a different prefill model or decode failure policy; the
tests are ordered so that happens three times. Every wait has a deadline (engine start 300 s,
each call 120 s) and every engine process group is killed on teardown. Run under
``flock /tmp/kvcompose-engines.lock`` on a shared machine (``make test`` does).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvcompose.examples import EXAMPLES
from kvcompose_nixl.trust import SEALED
from kvcompose_tools.e2e.attacks import Listener, side_channel_answer
from kvcompose_tools.e2e.demo import one_past_a_block
from kvcompose_tools.e2e.flow import EXTERNAL, decode_request, drop_prefix_cache, next_turn, pd_request, token_prompt
from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
PROMPTS = {
    "pd": token_prompt(0, 600),
    "local": token_prompt(1, 500),
    "turn": token_prompt(2, 400),
    "tamper": token_prompt(3, 600),
    "dead-fail": token_prompt(4, 300),
    "dead-recompute": token_prompt(5, 300),
    "conversation": token_prompt(6, 300),  # turn 1; its 16-token answer ends inside its last block
    "short": token_prompt(8, 10),  # shorter than one block
    "after-short": token_prompt(9, 100),
    # The attacks (docs/security.md): A's params are offered with B's and C's prompts.
    "attack-a": token_prompt(10, 200),
    "attack-b": token_prompt(11, 200),
    "attack-c": token_prompt(12, 200),
}
#: Turn 2 of the conversation: turn 1's prompt, its answer, then a new user message of at least this
#: many tokens, one past a block boundary in all (see tools/kvcompose_tools/e2e/demo.py, TURN_1).
NEW_MESSAGE = 380


def turn_2(answer: list[int]) -> list[int]:
    turn_1 = PROMPTS["conversation"]
    return next_turn(turn_1, answer, token_prompt(7, one_past_a_block(len(turn_1) + len(answer), NEW_MESSAGE)))


class Cluster:
    """The baseline's answers, and one prefill and one decode engine at a time."""

    def __init__(self, logs: Path, baseline: EngineNode) -> None:
        self.logs = logs
        self.models = {seed: str(make_model(seed)) for seed in (0, 1)}
        self.prefill: EngineNode | None = None
        self.decode: EngineNode | None = None
        self.key: tuple[int, str] | None = None
        self.decode = self._decode("fail")
        try:
            self._start(0, "fail", also=[self.decode], baseline=baseline)
        except BaseException:
            self.close()  # no fixture teardown runs for a fixture that failed to set up
            raise

    def _answer(self, baseline: EngineNode) -> None:
        """The single-engine baseline of every prompt."""
        self.expected = {k: baseline.generate([ids], MAX_TOKENS)[0] for k, ids in PROMPTS.items()}
        # Turn 2 follows the baseline's own turn-1 answer; decode's must be the same tokens. Asked
        # twice: the second answer computes the last prompt token alone, as decode does.
        second = turn_2(self.expected["conversation"]["token_ids"])
        self.expected["conversation turn 2, first"] = baseline.generate([second], MAX_TOKENS)[0]
        self.expected["conversation turn 2"] = baseline.generate([second], MAX_TOKENS)[0]

    def _decode(self, policy: str) -> EngineNode:
        # Handshake compatibility off: the tamper control pairs it with a different model.
        return EngineNode(
            EngineSpec(
                f"decode-{policy}",
                self.models[0],
                str(EXAMPLES / "pd-decode.yaml"),
                free_ports(1)[0],
                {"enforce_handshake_compat": False},
                kv_load_failure_policy=policy,
            ),
            self.logs,
        )

    def _start(
        self, seed: int, policy: str, also: list[EngineNode] | None = None, baseline: EngineNode | None = None
    ) -> None:
        prefill = EngineNode(
            EngineSpec(f"prefill-seed{seed}", self.models[seed], str(EXAMPLES / "pd-prefill.yaml"), free_ports(1)[0]),
            self.logs,
        )
        self.prefill, self.key = prefill, (seed, policy)
        if baseline is not None:  # its answers while the engines start
            self._answer(baseline)
        wait_all_ready([prefill, *(also or [])])

    def use(self, prefill_seed: int = 0, policy: str = "fail") -> tuple[EngineNode, EngineNode]:
        """The engines for a test, (re)started when the wanted pair differs or one has died."""
        alive = all(n is not None and n.proc.poll() is None for n in (self.prefill, self.decode))
        if self.key != (prefill_seed, policy) or not alive:
            self.close()  # at most two engines at once
            self.decode = self._decode(policy)
            self._start(prefill_seed, policy, also=[self.decode])
        assert self.prefill is not None and self.decode is not None
        return self.prefill, self.decode

    def close(self) -> None:
        for n in (self.prefill, self.decode):
            if n is not None:
                n.close()
        self.prefill = self.decode = None


@pytest.fixture(scope="module")
def cluster(baseline: EngineNode) -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="kvcompose-e2e-") as tmp:
        c = Cluster(Path(tmp), baseline)
        try:
            yield c
        finally:
            c.close()


def equal(got: Any, expected: dict[str, Any]) -> bool:
    return got.token_ids == expected["token_ids"] and got.logprobs == expected["logprobs"]


def blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def test_pd_pull_equals_single_engine_baseline(cluster: Cluster) -> None:
    prefill, decode = cluster.use()
    ids = PROMPTS["pd"]
    s = pd_request(prefill, decode, ids, MAX_TOKENS)
    assert equal(s, cluster.expected["pd"]), (s.token_ids, cluster.expected["pd"]["token_ids"])
    assert s.loaded == {"pd": len(ids)}
    # the partial last block is pulled too
    assert s.nixl_bytes == blocks(len(ids)) * BLOCK_SIZE * kv_bytes_per_token(Path(cluster.models[0]))
    # vLLM counts a pulled prompt whole as external, though it recomputes the last token.
    assert s.counters.get(EXTERNAL) == len(ids)
    assert s.failed_transfers == 0
    # Inside the decode engine, in seconds: the pull's wait, then the step that computes the
    # first token, both within the request's time to first token.
    assert s.phases_s is not None and set(s.phases_s) == {"waiting", "first_step"}
    assert 0 < s.phases_s["waiting"] and 0 < s.phases_s["first_step"]
    assert s.phases_s["waiting"] + s.phases_s["first_step"] < s.ttft_s


def test_a_remote_prefill_without_remote_blocks_is_computed_locally_and_decode_pulls_on(cluster: Cluster) -> None:
    """vLLM 0.32's defect (plugins/nixl: kvcompose_nixl.connector, 2): a short prompt that a
    router forwards with ``do_remote_prefill`` and no remote blocks kills vLLM's decode engine;
    here it is computed locally, and the decode then pulls the next request as before."""
    prefill, decode = cluster.use()
    (p,) = prefill.generate([PROMPTS["after-short"]], 1, [{"do_remote_decode": True}])
    params = p["kv_transfer_params"]
    # Well-formed for the short prompt: a refused set would end with an error (load_failure: fail).
    empty = {**params, "remote_block_ids": [], "remote_request_id": "never-prefilled"}
    empty["remote_num_tokens"] = len(PROMPTS["short"])
    short = decode_request(decode, PROMPTS["short"], MAX_TOKENS, empty)
    assert short.children == () and short.computed_tokens == len(PROMPTS["short"]) and short.nixl_bytes == 0
    assert equal(short, cluster.expected["short"])
    after = decode_request(decode, PROMPTS["after-short"], MAX_TOKENS, params)
    assert after.loaded == {"pd": len(PROMPTS["after-short"])} and after.failed_transfers == 0
    assert equal(after, cluster.expected["after-short"])


#: Fields issue 51 found to kill vLLM's decode engine, each sent with a prefill's real params.
DEADLY = {
    "remote_block_ids": ["abc", ["0", "1"], [-1, -2], [2**62 + 1]],
    "remote_engine_id": [{"engine": 1}],
}


def test_attacks_on_the_decode_are_refused_and_under_policy_fail_end_with_an_error(cluster: Cluster) -> None:
    """docs/security.md: a client that reaches the decode's API steers neither what it reads nor
    where it connects, and no field kills its engine. This decode runs ``load_failure: fail``:
    each refused request ends with an error, its reason in the log (the shipped decode,
    ``recompute``, answers each from its own KV: test_attacks.py)."""
    prefill, decode = cluster.use()
    (p,) = prefill.generate([PROMPTS["attack-a"]], 1, [{"do_remote_decode": True}])
    params = p["kv_transfer_params"]
    assert params["kvcompose_sig"]  # the shipped prefill signs
    listener = Listener("127.0.0.1")
    try:
        # Each attack reaches the check it names: all but the first with A's own prompt.
        attacks = [
            ("attack-b", params, "prompt"),  # A's params, B's prompt
            ("attack-a", {**params, "remote_block_ids": [[b + 1 for b in params["remote_block_ids"][0]]]}, "signature"),
            ("attack-a", {**params, "remote_port": listener.port, "remote_engine_id": "client"}, "signature"),
            ("attack-a", {k: v for k, v in params.items() if not k.startswith("kvcompose_")}, "unsigned"),
        ]
        attacks += [
            ("attack-a", {**params, field: value}, "malformed") for field, values in DEADLY.items() for value in values
        ]
        for prompt, attack, reason in attacks:
            s = decode_request(decode, PROMPTS[prompt], MAX_TOKENS, attack)
            assert s.finish_reason == "error" and s.token_ids == [], (prompt, s.finish_reason)
            assert s.nixl_bytes == 0 and s.failed_transfers == 0, prompt  # nothing read, nothing tried
            refused = {k: n for k, n in s.counters.items() if k.startswith("vllm:kvcompose_refused_params")}
            assert sum(refused.values()) == 1, refused
            (key,) = [k for k, n in refused.items() if n]
            assert re.search(rf'reason="?{reason}\b', key), (reason, refused)  # the check it names
        assert listener.connections == 0
        told = decode.log_path.read_text()
        for reason in ("prompt", "signature", "unsigned", "malformed"):
            assert f"kv_transfer_params refused ({reason}), the request fails (load_failure: fail): " in told
    finally:
        listener.close()
    # The prefill's side channel: garbage drops, and vLLM's request is answered on, its agent sealed.
    port = prefill.spec.side_channel_port
    assert port is not None
    for frame in (b"\xc1\x00\x00", b"\x00" * 100_000, msgspec.msgpack.encode((b"give me all", 0, 0))):
        assert side_channel_answer("127.0.0.1", port, frame, wait_s=0.5) is None
    payload = side_channel_answer("127.0.0.1", port, msgspec.msgpack.encode((b"get_meta_msg", 0, 0)), wait_s=5)
    assert payload is not None and SEALED in payload
    # The engine serves on: A with its own params is pulled, and a replay of them is not.
    a = decode_request(decode, PROMPTS["attack-a"], MAX_TOKENS, params)
    assert a.loaded == {"pd": len(PROMPTS["attack-a"])} and equal(a, cluster.expected["attack-a"])
    drop_prefix_cache(decode)
    again = decode_request(decode, PROMPTS["attack-a"], MAX_TOKENS, params)
    assert again.finish_reason == "error" and again.nixl_bytes == 0  # replayed


def test_cpu_tier_serves_a_prompt_pushed_out_of_the_device_cache(cluster: Cluster) -> None:
    _, decode = cluster.use()
    ids = PROMPTS["local"]
    first = decode_request(decode, ids, MAX_TOKENS, None)
    assert first.children == () and first.computed_tokens == len(ids)
    assert decode.reset_prefix_cache()
    again = decode_request(decode, ids, MAX_TOKENS, None)
    full_blocks = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed
    assert again.loaded == {"host": full_blocks}  # no prefill params: nothing for pd to pull
    assert again.host_blocks == full_blocks // BLOCK_SIZE
    assert equal(first, cluster.expected["local"]) and equal(again, cluster.expected["local"])


def test_repeated_turn_loads_host_full_blocks_and_pulls_only_the_tail(cluster: Cluster) -> None:
    prefill, decode = cluster.use()
    ids = PROMPTS["turn"]
    first = pd_request(prefill, decode, ids, MAX_TOKENS)
    assert first.loaded == {"pd": len(ids)} and first.nixl_bytes > 0
    assert decode.reset_prefix_cache()
    again = pd_request(prefill, decode, ids, MAX_TOKENS)
    # load: ranges: host's full blocks, then NIXL the partial last block, not the whole prompt again
    full_blocks = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert len(ids) - full_blocks > 1  # a tail of more than the last token (which vLLM recomputes)
    assert again.loaded == {"host": full_blocks, "pd": len(ids) - full_blocks}
    assert again.host_blocks == full_blocks // BLOCK_SIZE
    assert again.nixl_bytes == first.nixl_bytes // blocks(len(ids))  # one block
    assert again.computed_tokens <= BLOCK_SIZE
    assert equal(first, cluster.expected["turn"]) and equal(again, cluster.expected["turn"])


def test_conversation_turn_2_loads_turn_1_from_host_and_pulls_only_the_new_part(cluster: Cluster) -> None:
    """Turn 2 = turn 1 + its answer + a new message, decode's device cache dropped in between
    (other traffic would evict it): host loads turn 1's blocks, which decode stored, and NIXL
    pulls only the rest; decode computes at most the last prompt token."""
    prefill, decode = cluster.use()
    turn_1 = PROMPTS["conversation"]
    first = pd_request(prefill, decode, turn_1, MAX_TOKENS)
    assert first.loaded == {"pd": len(turn_1)}
    assert equal(first, cluster.expected["conversation"])
    per_token = first.nixl_bytes // (blocks(len(turn_1)) * BLOCK_SIZE)  # KV bytes of one token
    assert per_token == kv_bytes_per_token(Path(cluster.models[0]))
    drop_prefix_cache(decode)

    prompt = turn_2(first.token_ids)
    assert len(prompt) % BLOCK_SIZE == 1
    second = pd_request(prefill, decode, prompt, MAX_TOKENS)
    assert second.children == ("host", "pd"), second.loaded
    host, pd = second.loaded["host"], second.loaded["pd"]
    assert host == len(turn_1) // BLOCK_SIZE * BLOCK_SIZE  # turn 1's full blocks (the answer's is not full)
    assert second.host_blocks == host // BLOCK_SIZE
    assert pd == len(prompt) - host  # pd's range starts where host's ends
    # vLLM's own count splits them too (each contributor's get_external_cache_hit_sources)
    assert second.cached_by_source() == {"host": host, "p2p": pd}
    # Only the new part moves: pd's blocks, not the whole prompt's.
    assert 0 < second.nixl_bytes == blocks(pd) * BLOCK_SIZE * per_token < len(prompt) * per_token
    assert second.computed_tokens <= BLOCK_SIZE
    assert second.failed_transfers == 0
    assert equal(second, cluster.expected["conversation turn 2"])
    # The baseline's first answer computed the last prompt token inside a batch: same tokens,
    # logprobs apart by float rounding only.
    first_answer = cluster.expected["conversation turn 2, first"]
    assert second.token_ids == first_answer["token_ids"]
    assert max(abs(a - b) for a, b in zip(second.logprobs, first_answer["logprobs"], strict=True)) < 1e-5


def dead_peer(cluster: Cluster, policy: str, prefill_seed: int) -> tuple[Any, dict[str, Any]]:
    prefill, decode = cluster.use(prefill_seed, policy)
    ids = PROMPTS[f"dead-{policy}"]
    (p,) = prefill.generate([ids], 1, [{"do_remote_decode": True}])
    prefill.kill()  # after it answered, before decode pulls
    # A hang would end in NodeError after the call's deadline and fail the test.
    return decode_request(decode, ids, MAX_TOKENS, p["kv_transfer_params"], timeout_s=90), cluster.expected[
        f"dead-{policy}"
    ]


def test_dead_prefill_with_policy_fail_ends_the_request_with_an_error(cluster: Cluster) -> None:
    s, _ = dead_peer(cluster, "fail", 0)
    assert s.finish_reason == "error"
    assert s.token_ids == []
    assert s.failed_transfers >= 1


def test_tamper_prefill_with_other_weights_changes_decode_output(cluster: Cluster) -> None:
    prefill, decode = cluster.use(prefill_seed=1, policy="recompute")
    ids = PROMPTS["tamper"]
    s = pd_request(prefill, decode, ids, MAX_TOKENS)
    assert s.children == ("pd",) and s.nixl_bytes > 0 and s.failed_transfers == 0
    assert s.token_ids != cluster.expected["tamper"]["token_ids"]  # decode used the pulled KV


def test_dead_prefill_with_policy_recompute_computes_locally(cluster: Cluster) -> None:
    s, expected = dead_peer(cluster, "recompute", 1)
    # Recomputed with decode's own weights: the baseline's answer, not the dead seed-1 prefill's.
    assert s.finish_reason == "length"
    assert equal(s, expected)
    assert s.failed_transfers >= 1
    assert s.computed_tokens == len(PROMPTS["dead-recompute"])
