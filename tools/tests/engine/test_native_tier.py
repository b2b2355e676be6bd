"""vLLM's own OffloadingConnector as the host tier beside NIXL, in real engines on CPU (marker ``engine``).

The shipped ``native-prefill.yaml`` / ``native-decode.yaml``: the host child is ``native-offload``
(vLLM's ``OffloadingConnector``, its copies through the plugin's portable spec on this CPU
platform; docs/native-offload.md). Every answer must be the single-engine baseline's, token ids and
logprobs bit for bit:

* a prompt pulled over NIXL whole;
* the same prompt after the decode's own prefix cache was dropped: under ``load: ranges`` the
  host tier's full blocks, NIXL the tail. The host tier was *not* the child that loaded the
  first time (vLLM #46951: an offloading connector that stores blocks another, asynchronous
  connector was still filling keeps stale KV): its blocks must hold what NIXL wrote;
* a conversation's turn 2, served host + pd;
* the same under ``load: first-wins`` (the host tier alone serves the repeat) and, with
  ``disk_dir``, from vLLM's fs tier once host memory was dropped, and by a decode restarted on
  the same directory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.flow import (
    Served,
    decode_request,
    drop_prefix_cache,
    full_blocks,
    next_turn,
    pd_request,
    token_prompt,
)
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
PROMPTS = {
    "a": token_prompt(40, 500),
    "turn 1": token_prompt(41, 300),
    "b": token_prompt(42, 400),
    "disk": token_prompt(43, 450),
}


def decode_yaml(load: str, disk: Path | None = None) -> str:
    """The shipped native decode example with ``load`` and, given ``disk``, vLLM's fs tier."""
    data = yaml.safe_load((EXAMPLES / "native-decode.yaml").read_text())
    data["rules"]["load"] = load
    if disk is not None:
        data["connectors"][0]["options"]["disk_dir"] = str(disk)
        data["connectors"][0]["options"]["cpu_bytes"] = "1MiB"  # 32 blocks of the tiny model: blocks reach disk
    return yaml.safe_dump(data, sort_keys=False)


class Engines(Nodes):
    """The baseline's answers, one native prefill, and one native decode at a time."""

    def __init__(self, tmp: Path, baseline: EngineNode) -> None:
        super().__init__()
        self.tmp = tmp
        self.model = str(make_model(0))
        self.baseline = baseline
        self.decode: EngineNode | None = None
        self.prefill = EngineNode(
            EngineSpec("prefill", self.model, str(EXAMPLES / "native-prefill.yaml"), free_ports(1)[0]), tmp
        )
        self.nodes.append(self.prefill)
        self.expected = {k: baseline.generate([ids], MAX_TOKENS)[0] for k, ids in PROMPTS.items()}
        wait_all_ready([self.prefill])

    def expect(self, name: str, prompt: list[int]) -> dict[str, Any]:
        if name not in self.expected:
            self.expected[name] = self.baseline.generate([prompt], MAX_TOKENS)[0]
        return self.expected[name]

    def decode_with(self, name: str, text: str) -> EngineNode:
        """A decode engine of composition ``text``, the running one stopped first."""
        if self.decode is not None:
            self.decode.close()
            self.nodes.remove(self.decode)
        path = self.tmp / f"{name}.yaml"
        path.write_text(text)
        self.decode = EngineNode(EngineSpec(name, self.model, str(path), free_ports(1)[0]), self.tmp)
        self.nodes.append(self.decode)
        wait_all_ready([self.decode])
        return self.decode


@pytest.fixture(scope="module")
def engines(baseline: EngineNode) -> Iterator[Engines]:
    yield from module_stack(Engines, "kvcompose-e2e-native-", baseline)


def full(prompt: list[int]) -> int:
    return full_blocks(prompt, BLOCK_SIZE)


def show(label: str, s: Served) -> None:
    print(
        f"{label}: served by {s.served_by()}, {s.host_bytes:,} B from host, {s.nixl_bytes:,} B over NIXL, "
        f"vLLM's sources {s.cached_by_source()}"
    )


