"""Benchmark 5h: multi-turn conversations across a link, in time saved (issue 37).

Two hosts on this machine (:mod:`kvcompose_tools.e2e.hosts`): the prefill server on one, the decode
server on the other, vLLM's router in the root namespace (P/D mode, ``consistent_hash`` on
``X-Session-ID``, so a conversation stays on its decode). The link between the hosts is shaped to
:data:`LINKS` (scaled to the tiny model's KV: module :func:`scaled_rate`). Per side, the same
seeded conversations (:func:`kvcompose_tools.e2e.load.chat_load`): streamed chat completions, each turn
the whole history + the previous answer + a new message, a system prompt shared by groups of
conversations, :data:`CLIENTS` at once; then vLLM's own ``vllm bench serve --dataset-name
prefix_repetition`` client (:func:`kvcompose_tools.e2e.load.prefix_load`). Sides, one at a time on the
same two hosts, their order flipping every run:

* ``bare``: vLLM's NixlConnector alone on both instances (vLLM's own prefix cache only);
* ``MultiConnector``: vLLM's MultiConnector over the examples' children on both (first-wins);
* ``kvcompose``: the shipped examples (host tier on both, ``load: ranges`` on the decode);
* ``kvcompose-first-wins``: the examples with ``load: first-wins`` on the decode.

A single engine without P/D answers the same conversations first (the baseline the answers are
compared with, token ids). The conversations' KV outgrows both instances' device KV
(:data:`DEVICE_BLOCKS` blocks) and fits the host tiers (256 MiB each).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.measure import Samples, ratio
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import AllTargets, Case, CaseTarget, Result
from kvcompose_tools.e2e.flow import CACHED_BY_SOURCE, COMPUTED, NIXL_BYTES, delta
from kvcompose_tools.e2e.load import Load, Turn, chat_load, prefix_load
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec
from kvcompose_tools.e2e.stats import quantile

SUBJECT = "kvcompose"
SIDES = ("bare", "MultiConnector", SUBJECT, "kvcompose-first-wins")
#: Bytes of KV per token: the tiny model's (32 KiB a block of 32 tokens) and
#: Llama-3-8B's (2 x 32 layers x 8 KV heads x 128 dims x 2 bytes), which the links are scaled by.
TINY_KV_PER_TOKEN = 1024
LLAMA_8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2
#: The links, as the 8B model would see them: a fast (100 GbE) and a slow (25 GbE) datacenter link.
REAL_LINKS = {"fast": 100e9, "slow": 25e9}
#: Conversations and clients: chat users keep a few conversations going per instance; the first
#: message carries a document or question (250-350 tokens), later ones are short follow-ups.
CONVERSATIONS = 24
TURNS = 4  # a fifth turn's history passed the demo model's 1,024-token context (HTTP 400) in 8 of 24
CLIENTS = 8
SYSTEM_TOKENS = 150
GROUP = 6
#: Device blocks of each instance: 4,096 tokens, less than the conversations' history.
DEVICE_BLOCKS = 128
RUNS = 1
#: vLLM's histograms of where a request's time goes, per instance (mean seconds per observation).
PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill_step": "vllm:request_prefill_time_seconds",
    "ttft_in_engine": "vllm:time_to_first_token_seconds",
    "nixl_read": "vllm:nixl_xfer_time_seconds",
}
#: The issue's targets, turns 2+ TTFT p50 on the slow link.
TARGET_BARE = 0.5
TARGET_MULTI = 0.8


def scaled_rate(real_bits_per_s: float) -> int:
    """The link rate at which the tiny model moves as many tokens per second as the 8B model on
    ``real_bits_per_s``: the real rate divided by the ratio of their KV bytes per token, in whole
    Mbit/s."""
    return round(real_bits_per_s * TINY_KV_PER_TOKEN / LLAMA_8B_KV_PER_TOKEN / 1e6) * 10**6


def specs(
    side: str, model: str, work: Path, p_port: int, d_port: int, p_host: str = "127.0.0.1", d_host: str = "127.0.0.1"
) -> tuple[EngineSpec, EngineSpec]:
    """The prefill and decode servers of ``side``, their NIXL side channels on ``p_host:p_port``
    and ``d_host:d_port`` (a bare connector's config is not a composition the kit can place)."""
    import yaml

    from kvcompose.examples import EXAMPLES
    from kvcompose.vllm.args import vllm_multiconnector
    from kvcompose_tools.bench.pd_ttft import nixl_alone
    from kvcompose_tools.e2e.spec import composed_kv_transfer_config

    prefill_yaml, decode_yaml = EXAMPLES / "pd-prefill.yaml", EXAMPLES / "pd-decode.yaml"
    p_opts, d_opts = {"side_channel_host": p_host}, {"side_channel_host": d_host}
    blocks = {"num_gpu_blocks": DEVICE_BLOCKS}
    if side in (SUBJECT, "kvcompose-first-wins"):
        if side != SUBJECT:
            data = yaml.safe_load(decode_yaml.read_text())
            data["rules"]["load"] = "first-wins"
            work.mkdir(parents=True, exist_ok=True)
            decode_yaml = work / "pd-decode-first-wins.yaml"
            decode_yaml.write_text(yaml.safe_dump(data, sort_keys=False))
        return (
            EngineSpec(f"{side}-prefill", model, str(prefill_yaml), p_port, p_opts, **blocks),
            EngineSpec(f"{side}-decode", model, str(decode_yaml), d_port, d_opts, **blocks),
        )
    if side == "bare":
        return (
            EngineSpec(f"{side}-prefill", model, kv_config=nixl_alone(prefill_yaml, p_port, p_opts), **blocks),
            EngineSpec(f"{side}-decode", model, kv_config=nixl_alone(decode_yaml, d_port, d_opts), **blocks),
        )
    if side == "MultiConnector":
        p_multi = vllm_multiconnector(composed_kv_transfer_config(prefill_yaml, p_port, p_opts))
        d_multi = vllm_multiconnector(composed_kv_transfer_config(decode_yaml, d_port, d_opts))
        return (
            EngineSpec(f"{side}-prefill", model, kv_config=p_multi, **blocks),
            EngineSpec(f"{side}-decode", model, kv_config=d_multi, **blocks),
        )
    raise ValueError(f"unknown side {side!r}; choose from {SIDES}")


@dataclass
class SideRun:
    """One side's conversations and prefix load on one link, and what the servers counted."""

    side: str
    link: str
    chat: Load
    prefix: Load
    prefill: dict[str, float] = field(default_factory=dict)
    decode: dict[str, float] = field(default_factory=dict)
    decode_link_rx: int = 0

    def later(self) -> list[Turn]:
        return [t for t in self.chat.turns if t.turn >= 1]

    def figures(self) -> dict[str, Any]:
        """The table's row: TTFT p50/p90 of turn 1 and turns 2+, TPOT, requests/s, tokens
        computed per instance, NIXL bytes per request, host-tier hits, failures."""
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
            "requests_per_s": round(len(self.chat.served) / self.chat.wall_s, 2),
            "failed": len(self.chat.failed) + len(self.prefix.failed),
            "prefill_computed_tokens": int(self.prefill.get(COMPUTED, 0)),
            "decode_computed_tokens": int(self.decode.get(COMPUTED, 0)),
            "nixl_bytes_per_request": int(self.decode.get(NIXL_BYTES, 0) / requests),
            "host_hit_tokens": {
                "prefill": int(self.prefill.get(f"{CACHED_BY_SOURCE}host}}", 0)),
                "decode": int(self.decode.get(f"{CACHED_BY_SOURCE}host}}", 0)),
            },
            "decode_link_rx_bytes": self.decode_link_rx,
            "phases_ms": {"prefill": phases(self.prefill), "decode": phases(self.decode)},
            "prefix_load": {k: round(v, 4) if isinstance(v, float) else v for k, v in self.prefix.summary().items()},
        }

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


