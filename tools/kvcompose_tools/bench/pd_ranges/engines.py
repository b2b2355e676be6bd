"""Benchmark 5c's engines: one prefill and a decode per composition, served in lockstep."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvcompose_tools.bench.pd_ranges.compositions import COMPOSITIONS, PREFILL_YAML, decode_composition
from kvcompose_tools.bench.pd_ranges.figures import Served, Totals, compare_answers
from kvcompose_tools.bench.pd_ranges.workload import Workload, twin_prompt


def serve_lockstep(
    decodes: Mapping[str, Any],
    run: int,
    prefill: Any,
    workload: Workload,
    answers: dict[tuple[int, int], list[int]],
    twins: bool = True,
) -> list[Served]:
    """Send the workload once to every decode engine (composition name -> engine node), request
    by request: each request goes to all of them back to back, the first one rotating, so every
    composition meets the machine's same moments (its drift cancels out of their ratios).

    ``answers`` holds the reference answers the prompts are made of; an empty dict is filled
    with the first composition's own as it goes (the first run makes the prompts). With
    ``twins`` each request is paired with its twin (:func:`twin_prompt`), the two sent one after
    the other in an order that flips every request.
    """
    names = list(decodes)
    out: list[Served] = []
    for i, (c, t) in enumerate(workload.order()):
        prompt = workload.prompt(c, t, answers)
        pair = [(prompt, False)] + ([(twin_prompt(c, t, len(prompt)), True)] if twins else [])
        for name in names[i % len(names) :] + names[: i % len(names)]:
            for ids, twin in pair if i % 2 == 0 else pair[::-1]:
                out.append(serve_one(name, run, c, t, twin, ids, prefill, decodes[name], workload.answer_tokens))
            if not answers.get((c, t)):
                answers[(c, t)] = next(s.token_ids for s in out[::-1] if not s.twin)
    return out


def serve_one(
    composition: str,
    run: int,
    conversation: int,
    turn: int,
    twin: bool,
    prompt: list[int],
    prefill: Any,
    decode: Any,
    max_tokens: int,
) -> Served:
    """Prefill (``do_remote_decode``), drop the decode's device cache, decode with the params."""
    from kvcompose_tools.e2e.flow import COMPUTED, decode_request, drop_prefix_cache, tokens_key

    t0 = time.perf_counter()
    (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    prefill_s = time.perf_counter() - t0
    drop_prefix_cache(decode)
    d = decode_request(decode, prompt, max_tokens, p["kv_transfer_params"])
    return Served(
        composition,
        run,
        conversation,
        turn,
        len(prompt),
        int(d.counters.get(tokens_key("host"), 0)),
        int(d.counters.get(tokens_key("pd"), 0)),
        d.nixl_bytes,
        int(d.counters.get(COMPUTED, 0)),
        d.ttft_s,
        list(d.token_ids),
        prefill_s,
        list(d.logprobs),
        twin,
    )


#: The first P/D request after a decode engine starts waits for NIXL's handshake, UCX's first
#: connection and the engine's first-forward work (docs/performance.md 5d); the
#: warm-up absorbs it, so its requests get far longer than a measured request's deadline.
WARM_UP_TIMEOUT_S = 600.0


def warm_up(prefill: Any, decode: Any) -> float:
    """Two requests outside the workload: the NIXL handshake, and each composition's load path
    for a next turn (a prompt whose first blocks the host tier holds). Returns the first one's
    seconds (the cold start)."""
    from kvcompose_tools.e2e.flow import drop_prefix_cache, pd_request, token_prompt

    first = token_prompt(999_001, 150)
    t0 = time.monotonic()
    pd_request(prefill, decode, first, 4, timeout_s=WARM_UP_TIMEOUT_S)
    cold = time.monotonic() - t0
    drop_prefix_cache(decode)
    pd_request(prefill, decode, first + token_prompt(999_002, 100), 4, timeout_s=WARM_UP_TIMEOUT_S)
    return cold


def _decode_spec(name: str, run: int, model: str, directory: Path, port: int) -> Any:
    from kvcompose_tools.e2e.spec import EngineSpec

    path = directory / f"decode-{name}.yaml"
    if not path.exists():
        path.write_text(decode_composition(name))
    return EngineSpec(f"decode-{name}-{run}", model, str(path), side_channel_port=port)


def measure(
    workload: Workload, passes: int, model: str, logs: Path, echo: Callable[[str], None]
) -> tuple[list[Served], dict[tuple[int, int, bool], list[int]], dict[str, list[float]]]:
    """One prefill engine and one decode engine per composition, all up at once (four engines,
    each with :data:`~kvcompose_tools.e2e.spec.ENGINE_ENV`'s 1 GiB of KV); ``passes`` lockstep passes
    over the workload (:func:`serve_lockstep`).

    Returns every request served, the reference answers (the first served of each request) and
    the engines' start time. The caller holds the engine lock.
    """
    from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
    from kvcompose_tools.e2e.ports import free_ports
    from kvcompose_tools.e2e.spec import EngineSpec

    served: list[Served] = []
    answers: dict[tuple[int, int], list[int]] = {}  # what the prompts are made of
    reference: dict[tuple[int, int, bool], list[int]] = {}
    ports = free_ports(1 + len(COMPOSITIONS))
    nodes = [EngineNode(EngineSpec("prefill", model, str(PREFILL_YAML), side_channel_port=ports[0]), logs)]
    try:
        for name, port in zip(COMPOSITIONS, ports[1:]):
            nodes.append(EngineNode(_decode_spec(name, 1, model, logs, port), logs))
        prefill, decodes = nodes[0], dict(zip(COMPOSITIONS, nodes[1:]))
        t0 = time.monotonic()
        wait_all_ready(nodes)
        starts = {name: [round(time.monotonic() - t0, 1)] for name in decodes}
        for name, decode in decodes.items():
            echo(f"   {name}: first request after start {warm_up(prefill, decode):.0f} s (warm-up, not measured)")
        for run in range(1, passes + 1):
            got = serve_lockstep(decodes, run, prefill, workload, answers)
            for s in got:
                reference.setdefault(s.key, s.token_ids)
            served += got
            for name in decodes:
                t = Totals.of([s for s in got if s.composition == name])
                twin_ms = t.twin_ttft.median * 1e3 if t.twin_ttft else float("nan")
                echo(
                    f"   {name} pass {run}: NIXL {t.nixl_bytes / 2**20:.2f} MiB, host-loaded {t.host_tokens} tok, "
                    f"NIXL-loaded {t.pd_tokens} tok, decode-computed {t.computed_tokens} tok "
                    f"(max {t.computed_max}), TTFT median {t.ttft.median * 1e3:.1f} ms (twins {twin_ms:.1f}); "
                    f"{len(compare_answers([x for x in got if x.composition == name], reference))} answers differ"
                )
    finally:
        for node in nodes:
            node.close()
    return served, reference, starts
