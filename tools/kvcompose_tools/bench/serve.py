"""Benchmark 11: the serving stack under load, kvcompose vs a bare NixlConnector and vs vLLM's
MultiConnector on the decode side.

Four engines and three routers at once, all vLLM's own programs:

* one prefill server (``examples/pd-prefill.yaml``), shared by every side;
* decode ``kvcompose``: ``examples/pd-decode.yaml`` (host-memory tier + NIXL, ``load: ranges``);
* decode ``NixlConnector``: that composition's NIXL child alone as the server's
  ``--kv-transfer-config`` (:func:`~kvcompose_tools.bench.pd_ttft.nixl_alone`: vLLM's NixlConnector
  through the nixl plugin's module path, the same options);
* decode ``MultiConnector``: vLLM's own MultiConnector over the same two children
  (:func:`~kvcompose.vllm.args.vllm_multiconnector`), its fixed rules (the first child with a hit
  loads, every child saves);
* one vLLM router per side (P/D mode, nixl) in front of the shared prefill and that side's decode.

The workload is a chat service's: every prompt is one of :data:`PREFIXES` shared prefixes (a
system prompt, a document) followed by a new part, so prefixes repeat across requests (prefill's
prefix cache, decode's, the host tier), and :data:`IN_FLIGHT` requests are in flight at once
(a thread per client, streaming ``/v1/completions`` through the router). Each round sends a batch
of :data:`BATCH` requests through each side in turn, each batch drawn anew from the same
distribution (a prefix of :data:`PREFIXES`, a new part of :data:`NEW_TOKENS` tokens), the order
reversing every round, so the sides share the machine's moments of load. A sample is
one batch's answered requests per second (a failed request is an error, never served); each
request's time to first token (the first streamed token, as the client sees it: prefill, the NIXL
pull and decode's first step) and errors are collected per side, and the TTFT tail (p99, max) is
reported beside the median, with kvcompose's p99 against each other side's.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose.vllm.args import vllm_multiconnector
from kvcompose_tools.bench.measure import Samples, ratio, repeats_for
from kvcompose_tools.bench.pd_ttft import engine_lock, nixl_alone
from kvcompose_tools.bench.report import Case, Result, Target
from kvcompose_tools.e2e.flow import delta
from kvcompose_tools.e2e.server import HOST
from kvcompose_tools.e2e.spec import EngineSpec, composed_kv_transfer_config
from kvcompose_tools.e2e.stats import quantile
from kvcompose_tools.e2e.stream import send

#: The baseline first (every side's requests/s ratio is to it); :data:`SUBJECT` is the one whose
#: TTFT p99 is set against every other side's.
SIDES = ("NixlConnector", "kvcompose", "MultiConnector")
SUBJECT = "kvcompose"
#: One more side on request (``run(sides=ALL_SIDES)``, a fifth engine): the composite with its
#: NIXL child alone, which tells the composite's own cost from the host tier's work.
ALL_SIDES = (*SIDES, "kvcompose-pd-only")
IN_FLIGHT = 16
BATCH = 64  # requests per side and round (quick: 32)
ROUNDS = 5  # quick: the minimum, 3 -> 640 requests in all (quick: 192)
PREFIXES = 8
PREFIX_TOKENS = 256  # 8 blocks
NEW_TOKENS = (64, 200)  # the new part's length, drawn per request
MAX_TOKENS = 16
#: Enough device blocks for 16 prompts of up to 456 tokens and their answers at once.
DECODE_BLOCKS = 512


@dataclass
class Tally:
    """One side's requests: times to first token, errors (what went wrong, first few kept)."""

    ttft_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_errors: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.first_errors) < 3:
            self.first_errors.append(what)


