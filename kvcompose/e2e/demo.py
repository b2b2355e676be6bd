"""``kvcompose demo``: P/D over NIXL plus the CPU tier, between real vLLM engines, checked.

1. a single-engine baseline (no connector) answers every prompt: the reference tokens/logprobs;
2. a prefill and a decode engine start from ``examples/pd-prefill.yaml`` / ``pd-decode.yaml``;
3. each prompt goes through the proxy flow (prefill, then decode with prefill's params): decode
   pulls the prompt's KV over NIXL (child ``pd``);
4. the decode engine's own prefix cache is dropped, and some prompts come again as a repeated
   turn: the host-memory tier (child ``host``) serves them, not a second NIXL pull;
5. every decode output is compared with the baseline; any difference exits 1.

``http=True`` (``kvcompose demo --http``) runs prefill and decode as vLLM's OpenAI-compatible HTTP
servers (:mod:`kvcompose.e2e.server`) instead of offline ``vllm.LLM`` engines: the same flow, with
``kv_transfer_params`` in the request bodies and the counters read from ``/metrics``, into the
same report. The baseline stays an offline engine, so the check also shows that the HTTP path
returns the same token ids and logprobs as ``vllm.LLM``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from kvcompose.e2e.flow import Served, hit_rates, pd_request, token_prompt
from kvcompose.e2e.model import make_model
from kvcompose.e2e.node import BLOCK_SIZE, EngineNode, EngineSpec, free_ports, wait_all_ready
from kvcompose.e2e.server import ServerNode

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
CHILDREN = ("host", "pd")
MAX_TOKENS = 16
#: (label, seed, length): lengths that are not whole blocks, so the partial tail shows.
PROMPTS = (("A", 0, 600), ("B", 1, 450), ("C", 2, 300))
REPEATS = ("A", "B")


def _progress(out: TextIO) -> Any:
    def show(nodes: list[Any], elapsed: float) -> None:
        states = ", ".join(f"{n.spec.name}: {n.stage}" for n in nodes)
        print(f"  ... {elapsed:4.0f} s  {states}", file=out, flush=True)

    return show


def _row(s: Served, ok: bool) -> str:
    moved = (
        f"{s.nixl_bytes:,} B over NIXL"
        if s.nixl_bytes
        else (f"{s.host_blocks} blocks from host" if s.host_blocks else "-")
    )
    return (
        f"  {s.label:<10} {s.child or 'none':<6} loaded {s.loaded_tokens:>4}  computed {s.computed_tokens:>4}  "
        f"{moved:<24} TTFT {s.ttft_s * 1000:7.1f} ms  {'equal' if ok else 'MISMATCH'}"
    )


def run(
    work: Path | None = None,
    out: TextIO = sys.stdout,
    prefill_yaml: Path = EXAMPLES / "pd-prefill.yaml",
    decode_yaml: Path = EXAMPLES / "pd-decode.yaml",
    http: bool = False,
) -> int:
    """Run the demo; 0 when every decode output equals the baseline, 1 otherwise. ``http``:
    prefill and decode are vLLM API servers, else offline engines (the baseline is offline)."""
    started = time.monotonic()
    model = make_model(0)
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-demo-"))
    print(f"model: {model} (seeded random weights)\nengine logs: {logs}", file=out)
    prompts = {label: token_prompt(seed, n) for label, seed, n in PROMPTS}
    p_port, d_port = free_ports(2)
    Node: Any = ServerNode if http else EngineNode
    kind = "HTTP server" if http else "engine"
    nodes: list[Any] = []
    try:
        print(f"starting baseline (offline engine, no connector) and prefill {kind} ...", file=out, flush=True)
        baseline = EngineNode(EngineSpec("baseline", str(model)), logs)
        nodes.append(baseline)
        prefill = Node(EngineSpec("prefill", str(model), str(prefill_yaml), p_port), logs)
        nodes.append(prefill)
        wait_all_ready([baseline, prefill], progress=_progress(out))
        expected = {label: baseline.generate([ids], MAX_TOKENS)[0] for label, ids in prompts.items()}
        baseline.close()
        nodes.remove(baseline)
        print(f"baseline done; starting decode {kind} ...", file=out, flush=True)
        decode = Node(EngineSpec("decode", str(model), str(decode_yaml), d_port), logs)
        nodes.append(decode)
        wait_all_ready([decode], progress=_progress(out))
        via = f"HTTP: prefill {prefill.url}, decode {decode.url}" if http else "offline engines"
        print(
            f"engines ready after {time.monotonic() - started:.0f} s "
            f"({via}; NIXL side channels: prefill :{p_port}, decode :{d_port})\n",
            file=out,
        )

        before = decode.metrics()
        served: list[tuple[Served, bool]] = []
        print("  request    child  tokens                 bytes moved              time to first token", file=out)
        for label, ids in prompts.items():
            s = pd_request(prefill, decode, ids, MAX_TOKENS, label=f"{label} ({len(ids)})", children=CHILDREN)
            served.append((s, _same(s, expected[label])))
            print(_row(*served[-1]), file=out, flush=True)
        decode.reset_prefix_cache()
        print("  -- decode's own prefix cache dropped; repeated turns --", file=out)
        for label in REPEATS:
            ids = prompts[label]
            s = pd_request(prefill, decode, ids, MAX_TOKENS, label=f"{label} again", children=CHILDREN)
            served.append((s, _same(s, expected[label])))
            print(_row(*served[-1]), file=out, flush=True)
        rates = hit_rates(before, decode.metrics(), CHILDREN)
    finally:
        for n in nodes:
            n.close()
    bad = [s.label for s, ok in served if not ok]
    print("\nsummary (decode engine, from its vllm:kvcompose_* counters):", file=out)
    for child, (loads, lookups) in rates.items():
        pct = 100.0 * loads / lookups if lookups else 0.0
        print(f"  {child:<5} served {loads} of {lookups} lookups ({pct:.0f}%)", file=out)
    nixl = sum(s.nixl_bytes for s, _ in served)
    host = sum(s.host_blocks for s, _ in served)
    print(f"  moved: {nixl:,} B over NIXL, {host} blocks ({BLOCK_SIZE} tokens each) from host memory", file=out)
    print(
        f"  outputs equal to the single-engine baseline (token ids and logprobs): "
        f"{len(served) - len(bad)}/{len(served)}",
        file=out,
    )
    print(f"  wall time: {time.monotonic() - started:.0f} s", file=out)
    if bad:
        print(f"MISMATCH in {', '.join(bad)}", file=out)
        return 1
    return 0


def _same(s: Served, expected: dict[str, Any]) -> bool:
    return s.token_ids == expected["token_ids"] and s.logprobs == expected["logprobs"]
