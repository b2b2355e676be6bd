"""Benchmark 5h: multi-turn conversations across a link, in time saved (issues 37 and 45).

Two hosts on this machine (:mod:`kvcompose_tools.e2e.hosts`): the prefill server on one, the decode
server on the other, vLLM's router in the root namespace (P/D mode, ``consistent_hash`` on
``X-Session-ID``, so a conversation stays on its decode). The link between the hosts is shaped to
:data:`REAL_LINKS` scaled by the model's KV bytes per token (:func:`scaled_rate`). Per side, the
same seeded conversations (:func:`kvcompose_tools.e2e.load.chat_load`): streamed chat completions,
each turn the whole history + the previous answer + a new message, a system prompt shared by
groups of conversations, a few clients at once; with the tiny model then vLLM's own ``vllm bench
serve --dataset-name prefix_repetition`` client (:func:`kvcompose_tools.e2e.load.prefix_load`).
Sides, one at a time on the same two hosts, their order flipping every run:

* ``bare``: vLLM's NixlConnector as shipped, the class vLLM registers (no kvcompose class; its
  side channel through vLLM's ``VLLM_NIXL_SIDE_CHANNEL_*``; NIXL's default progress thread);
* ``nixl-plugin``: the nixl plugin's class alone, the examples' NIXL child (the fair baseline for
  the composite's own cost: the same NIXL settings as the composed sides);
* ``MultiConnector``: vLLM's MultiConnector over the examples' children on both (first-wins);
* ``kvcompose``: the shipped examples (host tier on both, ``load: ranges`` on the decode);
* ``kvcompose-first-wins``: the examples with ``load: first-wins`` on the decode;
* ``MultiConnector-native``: vLLM's MultiConnector over the native examples' children (NIXL and
  vLLM's ``OffloadingConnector`` as the host tier, issue 52);
* ``kvcompose-native``: the native examples (``native-prefill.yaml``, ``native-decode.yaml``:
  ``load: ranges`` on the decode);
* ``kvcompose-trust-off`` (not run unless chosen, :data:`SIDES_ENV`): the examples without the
  deployment key on either instance (no signature, no sealed agent metadata, no MAC on lease
  messages; the decode's field checks run either way), for the cost of trust on TTFT (issue 51).
  Without a key the nixl type refuses a side channel beyond loopback unless
  ``insecure_side_channel: true`` says so (these hosts' network reaches nothing else); vLLM's
  ``VLLM_NIXL_SIDE_CHANNEL_HOST`` places both (as for ``bare``), and the decode's ``peers`` names
  the prefill's host (without a key it connects to loopback only, else).
* ``vllm-p2p`` (not run unless chosen, issue 61): vLLM's ``OffloadingConnector`` alone on both
  (the name vLLM registers; its CPU tier the host tier's size, ``secondary_tiers`` one ``p2p``
  tier on each host's address, :func:`vllm_p2p`), P/D through that tier: in the router's place
  :mod:`kvcompose_tools.e2e.p2p_proxy` sets the role keys as llm-d's routing sidecar does
  (``remote_decoder`` on the prefill leg, ``remote_prefiller`` naming the prefill's p2p socket on
  the decode leg), which vllm-router 0.1.17 does not know;
* ``kvcompose-p2p`` (not run unless chosen, issue 61): the native examples' host tier alone with a
  ``p2p`` tier, signed with the examples' key (:func:`p2p_only`), behind vllm-router unchanged:
  the plugin's class maps the router's ``do_remote_decode`` onto the tier's roles. No NIXL child,
  so that it and ``vllm-p2p`` move KV the same way and differ in the composite, the signing and
  the router only.

A single engine without P/D answers the same conversations first (the baseline the answers are
compared with, token ids). :data:`WORKLOADS` sizes everything by model: the conversations' KV
outgrows both instances' device KV and fits their host tiers. Per side run, before the
conversations, :data:`FIXED_PROBES` one-token prompts through the same stack measure the fixed
cost of a request (router, two engines, streaming), which a model's per-token costs must outweigh
for time saved to show; after everything measured, :data:`LONG_PROBES` fresh prompts one at a time
say by how much (their compute over the fixed cost). vLLM's own histograms say where each side's
time goes (:data:`PHASES`).
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.measure import Samples, paired, ratio
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import AllTargets, Case, CaseTarget, Result
from kvcompose_tools.e2e.flow import CACHED_BY_SOURCE, COMPUTED, NATIVE_LOADED_BYTES, NIXL_BYTES, delta
from kvcompose_tools.e2e.load import Load, Turn, chat_load, prefix_load
from kvcompose_tools.e2e.router import SESSION_HEADER
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec
from kvcompose_tools.e2e.stats import quantile
from kvcompose_tools.e2e.stream import address, send

SUBJECT = "kvcompose"
BARE = "bare"
MULTI = "MultiConnector"
TRUST_OFF = "kvcompose-trust-off"
#: The sides whose host tier is vLLM's OffloadingConnector (the native examples).
NATIVE = "kvcompose-native"
MULTI_NATIVE = "MultiConnector-native"
#: The sides run unless :data:`SIDES_ENV` names others.
SIDES = (BARE, "nixl-plugin", MULTI, SUBJECT, "kvcompose-first-wins", MULTI_NATIVE, NATIVE)
#: vLLM's OffloadingConnector alone on both, P/D through its p2p tier, the role keys set by
#: :mod:`kvcompose_tools.e2e.p2p_proxy` in the router's place (issue 61).
VLLM_P2P = "vllm-p2p"
#: kvcompose's ``native-offload`` with a ``p2p`` tier alone, keyed, behind vllm-router (issue 61).
P2P = "kvcompose-p2p"
#: The sides that move KV through vLLM's p2p tier instead of a NIXL connector.
P2P_SIDES = (VLLM_P2P, P2P)
ALL_SIDES = (*SIDES, TRUST_OFF, *P2P_SIDES)
#: Comma-separated sides to run instead of :data:`SIDES`, e.g. ``kvcompose,kvcompose-trust-off``
#: (``KVCOMPOSE_BENCH_SIDES=kvcompose,kvcompose-trust-off kvcompose bench --only multi-turn``).
SIDES_ENV = "KVCOMPOSE_BENCH_SIDES"
#: The sides kvcompose's figures are divided by.
BASELINES = (BARE, "nixl-plugin", MULTI, TRUST_OFF)
#: The ratios taken, (subject, baseline), where both ran: kvcompose against each baseline, and
#: each kvcompose composition against vLLM's MultiConnector of the same children.
PAIRS = (
    *((SUBJECT, b) for b in BASELINES),
    (NATIVE, MULTI_NATIVE),
    (NATIVE, BARE),
    # P/D through vLLM's p2p tier: against NIXL P/D with a host tier, and kvcompose's composition of it.
    (NATIVE, VLLM_P2P),
    (P2P, VLLM_P2P),
)
#: Comma-separated client counts to run every side at instead of the workload's (a load sweep),
#: e.g. ``KVCOMPOSE_BENCH_CLIENTS=1,5,10``.
LOADS_ENV = "KVCOMPOSE_BENCH_CLIENTS"
#: Comma-separated host-tier sizes (``cpu_bytes`` of every host tier) to run every side at instead
#: of the workload's, e.g. ``KVCOMPOSE_BENCH_HOST_BYTES=1GiB,256MiB`` (256 MiB: the examples' own).
HOST_BYTES_ENV = "KVCOMPOSE_BENCH_HOST_BYTES"
#: Bytes of KV per token of the tiny model (32 KiB a block of 32 tokens) and Llama-3-8B's
#: (2 x 32 layers x 8 KV heads x 128 dims x 2 bytes), which the links are scaled by.
TINY_KV_PER_TOKEN = 1024
LLAMA_8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: The links, as the 8B model would see them: a fast (100 GbE) and a slow (25 GbE) datacenter link.
REAL_LINKS = {"fast": 100e9, "slow": 25e9}


@dataclass(frozen=True)
class Workload:
    """The conversations and the engines' sizes for one model of
    :data:`~kvcompose_tools.e2e.model.MODELS`: chat users keep a few conversations going per
    instance; the first message carries a document or question (250-350 tokens), later ones are
    short follow-ups (:mod:`kvcompose_tools.e2e.load`)."""

    conversations: int
    turns: int
    clients: int
    #: Device blocks of each instance: less than the conversations' history.
    device_blocks: int
    #: Each host tier's ``cpu_bytes``: the conversations' history fits.
    host_bytes: str
    max_model_len: int
    #: The links the sides run on, and runs per side on each.
    links: tuple[str, ...]
    runs: int
    #: vLLM's prefix_repetition client after the conversations (its prompts are sized for the tiny model).
    prefix_load: bool
    system_tokens: int = 150
    group: int = 6


WORKLOADS = {
    # A fifth turn's history passed the tiny model's 1,024-token context (HTTP 400) in 8 of 24.
    "tiny": Workload(24, 4, 8, 128, "256MiB", 1024, ("fast", "slow"), 1, True),
    # 8 turns grow a history to about 1,300 tokens (21 MiB of KV); 10 of them outgrow 192 device
    # blocks (6,144 tokens) 2x, and fit a 1 GiB host tier 4x.
    "medium": Workload(10, 8, 5, 192, "1GiB", 4096, ("slow",), 5, False),
}
#: One-token prompts per side run that measure a request's fixed cost through the stack.
FIXED_PROBES = 8
#: After the conversations, prompts of :data:`LONG_PROBE_TOKENS` fresh tokens one at a time: their
#: TTFT less the fixed cost is what computing a history of that length costs on the same stack.
LONG_PROBES = 3
LONG_PROBE_TOKENS = 700
#: vLLM's histograms of where a request's time goes, per instance (seconds summed over requests).
PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill_step": "vllm:request_prefill_time_seconds",
    "decode_step": "vllm:request_decode_time_seconds",
    "ttft_in_engine": "vllm:time_to_first_token_seconds",
    "nixl_read": "vllm:nixl_xfer_time_seconds",
}
#: The time breakdown's parts (ms per request): (label, instance, phase). On the decode vLLM's
#: "prefill" phase of a remote prefill is its KV's arrival (NIXL read, host-tier load), what the
#: decode computes (first-wins: the tokens past the host tier's prefix) and the first token; the
#: NIXL read is shown apart. On the prefill the "prefill" phase holds its host tier's load too.
BREAKDOWN = (
    ("prefill: queue", "prefill", "queue"),
    ("prefill: compute", "prefill", "prefill_step"),
    ("decode: queue", "decode", "queue"),
    ("decode: NIXL read", "decode", "nixl_read"),
    ("decode: first step less the read (host-tier load, compute)", "decode", "prefill_step"),
    ("decode: later tokens", "decode", "decode_step"),
)
#: vLLM's counts of what its secondary tiers moved (``tiering/metrics.py``: completed blocks x the
#: CPU tier's chunk size, per ``tier``): into the CPU tier (read; the decode's p2p fetches) and out
#: of it (write; the prefill's blocks handed to the p2p tier).
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
TIER_WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
#: The issue's targets, turns 2+ TTFT p50 on the slow link, and requests/s.
TARGET_BARE = 0.5
TARGET_MULTI = 0.8
TARGET_TURN1 = 1.05
TARGET_RATE = 1.5


def scaled_rate(real_bits_per_s: float, kv_per_token: int = TINY_KV_PER_TOKEN) -> int:
    """The link rate at which a model of ``kv_per_token`` bytes of KV a token moves as many tokens
    per second as the 8B model on ``real_bits_per_s``, in whole Mbit/s."""
    return round(real_bits_per_s * kv_per_token / LLAMA_8B_KV_PER_TOKEN / 1e6) * 10**6


def compositions(
    side: str, workload: Workload, work: Path, p2p: Mapping[str, tuple[str, int]] | None = None
) -> tuple[Path, Path]:
    """The examples' prefill and decode compositions as ``side`` runs them (the native examples for
    :data:`NATIVE`, :data:`MULTI_NATIVE` and :data:`P2P`): the host tiers sized for ``workload``,
    ``load: first-wins`` on the decode for ``kvcompose-first-wins``, no key and no side-channel
    host (vLLM's environment places it) for :data:`TRUST_OFF`; for :data:`P2P` the native
    examples' host-tier child alone with a ``p2p`` tier on ``p2p[role]`` (host, port), signed
    with the examples' NIXL key (:func:`p2p_only`)."""
    import yaml

    from kvcompose.examples import pd_pair

    shipped = pd_pair("native" if side in (NATIVE, MULTI_NATIVE, P2P) else "simple")
    out = []
    for role, example in zip(("prefill", "decode"), shipped, strict=True):
        data = yaml.safe_load(example.read_text())
        if side == P2P:
            if p2p is None:
                raise ValueError(f"{P2P} needs each instance's p2p socket (host, port)")
            data = p2p_only(data, *p2p[role])
        for child in data["connectors"]:
            if child["type"] in ("cpu-offload", "native-offload"):
                child["options"]["cpu_bytes"] = workload.host_bytes
            if child["type"] == "nixl" and side == TRUST_OFF:
                for option in ("key_env", "key_file", "side_channel_host"):
                    child["options"].pop(option, None)
                # Beyond loopback without a key is refused unless the file says it is meant.
                child["options"]["insecure_side_channel"] = True
        if role == "decode" and side == "kvcompose-first-wins":
            data["rules"]["load"] = "first-wins"
        work.mkdir(parents=True, exist_ok=True)
        path = work / f"pd-{role}-{side}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        out.append(path)
    return out[0], out[1]


def p2p_only(example: dict[str, Any], host: str, port: int) -> dict[str, Any]:
    """A native example (its YAML as data) as P/D through vLLM's p2p tier: its ``native-offload``
    child alone, with ``tiers: [{type: p2p, host, port}]`` and the NIXL child's ``key_env`` (a role
    naming another host is refused as ``peer`` unless the prefill signed it), ``load: first-wins``
    (one child: nothing to range over); the example's other rules and ``load_failure`` kept."""
    children = example["connectors"]
    (nixl,) = [c for c in children if c["type"] == "nixl"]
    (host_tier,) = [dict(c) for c in children if c["type"] == "native-offload"]
    options = dict(host_tier.get("options") or {})
    options["tiers"] = [{"type": "p2p", "host": host, "port": port}]
    options["key_env"] = nixl["options"]["key_env"]
    host_tier["options"] = options
    rules = {**example.get("rules", {}), "load": "first-wins"}
    return {**example, "connectors": [host_tier], "rules": rules}


def vllm_p2p(host_bytes: str, host: str, port: int, load_failure: str | None = None) -> dict[str, Any]:
    """vLLM's ``OffloadingConnector`` as vLLM registers it (no module path: no kvcompose class),
    its CPU tier ``host_bytes`` and one secondary tier, vLLM's ``p2p`` on ``host:port``.

    The spec is vLLM's ``TieringOffloadingSpec`` through the plugin's
    ``PortableTieringOffloadingSpec`` (``kvcompose_cpu_offload.native``), named by vLLM's own
    ``spec_name``/``spec_module_path`` keys: on CUDA and XPU it builds vLLM's worker unchanged,
    and vLLM's own raises on a CPU platform (``docs/native-offload.md``). ``load_failure``:
    vLLM's ``kv_load_failure_policy`` (the native decode example's ``recompute``)."""
    from kvcompose.units import ByteSize

    extra = {
        "cpu_bytes_to_use": ByteSize.parse(host_bytes),
        "spec_name": "PortableTieringOffloadingSpec",
        "spec_module_path": "kvcompose_cpu_offload.native",
        "secondary_tiers": [{"type": "p2p", "host": host, "port": port}],
    }
    config: dict[str, Any] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    config["kv_connector_extra_config"] = extra
    if load_failure is not None:
        config["kv_load_failure_policy"] = load_failure
    return config


def native_load_failure(role: str) -> str | None:
    """The shipped native example's ``load_failure`` for ``role`` (``prefill`` or ``decode``)."""
    import yaml

    from kvcompose.examples import pd_pair

    prefill, decode = pd_pair("native")
    return yaml.safe_load((prefill if role == "prefill" else decode).read_text()).get("load_failure")


def specs(
    side: str,
    model: str,
    work: Path,
    p_port: int,
    d_port: int,
    p_host: str = "127.0.0.1",
    d_host: str = "127.0.0.1",
    workload: Workload = WORKLOADS["tiny"],
) -> tuple[tuple[EngineSpec, dict[str, str]], tuple[EngineSpec, dict[str, str]]]:
    """The prefill and decode servers of ``side`` with the environment each needs, their NIXL side
    channels (the p2p sides: their p2p tiers' control sockets) on ``p_host:p_port`` and
    ``d_host:d_port``."""
    from kvcompose.vllm.args import vllm_multiconnector
    from kvcompose_tools.bench.overload import side_channel_env, vllm_nixl
    from kvcompose_tools.bench.pd_ttft import nixl_alone
    from kvcompose_tools.e2e.spec import composed_kv_transfer_config

    if side not in ALL_SIDES:
        raise ValueError(f"unknown side {side!r}; choose from {ALL_SIDES}")
    sockets = {"prefill": (p_host, p_port), "decode": (d_host, d_port)}
    # vLLM's own connectors read no composition.
    own = side in (BARE, VLLM_P2P)
    prefill_yaml, decode_yaml = compositions(side, workload, work, sockets) if not own else (Path(), Path())
    sizes = {"num_gpu_blocks": workload.device_blocks, "max_model_len": workload.max_model_len}
    out = []
    for role, yaml_path, port, host, kv_role in (
        ("prefill", prefill_yaml, p_port, p_host, "kv_producer"),
        ("decode", decode_yaml, d_port, d_host, "kv_consumer"),
    ):
        name, opts = f"{side}-{role}", {"side_channel_host": host}
        if side in (SUBJECT, "kvcompose-first-wins", NATIVE):
            out.append((EngineSpec(name, model, str(yaml_path), port, opts, **sizes), {}))
        elif side == P2P:
            # No NIXL child: the tier's socket is in the composition.
            out.append((EngineSpec(name, model, str(yaml_path), **sizes), {}))
        elif side == VLLM_P2P:
            # The native example's load_failure (the decode's recompute), as kvcompose-p2p keeps it.
            kv = vllm_p2p(workload.host_bytes, host, port, native_load_failure(role))
            out.append((EngineSpec(name, model, kv_config=kv, **sizes), {}))
        elif side == TRUST_OFF:
            # No side_channel_host (not even the host's: the spec's None wins over it), vLLM's
            # environment instead; the decode connects to the prefill's host by peers.
            keyless: dict[str, Any] = {"side_channel_host": None}
            if role == "decode":
                keyless["peers"] = [p_host]
            out.append((EngineSpec(name, model, str(yaml_path), port, keyless, **sizes), side_channel_env(host, port)))
        elif side == BARE:
            env = side_channel_env(host, port)
            out.append((EngineSpec(name, model, kv_config=vllm_nixl(kv_role, None), **sizes), env))
        elif side == "nixl-plugin":
            out.append((EngineSpec(name, model, kv_config=nixl_alone(yaml_path, port, opts), **sizes), {}))
        else:
            multi = vllm_multiconnector(composed_kv_transfer_config(yaml_path, port, opts))
            out.append((EngineSpec(name, model, kv_config=multi, **sizes), {}))
    return out[0], out[1]


@dataclass
class SideRun:
    """One side's conversations (and prefix load) on one link, what the servers counted, and the
    fixed cost of a request through its stack (one-token prompts' TTFT)."""

    side: str
    link: str
    chat: Load
    prefix: Load
    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)
    decode_link_rx: int = 0
    fixed_ttft_s: list[float] = field(default_factory=list)
    long_ttft_s: list[float] = field(default_factory=list)

    def later(self) -> list[Turn]:
        return [t for t in self.chat.turns if t.turn >= 1]

    def figures(self) -> dict[str, Any]:
        """The table's row: TTFT p50/p90 of turn 1 and turns 2+, TPOT, requests/s, tokens
        computed per instance, NIXL bytes per request, host-tier hits, failures, the fixed cost
        and where the time went."""
        first = [t.ttft_s for t in self.chat.turns if t.turn == 0 and t.error is None and t.ttft_s is not None]
        later = [t.ttft_s for t in self.later() if t.error is None and t.ttft_s is not None]
        first, later = first or [float("inf")], later or [float("inf")]  # nothing served: infinitely slow
        tpot = [x for t in self.chat.turns if t.error is None and (x := t.tpot_s) is not None]
        requests = max(1, len(self.chat.turns))
        return {
            "turn1_ttft_p50_s": round(quantile(first, 0.5), 4),
            "turn1_ttft_p90_s": round(quantile(first, 0.9), 4),
            "later_ttft_p50_s": round(quantile(later, 0.5), 4),
            "later_ttft_p90_s": round(quantile(later, 0.9), 4),
            "tpot_p50_s": round(quantile(tpot, 0.5), 4),
            "requests_per_s": round(len(self.chat.served) / self.chat.wall_s, 3),
            "failed": len(self.chat.failed) + len(self.prefix.failed),
            "prefill_computed_tokens": int(self.prefill.get(COMPUTED, 0)),
            "decode_computed_tokens": int(self.decode.get(COMPUTED, 0)),
            "nixl_bytes_per_request": int(self.decode.get(NIXL_BYTES, 0) / requests),
            # vLLM's OffloadingConnector's loads into device memory (its CPU tier, where the p2p
            # tier lands what it fetched): the native sides' host path.
            "offload_load_bytes_per_request": {
                "prefill": int(summed(self.prefill, NATIVE_LOADED_BYTES) / requests),
                "decode": int(summed(self.decode, NATIVE_LOADED_BYTES) / requests),
            },
            # vLLM's own count of the secondary tiers' moves (the p2p sides': the p2p tier).
            "tier_bytes_per_request": {
                "prefill_write": int(summed(self.prefill, TIER_WRITE_BYTES) / requests),
                "decode_read": int(summed(self.decode, TIER_READ_BYTES) / requests),
            },
            # All that reached the decode's host (KV over NIXL or the p2p tier, and the HTTP requests).
            "decode_link_rx_bytes_per_request": int(self.decode_link_rx / requests),
            "host_hit_tokens": {
                "prefill": int(self.prefill.get(f"{CACHED_BY_SOURCE}host}}", 0)),
                "decode": int(self.decode.get(f"{CACHED_BY_SOURCE}host}}", 0)),
            },
            # vLLM's source ``p2p``: tokens a NIXL connector or the p2p tier brought from the peer.
            "p2p_hit_tokens": {
                "prefill": int(self.prefill.get(f"{CACHED_BY_SOURCE}p2p}}", 0)),
                "decode": int(self.decode.get(f"{CACHED_BY_SOURCE}p2p}}", 0)),
            },
            "decode_link_rx_bytes": self.decode_link_rx,
            "fixed_ttft_p50_s": round(quantile(self.fixed_ttft_s, 0.5), 4) if self.fixed_ttft_s else None,
            "compute_over_fixed": self.compute_over_fixed(),
            "phases_ms": {"prefill": phases(self.prefill, requests), "decode": phases(self.decode, requests)},
            "breakdown_ms": breakdown(self.prefill, self.decode, requests),
            "prefix_load": {k: round(v, 4) if isinstance(v, float) else v for k, v in self.prefix.summary().items()},
        }

    def compute_over_fixed(self) -> float | None:
        """A :data:`LONG_PROBE_TOKENS`-token prompt's compute (its TTFT less a one-token prompt's,
        medians) over the fixed cost: how far per-token costs outweigh a request's fixed ones."""
        if not self.fixed_ttft_s or not self.long_ttft_s:
            return None
        fixed = quantile(self.fixed_ttft_s, 0.5)
        return round((quantile(self.long_ttft_s, 0.5) - fixed) / fixed, 2)

    def ttft_by_turn(self) -> list[float]:
        """Median TTFT per turn index."""
        turns = max((t.turn for t in self.chat.turns), default=-1) + 1
        return [
            statistics.median(
                [t.ttft_s for t in self.chat.turns if t.turn == i and t.ttft_s is not None and t.error is None]
                or [float("nan")]
            )
            for i in range(turns)
        ]