def phases(moved: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds per observation of each of :data:`PHASES` that moved on an instance."""
    out = {}
    for name, metric in PHASES.items():
        count = moved.get(f"{metric}_count", 0.0)
        if count:
            out[name] = round(moved.get(f"{metric}_sum", 0.0) / count * 1e3, 2)
    return out


def mismatches(run: Load, baseline: Load) -> list[str]:
    """The (conversation, turn) whose answer's token ids differ from the baseline's."""
    expected = {(t.conversation, t.turn): t.token_ids for t in baseline.turns if t.error is None}
    return [
        f"conversation {t.conversation} turn {t.turn + 1}"
        for t in run.turns
        if t.error is None
        and (t.conversation, t.turn) in expected
        and t.token_ids != expected[(t.conversation, t.turn)]
    ]


def chat(url: str, model: str, tokenizer: Any, seed: int) -> Load:
    """The benchmark's conversations (module constants) through ``url``."""
    return chat_load(
        url,
        model,
        tokenizer,
        seed=seed,
        conversations=CONVERSATIONS,
        turns=TURNS,
        clients=CLIENTS,
        system_tokens=SYSTEM_TOKENS,
        group=GROUP,
    )


def baseline_answers(model: str, tokenizer: Any, logs: Path, seed: int) -> Load:
    """The conversations through one engine without P/D (no connector), on this host."""
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.server import ServerNode

    node = ServerNode(EngineSpec("baseline", model, num_gpu_blocks=4 * DEVICE_BLOCKS), logs)
    try:
        wait_all_ready([node])
        return chat(node.url, model, tokenizer, seed)
    finally:
        node.close()


def side_run(side: str, link: str, hosts: Any, model: str, tokenizer: Any, logs: Path, seed: int) -> SideRun:
    """Start ``side``'s servers in the hosts and its router here; warm the pair; the
    conversations, then the prefix load; stop everything."""
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.ports import free_ports
    from kvcompose_tools.e2e.router import RouterNode
    from kvcompose_tools.e2e.server import ServerNode

    p_spec, d_spec = specs(side, model, logs, *free_ports(2), hosts["prefill"].address, hosts["decode"].address)
    prefill = ServerNode(p_spec, logs, host=hosts["prefill"])
    decode = ServerNode(d_spec, logs, host=hosts["decode"])
    nodes: list[Any] = [prefill, decode]
    try:
        wait_all_ready([prefill, decode])
        router = RouterNode([prefill], [decode], model, logs, policy="consistent_hash", name=f"router-{side}-{link}")
        nodes.append(router)
        router.wait_ready()
        # The pair's first use (handshake, first READ) and each engine's first pass: not measured.
        chat_load(router.url, model, tokenizer, seed=seed + 999, conversations=2, turns=2, clients=2)
        before = prefill.metrics(), decode.metrics(), hosts["decode"].link_bytes()
        conversations = chat(router.url, model, tokenizer, seed)
        after = prefill.metrics(), decode.metrics(), hosts["decode"].link_bytes()
        prefix = prefix_load(router.url, model, seed)
        return SideRun(
            side,
            link,
            conversations,
            prefix,
            delta(before[0], after[0]),
            delta(before[1], after[1]),
            (after[2] - before[2]).rx,
        )
    finally:
        for node in reversed(nodes):
            node.close()


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    sides: tuple[str, ...] = SIDES,
    links: tuple[str, ...] = tuple(REAL_LINKS),
) -> Result:
    """Every side on every link (module docstring); the table, ratios and targets."""
    from kvcompose_tools.e2e.chat import load_tokenizer
    from kvcompose_tools.e2e.hosts import Hosts, format_rate
    from kvcompose_tools.e2e.model import make_model

    runs = repeats or RUNS
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-multi-turn-"))
    model = str(make_model(0))
    tokenizer = load_tokenizer(model)
    done: dict[str, dict[str, list[SideRun]]] = {link: {s: [] for s in sides} for link in links}
    wrong: dict[str, list[str]] = {}
    t0 = time.monotonic()
    with engine_lock(echo=echo):
        baseline = baseline_answers(model, tokenizer, logs, seed=0)
        echo(f"   baseline (one engine, no P/D): {len(baseline.served)} answers, {len(baseline.failed)} failed")
        for link in links:
            rate = format_rate(scaled_rate(REAL_LINKS[link]))
            with Hosts(["prefill", "decode"], link=rate) as hosts:
                for r in range(runs):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        one = side_run(side, link, hosts, model, tokenizer, logs, seed=0)
                        done[link][side].append(one)
                        bad = mismatches(one.chat, baseline)
                        if bad:
                            wrong[f"{link}/{side}"] = bad
                        f = one.figures()
                        echo(
                            f"   {link} link ({rate}) run {r + 1} {side}: turn 1 TTFT p50 {f['turn1_ttft_p50_s']} s, "
                            f"turns 2+ p50 {f['later_ttft_p50_s']} p90 {f['later_ttft_p90_s']} s, "
                            f"{f['requests_per_s']} req/s, NIXL {f['nixl_bytes_per_request']} B/req, "
                            f"failed {f['failed']}, answers unlike the baseline {len(bad)}"
                        )
    return summarize(done, runs, quick, logs, wrong, time.monotonic() - t0)


