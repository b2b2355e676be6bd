"""A third tier through the generic ``vllm`` type, in real vLLM engines on CPU (marker ``engine``).

Decode composes three children: ``host`` (cpu-offload, host memory), ``disk`` (vLLM's own
``ExampleConnector`` through ``type: vllm``: one safetensors file per layer and prompt under
``shared_storage_path``) and ``pd`` (nixl). A prompt decode computed is stored by every child
(``store: all``); with the device prefix cache and the host tier dropped, the same prompt is
served from disk and the answer is the single-engine baseline's, bit for bit. Under
``load: ranges`` one request is assembled from all three: the host tier's prefix, the disk's
middle (a synchronous load, run when vLLM schedules the request after the asynchronous ones)
and NIXL's tail. Run under ``flock /tmp/kvcompose-engines.lock``; ``pytest -s`` prints each
request's split.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcompose.examples import EXAMPLES
from kvcompose.testing.harness import connector_entry, multiconnector_config
from kvcompose_nixl import KEY_ENV_KEY, UCX_ERROR_HANDLING_KEY
from kvcompose_tools.e2e.flow import Served, decode_request, drop_prefix_cache, pd_request, token_prompt
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import BLOCK_SIZE, PD_KEY_ENV, EngineSpec

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
CHILDREN = ("host", "disk", "pd")
#: "sibling" shares only the first 256 tokens (16 blocks) with "local"; as long, so that its
#: prefix's KV comes from a forward pass of the same shape.
SHARED = 256
LOCAL = token_prompt(20, 500)
PROMPTS = {"local": LOCAL, "pd": token_prompt(21, 450), "sibling": LOCAL[:SHARED] + token_prompt(22, 500 - SHARED)}


def three_tiers(disk: Path, load: str) -> str:
    """The decode composition: the shipped P/D decode example with a disk tier between its two."""
    data = yaml.safe_load((EXAMPLES / "pd-decode.yaml").read_text())
    host, pd = data["connectors"]
    disk_child: dict[str, Any] = {
        "name": "disk",
        "type": "vllm",
        "options": {
            "kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(disk)},
        },
    }
    if load == "ranges":
        # ExampleConnector asked at s answers the tokens of its file beyond s, and loads its whole
        # file (the prefix before s again, the same tokens' KV): it serves a range (docs/yaml.md).
        disk_child["options"]["range_loads"] = True
    data["connectors"] = [host, disk_child, pd]
    data["rules"]["load"] = load
    return yaml.safe_dump(data, sort_keys=False)


def dropin(disk: Path) -> dict[str, Any]:
    """vLLM's MultiConnector over its SimpleCPUOffloadConnector, ExampleConnector and NixlConnector
    (the tiers of :func:`three_tiers`), with no ``kvcompose`` entry. vLLM's own MultiConnector fails
    on this machine at engine start (SimpleCPUOffloadConnector's worker needs CUDA); the drop-in
    puts kvcompose's cpu-offload type, whose worker runs here, in its place."""
    # vLLM's NixlConnector ignores the first key; kvcompose's sets NIXL's UCX error handling with it
    # (one host: shared memory, not tcp; docs/e2e.md, cold start). The shipped prefill seals its
    # agent metadata with the deployment key: the decode names it too (docs/security.md).
    nixl = {UCX_ERROR_HANDLING_KEY: "none", "enforce_handshake_compat": False, KEY_ENV_KEY: PD_KEY_ENV}
    return multiconnector_config(
        connector_entry("SimpleCPUOffloadConnector", cpu_bytes_to_use=256 << 20),
        connector_entry("ExampleConnector", shared_storage_path=str(disk)),
        connector_entry("NixlConnector", "kv_consumer", **nixl),
        kv_role="kv_consumer",
    )


class Engines:
    """The baseline's answers, one prefill engine, and a three-tier decode engine per load rule."""

    def __init__(self, tmp: Path, baseline: EngineNode) -> None:
        self.tmp = tmp
        self.model = str(make_model(0))
        self.prefill = EngineNode(
            EngineSpec("prefill", self.model, str(EXAMPLES / "pd-prefill.yaml"), free_ports(1)[0]), tmp
        )
        try:
            self.expected = {k: baseline.generate([ids], MAX_TOKENS)[0] for k, ids in PROMPTS.items()}
            wait_all_ready([self.prefill])
        except BaseException:
            self.prefill.close()  # no fixture teardown runs for a fixture that failed to set up
            raise
        self.decode: EngineNode | None = None

    def decode_with(self, load: str) -> EngineNode:
        """The three-tier decode engine for ``load``: the running one when it is that one."""
        if self.decode is not None and self.decode.spec.name == f"decode-{load}":
            return self.decode
        disk = self.tmp / f"disk-{load}"
        path = self.tmp / f"three-tiers-{load}.yaml"
        path.write_text(three_tiers(disk, load))
        spec = EngineSpec(
            f"decode-{load}", self.model, str(path), free_ports(1)[0], {"enforce_handshake_compat": False}
        )
        return self._start(EngineNode(spec, self.tmp))

    def decode_dropin(self) -> EngineNode:
        """Decode from a MultiConnector config as vLLM's docs write one, plus kvcompose's module path."""
        port = free_ports(1)[0]
        spec = EngineSpec("decode-dropin", self.model, kv_config=dropin(self.tmp / "disk-dropin"))
        return self._start(EngineNode(spec, self.tmp, {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}))

    def _start(self, node: EngineNode) -> EngineNode:
        if self.decode is not None:
            self.decode.close()
        self.decode = node
        wait_all_ready([node])
        return node

    def close(self) -> None:
        for node in (self.decode, self.prefill):
            if node is not None:
                node.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, baseline: EngineNode) -> Iterator[Engines]:
    e = Engines(tmp_path_factory.mktemp("tiers"), baseline)
    yield e  # pytest closes them whatever the tests did
    e.close()