def summed(moved: dict[str, float], name: str) -> float:
    """A counter's value over all its labels (``name`` and ``name{...}``)."""
    return sum(v for k, v in moved.items() if k == name or k.startswith(name + "{"))


def phases(moved: dict[str, float], requests: int) -> dict[str, float]:
    """Milliseconds per request of each of :data:`PHASES` that moved on an instance (the
    histogram's sum over the load's requests)."""
    return {
        name: round(moved.get(f"{metric}_sum", 0.0) / requests * 1e3, 2)
        for name, metric in PHASES.items()
        if moved.get(f"{metric}_count", 0.0)
    }


def breakdown(prefill: dict[str, float], decode: dict[str, float], requests: int) -> dict[str, float]:
    """:data:`BREAKDOWN`'s parts in ms per request; the decode's NIXL read is taken out of its
    "prefill" phase, which holds it (at most that phase)."""
    moved = {"prefill": phases(prefill, requests), "decode": phases(decode, requests)}
    nixl = min(moved["decode"].get("nixl_read", 0.0), moved["decode"].get("prefill_step", 0.0))
    out = {}
    for label, instance, phase in BREAKDOWN:
        value = nixl if phase == "nixl_read" else moved[instance].get(phase, 0.0)
        if instance == "decode" and phase == "prefill_step":
            value -= nixl
        out[label] = round(value, 2)
    return out


