"""Benchmark 5g: what a dead decode instance costs its prefill instance's other traffic, per lease.

A prefill instance holds each P/D request's blocks until a decode instance read them or the
lease ends (the nixl option ``lease_seconds``, vLLM's ``kv_lease_duration``, 30 s). A decode
instance that died never reads: every request the router sent it holds its prefill blocks for a
whole lease (the soak saw the prefill at 98-99.6 % KV usage while its decode was down). Requests
for live decodes then wait for blocks.

Per lease (:data:`LEASES`), one prefill engine from the shipped example (``examples/pd-prefill.yaml``,
``lease_seconds`` set, :data:`NUM_BLOCKS` blocks) and, per round:

* ``alone``: :data:`OTHERS` plain requests (a live decode reads its blocks at once; a plain
  request frees them at once too) on an idle instance: their time to first token;
* ``behind dead decode``: :data:`ORPHANS` P/D requests (``do_remote_decode``) that nobody reads,
  sized to leave less than one request's blocks free, then the same number of plain requests:
  their time to first token, which holds the wait for blocks;

then the round waits for the orphans' lease to end. The ratio is ``behind dead decode`` over
``alone``: what a full lease of orphans costs a request that arrives just after them. There is
no target: the figure says what a shorter lease buys, and ``kvcompose check`` says what it costs
(a decode that has not read within the lease finds the blocks freed and recomputes).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvcompose.examples import EXAMPLES
from kvcompose_tools.bench.measure import Samples, ratio
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import Case, Result
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

#: vLLM's default first, then shorter ones (quick: the default and the shortest).
LEASES = (30, 10, 5)
PROMPT_TOKENS = 16 * BLOCK_SIZE
#: Blocks of the prefill instance: ORPHANS requests of PROMPT_TOKENS + 1 token leave fewer than
#: one request's blocks free (vLLM keeps one block back).
NUM_BLOCKS = 128
ORPHANS = 7
OTHERS = 2
ROUNDS = 2
USAGE = "vllm:kv_cache_usage_perc"


def blocks_of(tokens: int) -> int:
    """Blocks a request of ``tokens`` tokens holds (its prompt and one generated token)."""
    return -(-(tokens + 1) // BLOCK_SIZE)


def _ttfts(node: EngineNode, seed: int, n: int, params: dict[str, object] | None = None) -> list[float]:
    from kvcompose_tools.e2e.flow import token_prompt

    prompts = [token_prompt(seed + i, PROMPT_TOKENS) for i in range(n)]
    outs = node.generate(prompts, 1, [params] * n if params is not None else None, timeout=300)
    return [float(o["ttft_s"]) for o in outs]


def _wait_free(node: EngineNode, deadline_s: float) -> float:
    """Seconds until the engine's KV usage is back to zero (the orphans' lease ended)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < deadline_s:
        node.generate([[7, 8, 9]], 1)  # a step: the prefill's worker reaps expired leases in steps
        if node.metrics().get(USAGE, 1.0) == 0.0:
            return time.perf_counter() - t0
        time.sleep(0.5)
    raise RuntimeError(f"{node.name}: KV usage not back to 0 within {deadline_s:.0f} s; see {node.log_path}")


def lease_round(node: EngineNode, seed: int) -> tuple[list[float], list[float], float, float]:
    """One round: the plain requests alone, then behind the orphans; the KV usage the orphans
    left and the seconds until it was free again."""
    alone = _ttfts(node, seed, OTHERS)
    _ttfts(node, seed + 100, ORPHANS, {"do_remote_decode": True})
    usage = node.metrics().get(USAGE, 0.0)
    behind = _ttfts(node, seed + 200, OTHERS)
    return alone, behind, usage, _wait_free(node, 120)


def run(quick: bool = False, echo: Callable[[str], None] = print, work: Path | None = None) -> Result:
    """Plain requests alone and behind a dead decode's orphans, per lease (module docstring)."""
    from kvcompose_tools.e2e.model import make_model

    leases = (LEASES[0], LEASES[-1]) if quick else LEASES
    rounds = 1 if quick else ROUNDS
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-lease-"))
    model = str(make_model(0))
    cases, ratios = [], []
    with engine_lock(echo=echo):
        for lease in leases:
            (port,) = free_ports(1)
            spec = EngineSpec(
                f"prefill-lease-{lease}",
                model,
                str(EXAMPLES / "pd-prefill.yaml"),
                port,
                {"lease_seconds": lease},
                num_gpu_blocks=NUM_BLOCKS,
            )
            node = EngineNode(spec, logs)
            try:
                wait_all_ready([node])
                _ttfts(node, 1, 1)  # the engine's first pass, not measured
                alone, behind, usages, freed = Samples(), Samples(), [], []
                for r in range(rounds):
                    a, b, usage, free_s = lease_round(node, 10_000 * (lease + 1) + 1_000 * r)
                    alone.values.extend(a)
                    behind.values.extend(b)
                    usages.append(usage)
                    freed.append(free_s)
                    echo(
                        f"   lease {lease} s round {r + 1}: alone "
                        + " ".join(f"{t * 1e3:.0f}" for t in a)
                        + " ms; behind dead decode "
                        + " ".join(f"{t:.1f}" for t in b)
                        + f" s; orphans held {usage:.0%} of KV, free again {free_s:.1f} s later"
                    )
            finally:
                node.close()
            label = f"lease {lease} s"
            samples = {"alone": alone, "behind dead decode": behind}
            cases.append(
                Case(label, samples, {"orphan_kv_usage": usages, "freed_after_s": [round(f, 1) for f in freed]})
            )
            ratios.append(ratio(label, samples, "behind dead decode", "alone"))
    return Result(
        "lease_cost",
        "A dead decode's orphaned prefill blocks: TTFT of the prefill's other requests, per lease",
        "ms",
        1e3,
        cases,
        ratios,
        None,
        rounds,
        quick,
        [
            f"one prefill engine per lease (examples/pd-prefill.yaml, lease_seconds set, {NUM_BLOCKS} blocks of "
            f"{BLOCK_SIZE} tokens); per round: {OTHERS} plain {PROMPT_TOKENS}-token requests alone, then "
            f"{ORPHANS} P/D requests nobody reads (a dead decode's) and {OTHERS} plain requests behind them",
            "a sample is a plain request's time to first token in the engine (vLLM's first_token_latency: the "
            "wait for blocks is in it); ratio = behind dead decode / alone",
            "a plain request stands for a P/D request whose live decode reads its blocks at once",
            "orphan_kv_usage: the engine's KV usage right after the orphans; freed_after_s: until it was 0 again",
        ],
        {"leases": list(leases), "rounds": rounds, "engine_logs": str(logs)},
    )