def drop_device_and_host(decode: EngineNode, tries: int = 50) -> None:
    """Drop the device prefix cache and every child's cache that vLLM can reset: the host tier's
    (SimpleCPUOffload's ``reset_cache``); ExampleConnector has none, its files stay."""
    for _ in range(tries):
        if decode.reset_prefix_cache(connectors=True):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the engine refused reset_prefix_cache(reset_connector=True) {tries} times")


def report(label: str, s: Served, expected: dict[str, Any]) -> None:
    print(f"{label}: served by {s.served_by()}, computed {s.computed_tokens}, equals baseline {s.equals(expected)}")


def full_blocks(prompt: list[int]) -> int:
    """Tokens of the prompt's full blocks but the last token's (vLLM always computes the last token)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_first_wins_serves_a_prompt_from_disk_after_host_and_device_were_dropped(engines: Engines) -> None:
    decode = engines.decode_with("first-wins")
    ids = PROMPTS["local"]
    first = decode_request(decode, ids, MAX_TOKENS, None, children=CHILDREN)
    assert first.children == () and first.computed_tokens == len(ids)
    drop_prefix_cache(decode)  # the device cache only: the host tier, first in order, serves
    from_host = decode_request(decode, ids, MAX_TOKENS, None, children=CHILDREN)
    drop_device_and_host(decode)
    from_disk = decode_request(decode, ids, MAX_TOKENS, None, children=CHILDREN)
    for label, s in (("computed", first), ("host", from_host), ("disk", from_disk)):
        report(label, s, engines.expected["local"])
    assert from_host.loaded == {"host": full_blocks(ids)}
    assert from_disk.loaded == {"disk": full_blocks(ids)}
    assert from_disk.computed_tokens == len(ids) - full_blocks(ids)
    assert all(s.equals(engines.expected["local"]) for s in (first, from_host, from_disk))

    # P/D through the same three children: nothing local holds a new prompt, so pd pulls it.
    pulled = pd_request(engines.prefill, decode, PROMPTS["pd"], MAX_TOKENS, children=CHILDREN)
    assert pulled.loaded == {"pd": len(PROMPTS["pd"])} and pulled.nixl_bytes > 0
    assert pulled.equals(engines.expected["pd"])


def test_ranges_serve_host_then_nixl_and_disk_then_nixl_when_host_is_gone(engines: Engines) -> None:
    """Under ``load: ranges`` the disk tier (ExampleConnector, synchronous) chains with the
    asynchronous NIXL pull: disk loads the prompt's full blocks when vLLM schedules the request
    after NIXL's tail arrived."""
    decode = engines.decode_with("ranges")
    ids = PROMPTS["pd"]
    first = pd_request(engines.prefill, decode, ids, MAX_TOKENS, children=CHILDREN)
    drop_prefix_cache(decode)
    host_then_pd = pd_request(engines.prefill, decode, ids, MAX_TOKENS, children=CHILDREN)
    drop_device_and_host(decode)
    from_disk = pd_request(engines.prefill, decode, ids, MAX_TOKENS, children=CHILDREN)
    for label, s in (("pulled", first), ("host + pd", host_then_pd), ("disk + pd", from_disk)):
        report(label, s, engines.expected["pd"])
    assert first.loaded == {"pd": len(ids)}
    host = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert host_then_pd.loaded == {"host": host, "pd": len(ids) - host}
    assert from_disk.loaded == {"disk": full_blocks(ids), "pd": len(ids) - full_blocks(ids)}
    assert all(s.equals(engines.expected["pd"]) for s in (first, host_then_pd, from_disk))