#: Two tokens whose logprobs are this close (nats) are a tie within float32 rounding: a prompt's
#: KV computed in other batches (P/D, a host tier, chunked prefill) may pick either.
NEAR_TIE = 1e-3


@dataclass
class Answers:
    """How one side's answers compare with the baseline's, turn by turn (token ids)."""

    #: (conversation, turn) answered exactly as the baseline did
    equal: int = 0
    #: where the answer parted from the baseline's at a token the baseline had within
    #: :data:`NEAR_TIE` of its own choice (and its conversation's later turns, whose prompts
    #: then differ, are not compared)
    near_ties: list[str] = field(default_factory=list)
    #: differing answers not explained by a near tie: wrong
    wrong: list[str] = field(default_factory=list)
    #: later turns of a conversation that parted at a near tie: another prompt than the baseline's
    not_compared: int = 0

    def summary(self) -> str:
        """``N equal, M parted at a near tie (K later turns not compared), W wrong``."""
        return (
            f"{self.equal} equal, {len(self.near_ties)} parted at a near tie ({self.not_compared} later turns "
            f"not compared), {len(self.wrong)} wrong"
        )


def mismatches(run: Load, baseline: Load) -> Answers:
    """``run``'s answers against ``baseline``'s, by (conversation, turn): equal, parted at a near
    tie, or wrong (:class:`Answers`). A turn is compared only when its prompt is the baseline's."""
    expected = {(t.conversation, t.turn): t for t in baseline.turns if t.error is None}
    out = Answers()
    for t in sorted(run.turns, key=lambda t: (t.conversation, t.turn)):
        want = expected.get((t.conversation, t.turn))
        if t.error is not None or want is None:
            continue
        if t.messages != want.messages:  # an earlier answer of the conversation parted at a near tie
            out.not_compared += 1
            continue
        where = f"conversation {t.conversation} turn {t.turn + 1}"
        if t.token_ids == want.token_ids:
            out.equal += 1
            continue
        i = next((k for k, (a, b) in enumerate(zip(t.token_ids, want.token_ids)) if a != b), None)
        tops = want.top[i] if i is not None and i < len(want.top) else {}
        got, chosen = (t.token_ids[i], want.token_ids[i]) if i is not None else (None, None)
        if got in tops and chosen in tops and abs(tops[got] - tops[chosen]) <= NEAR_TIE:
            out.near_ties.append(f"{where} token {i + 1} ({tops[chosen] - tops[got]:.1e} nats)")
        else:
            out.wrong.append(where)
    return out