def stream_completion(host: str, port: int, model: str, prompt: list[int], timeout: float = 120.0) -> float:
    """One streamed greedy ``/v1/completions`` request; seconds until its first token. Raises
    :class:`RuntimeError` with what went wrong for every reply but an answer
    (:func:`~kvcompose_tools.e2e.stream.send`: an HTTP error, an error event or a choice finished
    for ``error`` in the stream, an answer without tokens, a stream that ends before ``data: [DONE]``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    reply = send((host, port), body, timeout_s=timeout)
    if reply.kind != "answered" or reply.ttft_s is None:
        raise RuntimeError(f"{reply.kind}: {reply.detail}")
    return reply.ttft_s


class Workload:
    """Prompts: one of the shared prefixes, then a new part; every side gets its own new parts."""

    def __init__(self, seed: int = 0) -> None:
        from kvcompose_tools.e2e.flow import token_prompt

        self._rng = random.Random(seed)
        self._token_prompt = token_prompt
        self.prefixes = [token_prompt(50_000 + i, PREFIX_TOKENS) for i in range(PREFIXES)]
        self._next = 60_000

    def batch(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            self._next += 1
            new = self._token_prompt(self._next, self._rng.randint(*NEW_TOKENS))
            out.append(self.prefixes[self._rng.randrange(PREFIXES)] + new)
        return out


def run_batch(router_port: int, model: str, prompts: list[list[int]], tally: Tally) -> float:
    """``prompts`` through the router at :data:`IN_FLIGHT` at once; answered requests per second
    (a failed request is counted in ``tally.errors``, never as served)."""

    def one(prompt: list[int]) -> bool:
        try:
            tally.ttft_s.append(stream_completion(HOST, router_port, model, prompt))
            return True
        except Exception as exc:  # every failure is counted and shown, none stops the run
            tally.error(f"{type(exc).__name__}: {exc}"[:300])
            return False

    t0 = time.perf_counter()
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        answered = sum(pool.map(one, prompts))
    return answered / (time.perf_counter() - t0)


def ttft_p99_ratios(sides: dict[str, dict[str, Any]], subject: str = SUBJECT) -> dict[str, float | None]:
    """``subject``'s TTFT p99 over each other side's (``"kvcompose/NixlConnector": 1.04``), from
    :func:`side_report`'s figures; None where a side answered nothing. Above 1: the subject's tail
    is longer."""
    if subject not in sides:
        return {}
    mine = sides[subject]["ttft_p99_ms"]
    return {
        f"{subject}/{side}": round(mine / e["ttft_p99_ms"], 3) if mine and e["ttft_p99_ms"] else None
        for side, e in sides.items()
        if side != subject
    }


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    batch: int | None = None,
    sides: tuple[str, ...] = SIDES,
) -> Result:
    """Answered requests per second behind the router, one sample per side and round; each side's
    ratio to ``NixlConnector`` (the first of ``sides``), and the TTFT tail (:func:`summarize`)."""
    from kvcompose.examples import EXAMPLES
    from kvcompose_tools.e2e.model import make_model
    from kvcompose_tools.e2e.node import wait_all_ready
    from kvcompose_tools.e2e.ports import free_ports
    from kvcompose_tools.e2e.router import RouterNode
    from kvcompose_tools.e2e.server import ServerNode

    rounds = repeats or repeats_for(quick, full=ROUNDS)
    per_batch = batch or (BATCH // 2 if quick else BATCH)
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-serve-"))
    model = str(make_model(0))
    decode_yaml = EXAMPLES / "pd-decode.yaml"
    samples = {side: Samples() for side in sides}
    tallies = {side: Tally() for side in sides}
    moved: dict[str, dict[str, float]] = {}
    nodes: list[Any] = []
    with engine_lock(echo=echo):
        try:
            p_port, *d_ports = free_ports(1 + len(sides))
            prefill = ServerNode(EngineSpec("prefill", model, str(EXAMPLES / "pd-prefill.yaml"), p_port), logs)
            nodes.append(prefill)
            decodes = {
                side: ServerNode(decode_spec(side, model, decode_yaml, port, logs), logs)
                for side, port in zip(sides, d_ports)
            }
            nodes += decodes.values()
            t0 = time.monotonic()
            wait_all_ready([prefill, *decodes.values()])
            started_s = time.monotonic() - t0
            routers = {
                side: RouterNode([prefill], [decodes[side]], model, logs, name=f"router-{side}") for side in sides
            }
            nodes += routers.values()
            for r in routers.values():
                r.wait_ready()
            workload = Workload()
            for side in sides:  # NIXL handshakes, first-request warm-up
                run_batch(routers[side].port, model, workload.batch(2), Tally())
            before = {side: decodes[side].metrics() for side in sides}
            for r in range(rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    rps = run_batch(routers[side].port, model, workload.batch(per_batch), tallies[side])
                    samples[side].values.append(rps)
                    echo(f"   round {r + 1}/{rounds} {side}: {rps:.2f} req/s")
            for side in sides:
                after = decodes[side].metrics()
                moved[side] = delta(before[side], after)
        finally:
            for n in reversed(nodes):
                n.close()
    return summarize(samples, tallies, moved, per_batch, rounds, quick, started_s, logs, echo)


def summarize(
    samples: dict[str, Samples],
    tallies: dict[str, Tally],
    moved: dict[str, dict[str, float]],
    per_batch: int,
    rounds: int,
    quick: bool,
    started_s: float,
    logs: Path,
    echo: Callable[[str], None] = print,
) -> Result:
    """The result of a run: the sides' answered requests/s samples and ratios (to the first side,
    and kvcompose to MultiConnector), each side's figures (:func:`side_report`) and the TTFT tail
    (:func:`ttft_p99_ratios`), echoed and in the JSON. Raises when a side pulled nothing over NIXL
    (it measured something else than P/D)."""
    sides = tuple(samples)
    label = f"{IN_FLIGHT} in flight, {per_batch}-request batches, {PREFIXES} shared {PREFIX_TOKENS}-token prefixes"
    extra = {side: side_report(tallies[side], moved.get(side, {})) for side in sides}
    tail = ttft_p99_ratios(extra)
    for side in sides:  # a side that did not do P/D measured something else
        if not extra[side]["nixl_bytes"]:
            raise RuntimeError(
                f"serve: decode {side} pulled nothing over NIXL ({extra[side]['computed_prompt_tokens']} prompt "
                f"tokens computed on decode); see {logs}/decode-{side}.log"
            )
    for side in sides:
        e = extra[side]
        echo(
            f"   {side}: answered {e['answered']} of {e['requests']}, TTFT {ttft_line(e)}, "
            f"errors {e['errors']}{' ' + str(e['first_errors']) if e['errors'] else ''}"
        )
    if tail:
        echo("   TTFT p99 " + ", ".join(f"{k} {v}" for k, v in tail.items()))
    for side in sides:  # a ratio to a side that served nothing is no figure
        if not samples[side].max or not samples[side].median:
            raise RuntimeError(
                f"serve: decode {side} answered no request in most batches ({extra[side]['errors']} errors, e.g. "
                f"{extra[side]['first_errors']}); see {logs}/decode-{side}.log"
            )
    ratios = [ratio(label, samples, side, sides[0], higher_is_better=True) for side in sides[1:]]
    if SUBJECT in sides and "MultiConnector" in sides:
        ratios.append(ratio(label, samples, SUBJECT, "MultiConnector", higher_is_better=True))
    case_extra = {"sides": extra, "ttft_p99_ratios": tail, "engines_start_s": round(started_s, 1)}
    return Result(
        "serve",
        "Answered requests/s behind vLLM's router (1 prefill, 1 decode per side): kvcompose vs a bare "
        "NixlConnector and vLLM's MultiConnector",
        "req/s",
        1.0,
        [Case(label, samples, {**case_extra, "engine_logs": str(logs)})],
        ratios,
        Target(">=", 0.98, "kvcompose", "NixlConnector"),
        rounds,
        quick,
        [
            "one prefill server shared by every side; decode kvcompose: examples/pd-decode.yaml (host tier + NIXL, "
            "load: ranges); decode NixlConnector: its NIXL child alone (same options); decode MultiConnector: "
            "vLLM's MultiConnector over the same two children; a vLLM router per side",
            f"a sample: one batch's answered requests/s (failures are errors, not served), {IN_FLIGHT} streamed "
            "requests in flight; the sides alternate batch by batch (order flipping every round); every prompt a "
            "shared prefix + a new part",
            "TTFT: first streamed token as the client sees it (prefill + NIXL pull + decode's first step); "
            "errors: HTTP errors and failed streams",
            "TTFT ms: " + "; ".join(f"{side} {ttft_line(extra[side])}" for side in sides),
            *(["TTFT p99 " + ", ".join(f"{k} {v}" for k, v in tail.items())] if tail else []),
        ],
        {"in_flight": IN_FLIGHT, "batch": per_batch, "max_tokens": MAX_TOKENS, "decode_blocks": DECODE_BLOCKS},
    )


def side_report(tally: Tally, moved: dict[str, float]) -> dict[str, Any]:
    """One side's figures for the JSON: requests, answered, errors, TTFT p50/p90/p99/max (ms, None
    when nothing was answered), and what its decode did (``moved``: its counters' deltas)."""
    from kvcompose_tools.e2e.flow import COMPUTED, NIXL_BYTES, answered, loads_key

    ttft = sorted(tally.ttft_s)

    def ms(q: float) -> float | None:
        return round(quantile(ttft, q) * 1e3, 1) if ttft else None

    return {
        "requests": len(ttft) + tally.errors,
        "answered": len(ttft),
        "errors": tally.errors,
        "first_errors": tally.first_errors,
        "ttft_p50_ms": ms(0.5),
        "ttft_p90_ms": ms(0.9),
        "ttft_p99_ms": ms(0.99),
        "ttft_max_ms": round(ttft[-1] * 1e3, 1) if ttft else None,
        "decode_answered": int(answered(moved)),
        "nixl_bytes": int(moved.get(NIXL_BYTES, 0)),
        "host_loads": int(moved.get(loads_key("host"), 0)),
        "computed_prompt_tokens": int(moved.get(COMPUTED, 0)),
    }


def ttft_line(e: dict[str, Any]) -> str:
    """``p50 512.0 / p99 1302.5 / max 2210.0 ms``, from :func:`side_report`'s figures."""
    return f"p50 {e['ttft_p50_ms']} / p99 {e['ttft_p99_ms']} / max {e['ttft_max_ms']} ms"


def decode_spec(side: str, model: str, decode_yaml: Path, port: int, logs: Path) -> EngineSpec:
    """The decode server of ``side``, its NIXL side channel on ``port``."""
    name = f"decode-{side}"
    if side == "kvcompose":
        return EngineSpec(name, model, str(decode_yaml), port, num_gpu_blocks=DECODE_BLOCKS)
    if side == "kvcompose-pd-only":
        return EngineSpec(name, model, str(pd_only(decode_yaml, logs)), port, num_gpu_blocks=DECODE_BLOCKS)
    if side == "NixlConnector":
        return EngineSpec(name, model, kv_config=nixl_alone(decode_yaml, port), num_gpu_blocks=DECODE_BLOCKS)
    if side == "MultiConnector":
        multi = vllm_multiconnector(composed_kv_transfer_config(decode_yaml, port))
        return EngineSpec(name, model, kv_config=multi, num_gpu_blocks=DECODE_BLOCKS)
    raise ValueError(f"unknown side {side!r}; choose from {ALL_SIDES}")


def pd_only(decode_yaml: Path, directory: Path) -> Path:
    """``decode_yaml`` with its NIXL child alone (same options, default rules), under ``directory``."""
    import yaml

    data = yaml.safe_load(decode_yaml.read_text())
    data["connectors"] = [c for c in data["connectors"] if c["type"] == "nixl"]
    data.pop("rules", None)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "pd-decode-pd-only.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