def test_ranges_assemble_one_request_from_host_disk_and_nixl(engines: Engines) -> None:
    """Disk holds the whole prompt, the host tier only the prefix it shares with a sibling
    prompt, the prefill instance everything: host loads ``[0, 256)``, disk ``[256, 480)`` (its
    file ends at the last full block before the prompt's last token) and NIXL ``[480, 500)``."""
    decode = engines.decode_with("ranges")
    ids = PROMPTS["local"]
    first = decode_request(decode, ids, MAX_TOKENS, None, children=CHILDREN)  # disk stores the prompt
    drop_device_and_host(decode)
    sibling = decode_request(decode, PROMPTS["sibling"], MAX_TOKENS, None, children=CHILDREN)  # host: the prefix
    drop_prefix_cache(decode)
    assembled = pd_request(engines.prefill, decode, ids, MAX_TOKENS, children=CHILDREN)
    report("computed", first, engines.expected["local"])
    report("sibling, computed", sibling, engines.expected["sibling"])
    report("host + disk + pd", assembled, engines.expected["local"])
    disk_end = full_blocks(ids)
    print(
        f"one request, {len(ids)} tokens: host [0, {SHARED}) + disk [{SHARED}, {disk_end}) + pd [{disk_end}, "
        f"{len(ids)}); counters {assembled.loaded}; NIXL bytes {assembled.nixl_bytes}; "
        f"computed on decode {assembled.computed_tokens}"
    )
    assert first.children == () and sibling.children == ()
    assert assembled.loaded == {"host": SHARED, "disk": disk_end - SHARED, "pd": len(ids) - disk_end}
    assert assembled.nixl_bytes > 0 and assembled.failed_transfers == 0
    assert first.equals(engines.expected["local"]) and sibling.equals(engines.expected["sibling"])
    assert assembled.equals(engines.expected["local"])


def test_dropin_multiconnector_config_runs_the_three_tiers(engines: Engines) -> None:
    """The same three tiers from a MultiConnector config taken as it is (docs/migrating.md)."""
    decode = engines.decode_dropin()
    composed = [line for line in decode.log_tail(400).splitlines() if "taken as it is" in line]
    print(composed[0] if composed else "no drop-in log line")
    assert len(composed) == 1
    assert composed[0].endswith(
        "composed with kvcompose's defaults (load: first-wins in list order, store: all, metadata: merge): "
        "simple-cpu-offload (cpu-offload, both), example (vllm ExampleConnector, both), nixl (nixl, consumer); "
        "`kvcompose import` writes it as YAML"
    )
    children = ("simple-cpu-offload", "example", "nixl")
    ids = PROMPTS["pd"]
    first = pd_request(engines.prefill, decode, ids, MAX_TOKENS, children=children)
    drop_device_and_host(decode)
    from_disk = pd_request(engines.prefill, decode, ids, MAX_TOKENS, children=children)
    for label, s in (("pulled", first), ("disk", from_disk)):
        report(label, s, engines.expected["pd"])
    assert first.loaded == {"nixl": len(ids)}
    assert from_disk.loaded == {"example": full_blocks(ids)}
    assert first.equals(engines.expected["pd"]) and from_disk.equals(engines.expected["pd"])