def chat(url: str, model: str, tokenizer: Any, seed: int, workload: Workload) -> Load:
    """The benchmark's conversations (``workload``'s) through ``url``."""
    return chat_load(
        url,
        model,
        tokenizer,
        seed=seed,
        conversations=workload.conversations,
        turns=workload.turns,
        clients=workload.clients,
        system_tokens=workload.system_tokens,
        group=workload.group,
    )


def prompt_ttft(url: str, model: str, prompt: list[int], session: str, timeout_s: float = 120.0) -> float:
    """Seconds to the first streamed token of ``prompt`` (token ids; a completion of two tokens)
    through ``url``. A one-token prompt's is what a request costs whatever its length. The token
    ids come back with the text: a seeded model's first token may decode to no text at all."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    reply = send(address(url), body, headers={SESSION_HEADER: session}, timeout_s=timeout_s)
    if reply.kind != "answered" or reply.ttft_s is None:
        raise RuntimeError(f"a probe prompt through {url}: {reply.kind}: {reply.detail}")
    return reply.ttft_s


def baseline_answers(model: str, tokenizer: Any, logs: Path, seed: int, workload: Workload) -> Load:
    """The conversations through one engine without P/D (no connector), on this host."""
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.server import ServerNode

    spec = EngineSpec(
        "baseline", model, num_gpu_blocks=4 * workload.device_blocks, max_model_len=workload.max_model_len
    )
    node = ServerNode(spec, logs)
    try:
        wait_all_ready([node])
        return chat(node.url, model, tokenizer, seed, workload)
    finally:
        node.close()


def side_run(
    side: str, link: str, hosts: Any, model: str, tokenizer: Any, logs: Path, seed: int, workload: Workload
) -> SideRun:
    """Start ``side``'s servers in the hosts and its router here (:data:`VLLM_P2P`: the p2p
    proxy, :mod:`kvcompose_tools.e2e.p2p_proxy`); warm the pair; the fixed-cost probes, the
    conversations, then (tiny model) the prefix load, then the long probes; stop everything."""
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.p2p_proxy import P2pProxyNode
    from kvcompose_tools.e2e.ports import free_ports
    from kvcompose_tools.e2e.router import RouterNode
    from kvcompose_tools.e2e.server import ServerNode

    p_port, d_port = free_ports(2)
    p_host = hosts["prefill"].address
    (p_spec, p_env), (d_spec, d_env) = specs(
        side, model, logs, p_port, d_port, p_host, hosts["decode"].address, workload=workload
    )
    prefill = ServerNode(p_spec, logs, extra_env=p_env, host=hosts["prefill"])
    decode = ServerNode(d_spec, logs, extra_env=d_env, host=hosts["decode"])
    nodes: list[Any] = [prefill, decode]
    try:
        wait_all_ready([prefill, decode])
        router: RouterNode | P2pProxyNode
        if side == VLLM_P2P:
            # vllm-router 0.1.17 sets no p2p role key: the proxy sets them as llm-d's sidecar does.
            at = (p_host, p_port)
            router = P2pProxyNode(prefill.url, decode.url, at, logs, free_ports(1)[0], f"proxy-{side}-{link}")
        else:
            name = f"router-{side}-{link}"
            router = RouterNode([prefill], [decode], model, logs, policy="consistent_hash", name=name)
        nodes.append(router)
        router.wait_ready()
        # The pair's first use (handshake, first READ) and each engine's first pass: not measured.
        chat_load(router.url, model, tokenizer, seed=seed + 999, conversations=2, turns=2, clients=2)
        fixed = [prompt_ttft(router.url, model, [10 + k], f"fixed-{k}") for k in range(FIXED_PROBES)]
        before = prefill.metrics(), decode.metrics(), hosts["decode"].link_bytes()
        conversations = chat(router.url, model, tokenizer, seed, workload)
        after = prefill.metrics(), decode.metrics(), hosts["decode"].link_bytes()
        prefix = prefix_load(router.url, model, seed) if workload.prefix_load else Load("prefix", [], 1.0)
        # After everything measured: fresh prompts (no prefix anywhere), one at a time.
        rng = random.Random(f"{seed}-long")
        long = [
            prompt_ttft(router.url, model, [rng.randrange(5, 500) for _ in range(LONG_PROBE_TOKENS)], f"long-{k}")
            for k in range(LONG_PROBES)
        ]
        return SideRun(
            side,
            link,
            conversations,
            prefix,
            delta(before[0], after[0]),
            delta(before[1], after[1]),
            (after[2] - before[2]).rx,
            fixed,
            long,
        )
    finally:
        for node in reversed(nodes):
            node.close()


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    sides: tuple[str, ...] | None = None,
    links: tuple[str, ...] | None = None,
    model: str = "tiny",
    loads: tuple[int, ...] | None = None,
    host_bytes: tuple[str, ...] | None = None,
) -> Result:
    """Every side on every link of ``model``'s workload (module docstring) at each client count
    of ``loads`` (else :func:`chosen_loads`, else the workload's) and each host-tier size of
    ``host_bytes`` (else :func:`chosen_host_bytes`, else the workload's); the table, ratios and targets.
    ``repeats`` and ``links`` override the workload's; ``sides`` (else :func:`chosen_sides`)
    :data:`SIDES`."""
    from kvcompose_tools.e2e.chat import load_tokenizer
    from kvcompose_tools.e2e.hosts import Hosts, format_rate
    from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model, model_config

    sides = sides or chosen_sides()
    path = make_model(0, config=model_config(model))  # a ValueError naming the models for another name
    workload = WORKLOADS[model]
    loads = loads or chosen_loads() or (workload.clients,)
    sizes = host_bytes or chosen_host_bytes() or (workload.host_bytes,)
    runs = repeats or workload.runs
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-multi-turn-"))
    kv_per_token = kv_bytes_per_token(path)
    model_dir = str(path)
    tokenizer = load_tokenizer(model_dir)
    chosen = [
        point(link, clients, workload, size)
        for link in (links or workload.links)
        for size in sizes
        for clients in loads
    ]
    done: dict[str, dict[str, list[SideRun]]] = {p: {s: [] for s in sides} for p in chosen}
    answers: dict[str, list[Answers]] = {f"{p}/{side}": [] for p in chosen for side in sides}
    t0 = time.monotonic()
    with engine_lock(echo=echo):
        baseline = baseline_answers(model_dir, tokenizer, logs, 0, workload)
        echo(f"   baseline (one engine, no P/D): {len(baseline.served)} answers, {len(baseline.failed)} failed")
        for at in chosen:
            link, clients, size = parse_point(at, workload)
            rate = format_rate(scaled_rate(REAL_LINKS[link], kv_per_token))
            load = replace(workload, clients=clients, host_bytes=size)
            with Hosts(["prefill", "decode"], link=rate) as hosts:
                for r in range(runs):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        one = side_run(side, link, hosts, model_dir, tokenizer, logs, 0, load)
                        done[at][side].append(one)
                        answers[f"{at}/{side}"].append(mismatches(one.chat, baseline))
                        f = one.figures()
                        echo(
                            f"   {label(at, f'{clients} at a time')} ({rate}) run {r + 1} {side}: "
                            f"turn 1 TTFT p50 {f['turn1_ttft_p50_s']} s, "
                            f"turns 2+ p50 {f['later_ttft_p50_s']} p90 {f['later_ttft_p90_s']} s, "
                            f"{f['requests_per_s']} req/s, one-token TTFT {f['fixed_ttft_p50_s']} s, "
                            f"NIXL {f['nixl_bytes_per_request']} B/req, "
                            f"decode link rx {f['decode_link_rx_bytes_per_request']} B/req, "
                            f"computed P {f['prefill_computed_tokens']} D {f['decode_computed_tokens']} tokens, "
                            f"p2p-source tokens D {f['p2p_hit_tokens']['decode']}, "
                            f"p2p tier {f['tier_bytes_per_request']['decode_read']} B/req, failed {f['failed']}, "
                            f"answers: {answers[f'{at}/{side}'][-1].summary()}"
                        )
    return summarize(done, runs, quick, logs, answers, time.monotonic() - t0, model, kv_per_token)


def chosen_sides(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The sides :data:`SIDES_ENV` names (comma-separated), else :data:`SIDES`; a ValueError
    naming the sides for an unknown one."""
    text = (os.environ if environ is None else environ).get(SIDES_ENV, "")
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ALL_SIDES]
    if unknown:
        raise ValueError(f"${SIDES_ENV}: unknown side(s) {unknown}; choose from {', '.join(ALL_SIDES)}")
    return names or SIDES


def chosen_loads(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The client counts :data:`LOADS_ENV` names (comma-separated), else none (the workload's); a
    ValueError for one that is not a positive whole number."""
    text = (os.environ if environ is None else environ).get(LOADS_ENV, "")
    names = [n.strip() for n in text.split(",") if n.strip()]
    if any(not n.isdigit() or int(n) < 1 for n in names):
        raise ValueError(f"${LOADS_ENV}: {text!r} is not a comma-separated list of client counts (1 or more)")
    return tuple(int(n) for n in names)


def chosen_host_bytes(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The host-tier sizes :data:`HOST_BYTES_ENV` names (comma-separated), else none (the
    workload's); a ValueError for one that is not a size."""
    from kvcompose.units import ByteSize

    text = (os.environ if environ is None else environ).get(HOST_BYTES_ENV, "")
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        try:
            ByteSize.parse(n)
        except ValueError as exc:
            raise ValueError(f"${HOST_BYTES_ENV}: {exc}") from None
    return names


HOST_TIERS_SUFFIX = " host tiers"


def point(link: str, clients: int, workload: Workload, host_bytes: str | None = None) -> str:
    """Where a side ran: the link, then the clients and the host tiers' size where they are not
    ``workload``'s (``slow``, ``slow, 10 clients``, ``slow, 1 client, 256MiB host tiers``); the
    cases' labels start with it."""
    parts = [link]
    if clients != workload.clients:
        parts.append(f"{clients} client{'s' if clients > 1 else ''}")
    if host_bytes is not None and host_bytes != workload.host_bytes:
        parts.append(host_bytes + HOST_TIERS_SUFFIX)
    return ", ".join(parts)


def parse_point(at: str, workload: Workload) -> tuple[str, int, str]:
    """:func:`point`'s (link, clients, host tiers' size)."""
    link, *rest = at.split(", ")
    clients, size = workload.clients, workload.host_bytes
    for part in rest:
        if part.endswith(HOST_TIERS_SUFFIX):
            size = part.removesuffix(HOST_TIERS_SUFFIX)
        else:
            clients = int(part.split()[0])
    return link, clients, size


def label(at: str, kind: str) -> str:
    """A case's label: ``slow link, turns 2+``; ``slow link, 10 clients, turns 2+``."""
    link, _, clients = at.partition(", ")
    return ", ".join(x for x in (f"{link} link", clients, kind) if x)


def ordering(per_run: Samples) -> str:
    """``"<"`` when every run's ratio is under 1, ``">"`` when every one is over, else
    ``"undecided"``: an ordering is claimed only where no run crosses 1."""
    if per_run.values and per_run.max < 1:
        return "<"
    if per_run.values and per_run.min > 1:
        return ">"
    return "undecided"


def summarize(
    done: dict[str, dict[str, list[SideRun]]],
    runs: int,
    quick: bool,
    logs: Path,
    answers: dict[str, list[Answers]],
    wall_s: float,
    model: str = "tiny",
    kv_per_token: int = TINY_KV_PER_TOKEN,
) -> Result:
    """Cases per link (and client count, :func:`point`): turn 1 and turns 2+ (samples: each run's
    TTFT p50) and requests/s; per case the per-run ratios of each of :data:`PAIRS` that ran (the
    runs of one round were interleaved) and whether they all lie on one side of 1; the time
    breakdown per side."""
    from kvcompose_tools.e2e.hosts import format_rate

    workload = WORKLOADS[model]
    # Each run's figures, computed once: every case, the breakdown and the notes read them.
    figs = {
        link: {side: [r.figures() for r in rs] for side, rs in by_side.items() if rs} for link, by_side in done.items()
    }
    cases, ratios, targets = [], [], []
    by_turn: dict[str, dict[str, list[float]]] = {}
    orderings: dict[str, dict[str, str]] = {}
    kinds = (
        ("turn 1", "turn1_ttft_p50_s", False),
        ("turns 2+", "later_ttft_p50_s", False),
        ("requests/s", "requests_per_s", True),
    )
    for link, by_side in done.items():
        for kind, key, higher in kinds:
            case = label(link, kind)
            samples = {side: Samples([f[key] for f in fs]) for side, fs in figs[link].items()}
            ran = [(s, b) for s, b in PAIRS if s in samples and b in samples]
            derived = {
                f"{s}/{b} per run": paired(samples, s, b, lambda x, y: x / y if y else float("inf")) for s, b in ran
            }
            orderings[case] = {name.removesuffix(" per run"): ordering(v) for name, v in derived.items()}
            extra = {"runs": figs[link]} if kind == "turns 2+" else {}
            cases.append(Case(case, samples, extra, derived))
            for s, b in ran:
                # A baseline that served nothing has no rate to divide by (its ordering says so).
                if samples[b].min > 0:
                    ratios.append(ratio(case, samples, s, b, higher_is_better=higher))
        by_turn[link] = {
            side: [statistics.median(turn) for turn in zip(*(r.ttft_by_turn() for r in rs), strict=False)]
            for side, rs in by_side.items()
            if rs
        }  # per turn index, the median over the runs
        if link == "slow" and SUBJECT in by_side:
            if BARE in by_side:
                targets.append(CaseTarget("<=", TARGET_BARE, SUBJECT, BARE, "slow link, turns 2+", "TTFT p50"))
                targets.append(CaseTarget("<=", TARGET_TURN1, SUBJECT, BARE, "slow link, turn 1", "TTFT p50"))
                targets.append(CaseTarget(">=", TARGET_RATE, SUBJECT, BARE, "slow link, requests/s", "requests/s"))
            if MULTI in by_side:
                targets.append(CaseTarget("<=", TARGET_MULTI, SUBJECT, MULTI, "slow link, turns 2+", "TTFT p50"))
    breakdowns = {link: {side: mean_breakdown(fs) for side, fs in by_side.items()} for link, by_side in figs.items()}
    fixed = {
        link: {side: median_of(f["fixed_ttft_p50_s"] for f in fs) for side, fs in by_side.items()}
        for link, by_side in figs.items()
    }
    over = {
        link: {side: median_of(f["compute_over_fixed"] for f in fs) for side, fs in by_side.items()}
        for link, by_side in figs.items()
    }
    compute = {
        link: {side: mean_of(f["phases_ms"]["prefill"].get("prefill_step") for f in fs) for side, fs in by_side.items()}
        for link, by_side in figs.items()
    }
    w = workload
    return Result(
        "multi_turn",
        "Multi-turn conversations across a link: TTFT of turn 1 and turns 2+, kvcompose vs bare P/D and MultiConnector",
        "s",
        1.0,
        cases,
        ratios,
        AllTargets("<=", TARGET_BARE, SUBJECT, BARE, tuple(targets)) if targets else None,
        runs,
        quick,
        [
            f"model {model} ({kv_per_token} B of KV a token); prefill and decode servers in two "
            "network namespaces, the link between them shaped (tbf) to "
            + ", ".join(
                f"{k}: {format_rate(scaled_rate(REAL_LINKS[k], kv_per_token))} (= {REAL_LINKS[k] / 1e9:g} Gbit/s "
                "for Llama-3-8B's KV)"
                for k in dict.fromkeys(parse_point(at, w)[0] for at in done)
            )
            + "; vLLM's router in the root namespace, consistent_hash on X-Session-ID",
            f"{w.conversations} conversations x {w.turns} turns, {w.clients} clients (clients and host tiers: unless a "
            "case names others), "
            "streamed chat; a "
            f"{w.system_tokens}-token system prompt per group of {w.group}; first messages 250-350 tokens, later "
            f"60-100, answers 16-24; {w.device_blocks} device blocks of {BLOCK_SIZE} tokens and a {w.host_bytes} host "
            "tier per instance",
            "bare: vLLM's NixlConnector as shipped on both; nixl-plugin: the examples' NIXL child alone; "
            "MultiConnector: vLLM's over the examples' children; kvcompose: the examples; kvcompose-first-wins: the "
            "examples with load: first-wins on decode; MultiConnector-native and kvcompose-native: the same over the "
            "native examples (vLLM's OffloadingConnector as the host tier)"
            + (
                f"; {TRUST_OFF}: the examples without the key (nothing signed, sealed or MACed; side channels placed "
                "by VLLM_NIXL_SIDE_CHANNEL_HOST, the decode's peers the prefill's host): "
                f"kvcompose/{TRUST_OFF} is what trust costs"
                if any(TRUST_OFF in by_side for by_side in done.values())
                else ""
            )
            + (
                f"; {VLLM_P2P}: vLLM's OffloadingConnector alone on both, P/D through its p2p tier, the role keys "
                "(remote_decoder, remote_prefiller) set by a proxy in the router's place as llm-d's sidecar sets "
                f"them; {P2P}: the native examples' host tier alone with a p2p tier, keyed, behind vllm-router"
                if any(s in by_side for by_side in done.values() for s in P2P_SIDES)
                else ""
            ),
            "a sample: one run's TTFT p50 (client side, first streamed token) or requests/s; ratio = subject / "
            "baseline; an ordering is claimed only where every run's ratio lies on the same side of 1: "
            + "; ".join(f"{case}: " + ", ".join(f"{p} {o}" for p, o in os_.items()) for case, os_ in orderings.items()),
            "fixed cost (one-token prompt TTFT p50 through the stack, median over runs, ms): "
            + "; ".join(
                f"{link}: " + ", ".join(f"{s} {v * 1e3:.0f}" for s, v in sides_.items() if v is not None)
                for link, sides_ in fixed.items()
            ),
            f"a {LONG_PROBE_TOKENS}-token prompt's compute over the fixed cost (one at a time, after the load): "
            + "; ".join(
                f"{link}: " + ", ".join(f"{s} {v:g}x" for s, v in sides_.items() if v is not None)
                for link, sides_ in over.items()
            ),
            "answers compared with one engine without P/D, token ids (a turn whose prompt is the baseline's): "
            + answers_note(answers),
            "bytes per request by path, median over runs (NIXL: NixlConnector's count on the decode; offload: "
            "vLLM's OffloadingConnector's loads into the decode's device memory, host tier and p2p tier alike; "
            "tier: vLLM's count of what the decode's secondary tiers (the p2p tier) brought into its CPU tier; "
            "link: all the decode's host received, KV and HTTP): "
            + "; ".join(
                f"{link}: "
                + ", ".join(
                    f"{s} NIXL {median_of(f['nixl_bytes_per_request'] for f in fs):.0f}, offload "
                    f"{median_of(f['offload_load_bytes_per_request']['decode'] for f in fs):.0f}, tier "
                    f"{median_of(f['tier_bytes_per_request']['decode_read'] for f in fs):.0f}, link "
                    f"{median_of(f['decode_link_rx_bytes_per_request'] for f in fs):.0f}"
                    for s, fs in by_side.items()
                )
                for link, by_side in figs.items()
            ),
        ],
        {
            "ttft_by_turn": by_turn,
            "breakdown_ms": breakdowns,
            "fixed_ttft_s": fixed,
            "compute_over_fixed": over,
            "prefill_compute_ms_per_request": compute,
            "orderings": orderings,
            "answers": {k: [asdict(a) for a in v] for k, v in answers.items()},
            "engine_logs": str(logs),
            "wall_s_measured": round(wall_s, 1),
            "runs": runs,
            "model": model,
            "kv_bytes_per_token": kv_per_token,
        },
    )


def median_of(values: Any) -> float | None:
    """The median of the values that are not None (None when there is none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def mean_of(values: Any) -> float | None:
    """The mean of the values that are not None (None when there is none)."""
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 2) if present else None


def mean_breakdown(figures: list[dict[str, Any]]) -> dict[str, float]:
    """:func:`breakdown` averaged over a side's runs (their :meth:`SideRun.figures`), part by part."""
    parts = [f["breakdown_ms"] for f in figures]
    return {label: round(statistics.fmean(p[label] for p in parts), 2) for label, *_ in BREAKDOWN}


def answers_note(answers: dict[str, list[Answers]]) -> str:
    """The note on the answers: all equal, or per side what parted at near ties and what is wrong."""
    parted = {k: v for k, v in answers.items() if any(a.near_ties or a.wrong or a.not_compared for a in v)}
    if not parted:
        return "all equal"
    return "; ".join(
        f"{k}: " + ", ".join(a.summary() for a in v) + (f", e.g. {first}" if (first := _first(v)) else "")
        for k, v in parted.items()
    )


def _first(runs: list[Answers]) -> str:
    return next((w for a in runs for w in a.wrong), "") or next((n for a in runs for n in a.near_ties), "")
