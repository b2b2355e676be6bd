"""vLLM's own OffloadingConnector on vLLM's CPU platform, configured by hand (no composition):
``spec_name: PortableTieringOffloadingSpec`` from ``kvcompose_cpu_offload.native`` with vLLM's
``fs`` tier behind host memory (marker ``engine``; three engine starts, about a minute on 2 cores).

A prompt evicted from the device prefix cache comes back from host memory; evicted from host
memory too, from the fs tier's files; and a restarted engine on the same directory finds it
there. Every answer is the single-engine baseline's, token ids and logprobs bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose_tools.e2e.flow import (
    CACHED_BY_SOURCE,
    NATIVE_LOADED_BYTES,
    delta,
    drop_prefix_cache,
    same_output,
    token_prompt,
)
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

#: Long (``make test-long``), out of CI's hour: the same tiers through the native examples'
#: composition, the fs tier after a restart included, run in ``make test``
#: (tools/tests/engine/test_native_tier.py).
pytestmark = [pytest.mark.engine, pytest.mark.long]

MAX_TOKENS = 8
PROMPT = token_prompt(60, 300)
#: Other prompts that push PROMPT's blocks out of a 1 MiB host pool (32 blocks of the tiny model).
FILLERS = [token_prompt(61 + i, 300) for i in range(3)]


def kv_config(root: Path) -> dict[str, Any]:
    """The raw KVTransferConfig: vLLM's connector, the plugin's tiering spec, vLLM's fs tier."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "PortableTieringOffloadingSpec",
            "spec_module_path": "kvcompose_cpu_offload.native",
            "cpu_bytes_to_use": 1 << 20,
            "secondary_tiers": [{"type": "fs", "root_dir": str(root)}],
        },
    }


def full(prompt: list[int]) -> int:
    """Tokens in the prompt's full blocks but the last token's (vLLM always computes the last one)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def ask(node: EngineNode, prompt: list[int]) -> tuple[dict[str, Any], dict[str, int], int]:
    """The answer, vLLM's ``prompt_tokens_cached_by_source`` (device left out) and the bytes the
    connector loaded, for one request."""
    before = node.metrics()
    answer = node.generate([prompt], MAX_TOKENS)[0]
    moved = delta(before, node.metrics())
    sources = {
        k[len(CACHED_BY_SOURCE) : -1]: int(n)
        for k, n in moved.items()
        if k.startswith(CACHED_BY_SOURCE) and not k.endswith("device}")
    }
    name = NATIVE_LOADED_BYTES
    loaded = int(sum(n for k, n in moved.items() if k == name or k.startswith(name + "{")))
    return answer, sources, loaded


def settle(node: EngineNode) -> None:
    """Step the engine so vLLM's deferred stores (started a step later) run and complete."""
    for _ in range(2):
        node.generate([PROMPT[:BLOCK_SIZE]], 1)
        time.sleep(0.3)


class Engines:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = str(make_model(0))
        self.root = tmp / "kv"
        self.nodes: list[EngineNode] = []
        self.baseline = self.start(EngineSpec("baseline", self.model, None), wait=False)
        self.native = self.start(self.native_spec("native"), wait=False)
        wait_all_ready(self.nodes)
        self.expected = self.baseline.generate([PROMPT], MAX_TOKENS)[0]

    def native_spec(self, name: str) -> EngineSpec:
        return EngineSpec(name, self.model, None, free_ports(1)[0], kv_config=kv_config(self.root))

    def start(self, spec: EngineSpec, wait: bool = True) -> EngineNode:
        node = EngineNode(spec, self.tmp)
        self.nodes.append(node)
        if wait:
            wait_all_ready([node])
        return node

    def restart_native(self) -> EngineNode:
        self.native.close()
        self.nodes.remove(self.native)
        self.native = self.start(self.native_spec("native-restarted"))
        return self.native

    def close(self) -> None:
        for node in self.nodes:
            node.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    stack = Engines.__new__(Engines)
    stack.nodes = []
    try:
        stack.__init__(tmp_path_factory.mktemp("native-offload"))  # type: ignore[misc]
        yield stack
    finally:
        stack.close()


def test_host_then_disk_then_a_restarted_engine(engines: Engines) -> None:
    node = engines.native
    cold, sources, _ = ask(node, PROMPT)
    assert sources == {} and same_output(cold["token_ids"], cold["logprobs"], engines.expected)
    settle(node)

    drop_prefix_cache(node)
    host, sources, loaded = ask(node, PROMPT)
    print(f"host: sources {sources}, {loaded:,} B loaded")
    assert sources == {"host": full(PROMPT)}, sources
    assert loaded > 0 and same_output(host["token_ids"], host["logprobs"], engines.expected)

    for other in FILLERS:  # push PROMPT out of the 1 MiB host pool; vLLM cascades it to the fs tier
        node.generate([other], 1)
        settle(node)
    drop_prefix_cache(node)
    disk, sources, loaded = ask(node, PROMPT)
    print(f"disk: sources {sources}, {loaded:,} B loaded")
    assert sources.get("disk", 0) > 0 and sum(sources.values()) == full(PROMPT), sources
    assert same_output(disk["token_ids"], disk["logprobs"], engines.expected)
    assert any(p.is_file() for p in engines.root.rglob("*")), "no block files on disk"

    node = engines.restart_native()
    again, sources, loaded = ask(node, PROMPT)
    print(f"restarted: sources {sources}, {loaded:,} B loaded")
    assert sources == {"disk": full(PROMPT)}, sources
    assert loaded > 0 and same_output(again["token_ids"], again["logprobs"], engines.expected)