def settle(decode: EngineNode, prompt: list[int]) -> None:
    """Let the host tier's deferred stores of ``prompt`` finish (vLLM starts them a step later):
    a local request of one token steps the engine."""
    decode.generate([prompt[:BLOCK_SIZE]], 1)
    time.sleep(0.5)


def test_ranges_host_prefix_then_nixl_and_every_answer_is_the_baselines(engines: Engines) -> None:
    decode = engines.decode_with("decode-ranges", decode_yaml("ranges"))
    a = PROMPTS["a"]
    first = pd_request(engines.prefill, decode, a, MAX_TOKENS)
    show("a", first)
    assert first.loaded == {"pd": len(a)} and first.equals(engines.expected["a"])
    settle(decode, PROMPTS["b"])
    drop_prefix_cache(decode)
    again = pd_request(engines.prefill, decode, a, MAX_TOKENS)
    show("a again", again)
    # The host tier stored what NIXL wrote (vLLM #46951: not stale blocks), and serves it.
    assert again.loaded == {"host": full(a), "pd": len(a) - full(a)}, again.loaded
    assert again.host_bytes > 0 and again.equals(engines.expected["a"])
    # A conversation: turn 2 = turn 1 + its answer + a new message; host holds turn 1.
    t1 = pd_request(engines.prefill, decode, PROMPTS["turn 1"], MAX_TOKENS)
    assert t1.equals(engines.expected["turn 1"])
    turn_2 = next_turn(PROMPTS["turn 1"], t1.token_ids, token_prompt(44, 200))
    settle(decode, PROMPTS["b"])
    drop_prefix_cache(decode)
    t2 = pd_request(engines.prefill, decode, turn_2, MAX_TOKENS)
    show("turn 2", t2)
    assert t2.children == ("host", "pd") and t2.equals(engines.expect("turn 2", turn_2))


# `make test-long`, out of CI's hour (a decode of its own): first-wins through the native host tier;
# test_three_tiers.py keeps first-wins in an engine in `make test`.
@pytest.mark.long
def test_first_wins_the_host_tier_alone_serves_the_repeat(engines: Engines) -> None:
    decode = engines.decode_with("decode-first-wins", decode_yaml("first-wins"))
    b = PROMPTS["b"]
    first = pd_request(engines.prefill, decode, b, MAX_TOKENS)
    assert first.loaded == {"pd": len(b)} and first.equals(engines.expected["b"])
    settle(decode, PROMPTS["a"])
    drop_prefix_cache(decode)
    again = decode_request(decode, b, MAX_TOKENS, None)  # a local request: only the host tier can serve it
    show("b again", again)
    assert again.loaded == {"host": full(b)} and again.equals(engines.expected["b"])


def test_the_fs_tier_serves_after_host_memory_and_after_a_restart(engines: Engines, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    text = decode_yaml("ranges", disk)
    decode = engines.decode_with("decode-fs", text)
    p = PROMPTS["disk"]
    first = pd_request(engines.prefill, decode, p, MAX_TOKENS)
    assert first.equals(engines.expected["disk"])
    # Other prompts push p's blocks out of the small host pool, onto disk.
    for seed in range(50, 56):
        decode.generate([token_prompt(seed, 400)], 1)
    settle(decode, PROMPTS["a"])
    assert any(disk.rglob("*")), "nothing was written to the fs tier"
    drop_prefix_cache(decode)
    again = decode_request(decode, p, MAX_TOKENS, None)
    show("disk again", again)
    assert again.loaded == {"host": full(p)} and again.equals(engines.expected["disk"])
    assert again.cached_by_source() == {"disk": full(p)}  # vLLM's own count: from the fs tier
    # A decode restarted on the same directory finds the prefix there.
    restarted = engines.decode_with("decode-fs-restarted", text)
    after = decode_request(restarted, p, MAX_TOKENS, None)
    show("after a restart", after)
    assert after.loaded == {"host": full(p)} and after.equals(engines.expected["disk"])
    assert after.cached_by_source() == {"disk": full(p)}