def summarize(
    done: dict[str, dict[str, list[SideRun]]],
    runs: int,
    quick: bool,
    logs: Path,
    wrong: dict[str, list[str]],
    wall_s: float,
) -> Result:
    """Cases per link and turn class (turn 1, turns 2+); samples: each run's TTFT p50."""
    from kvcompose_tools.e2e.hosts import format_rate

    cases, ratios, targets = [], [], []
    by_turn: dict[str, dict[str, list[float]]] = {}
    for link, by_side in done.items():
        for kind, key in (("turn 1", "turn1_ttft_p50_s"), ("turns 2+", "later_ttft_p50_s")):
            label = f"{link} link, {kind}"
            samples = {side: Samples([r.figures()[key] for r in rs]) for side, rs in by_side.items() if rs}
            extra = (
                {"runs": {side: [r.figures() for r in rs] for side, rs in by_side.items()}} if kind != "turn 1" else {}
            )
            cases.append(Case(label, samples, extra))
            for baseline in ("bare", "MultiConnector"):
                if SUBJECT in samples and baseline in samples:
                    ratios.append(ratio(label, samples, SUBJECT, baseline))
        by_turn[link] = {
            side: [statistics.median(turn) for turn in zip(*(r.ttft_by_turn() for r in rs), strict=False)]
            for side, rs in by_side.items()
            if rs
        }  # per turn index, the median over the runs
        if link == "slow" and SUBJECT in by_side:
            targets.append(CaseTarget("<=", TARGET_BARE, SUBJECT, "bare", "slow link, turns 2+", "TTFT p50"))
            targets.append(CaseTarget("<=", TARGET_MULTI, SUBJECT, "MultiConnector", "slow link, turns 2+", "TTFT p50"))
            targets.append(CaseTarget("<=", 1.05, SUBJECT, "bare", "slow link, turn 1", "TTFT p50"))
    return Result(
        "multi_turn",
        "Multi-turn conversations across a link: TTFT of turn 1 and turns 2+, kvcompose vs bare P/D and MultiConnector",
        "s",
        1.0,
        cases,
        ratios,
        AllTargets("<=", TARGET_BARE, SUBJECT, "bare", tuple(targets)) if targets else None,
        runs,
        quick,
        [
            "prefill and decode servers in two network namespaces, the link between them shaped (tbf) to "
            + ", ".join(
                f"{k}: {format_rate(scaled_rate(v))} (= {v / 1e9:g} Gbit/s for Llama-3-8B's KV)"
                for k, v in REAL_LINKS.items()
            )
            + "; vLLM's router in the root namespace, consistent_hash on X-Session-ID",
            f"{CONVERSATIONS} conversations x {TURNS} turns, {CLIENTS} clients, streamed chat; a {SYSTEM_TOKENS}-token "
            f"system prompt per group of {GROUP}; first messages 250-350 tokens, later 60-100, answers 16-24; "
            f"{DEVICE_BLOCKS} device blocks of {BLOCK_SIZE} tokens per instance",
            "bare: NixlConnector alone on both; MultiConnector: vLLM's over the examples' children; kvcompose: the "
            "examples; kvcompose-first-wins: the examples with load: first-wins on decode",
            "a sample: one run's TTFT p50 (client side, first streamed token); ratio = kvcompose / baseline",
            "answers compared with one engine without P/D, token ids: "
            + ("all equal" if not wrong else "; ".join(f"{k}: {len(v)} differ, e.g. {v[0]}" for k, v in wrong.items())),
        ],
        {"ttft_by_turn": by_turn, "engine_logs": str(logs), "wall_s_measured": round(wall_s, 1), "runs": runs},
    )
