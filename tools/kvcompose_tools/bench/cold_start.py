"""Benchmark 5d: the first P/D request of a fresh prefill/decode pair vs the requests after it.

Every new pair of instances (a deploy, a restart, a scale-out; N x M pairs in an xPyD
deployment) meets the NIXL connection's first use on its first request. This benchmark starts
:data:`PAIRS` fresh pairs per side, one pair at a time (the machine runs two engines), the sides
alternating pair by pair, and sends each pair :data:`REQUESTS` P/D requests one after the other:

* ``kvcompose``: the shipped examples (``examples/pd-prefill.yaml`` / ``pd-decode.yaml``);
* ``NixlConnector``: each example's NIXL child alone as the engine's ``--kv-transfer-config``
  (vLLM's ``NixlConnector`` through the nixl plugin's module path, the same options), no
  composite around it.

A request goes the proxy way (:func:`kvcompose_tools.e2e.flow.decode_request`): prefill with
``do_remote_decode`` and one token, then decode with the prefill's ``kv_transfer_params``; a
sample is the decode engine's own time to first token (vLLM's ``first_token_latency``), which
holds the NIXL handshake and pull. Every prompt is new. The figure per side is the first
request's TTFT over the median TTFT of the requests after it; the target is at most 2.

Each side runs twice per round: ``cold`` (the first request is a user's) and ``warmed`` (the pair
first gets ``kvcompose warmup``'s one small P/D request, :func:`kvcompose_tools.e2e.warmup.warm`, and the
first measured request comes after it: what a user sees when instances are warmed before traffic).

``link`` (``kvcompose bench --only cold-start --hosts [--link RATE]``) puts each pair's prefill and
decode in two hosts of their own (:mod:`kvcompose_tools.e2e.hosts`: network namespaces, links at that
rate, UCX over tcp on the hosts' ``eth0``), made fresh for the pair.

``error_handling`` sets the NIXL children's ``ucx_error_handling`` (the examples say ``none``);
``run(error_handling="peer")`` measures NIXL's default, the cold start before the fix
(``docs/performance.md`` 5d has both tables).
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose.examples import EXAMPLES
from kvcompose_tools.bench.measure import Samples, ratio
from kvcompose_tools.bench.pd_ttft import engine_lock, nixl_alone
from kvcompose_tools.bench.report import Case, Result, Target
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.spec import EngineSpec

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Host, Hosts

SIDES = ("NixlConnector", "kvcompose")
#: Without and with a warm-up request before the measured ones.
VARIANTS = ("cold", "warmed")
PAIRS = 3  # fresh pairs per side (quick: 1)
REQUESTS = 6  # per pair: the first, then the steady ones
PROMPT_TOKENS = 600
#: A cold first request can wait for minutes (docs/performance.md 5d).
TIMEOUT_S = 400.0


def engine_spec(
    side: str, role: str, model: str, port: int, error_handling: str, host: Host | None = None
) -> EngineSpec:
    """The ``role`` engine of ``side`` from the ``role`` example, its NIXL child on side-channel
    ``port`` with ``ucx_error_handling`` set to ``error_handling``; in ``host``, the side channel
    on the host's address (a bare NixlConnector's config is rendered here, so the kit's
    :func:`~kvcompose_tools.e2e.spec.placed` cannot reach into it)."""
    name, example = f"{side}-{role}", EXAMPLES / f"pd-{role}.yaml"
    options: dict[str, Any] = {"ucx_error_handling": error_handling}
    if host is not None:
        options["side_channel_host"] = host.address
    if side == "kvcompose":
        return EngineSpec(name, model, str(example), port, options)
    if side == "NixlConnector":
        return EngineSpec(name, model, kv_config=nixl_alone(example, port, options))
    raise ValueError(f"unknown side {side!r}")


def pair_ttfts(
    side: str,
    error_handling: str,
    model: str,
    logs: Path,
    seed: int,
    requests: int,
    warmup: bool = False,
    link: str | None = None,
) -> list[float]:
    """Start a fresh pair of ``side`` and time ``requests`` P/D requests in a row (decode TTFTs);
    with ``warmup``, after one warm-up request (:func:`kvcompose_tools.e2e.warmup.warm`). ``link``: the
    prefill and the decode each in a host of their own (:mod:`kvcompose_tools.e2e.hosts`, fresh for the
    pair), their links at that rate; None: both on this host's loopback."""
    if link is None:
        return _pair_ttfts(side, error_handling, model, logs, seed, requests, warmup, None)
    from kvcompose_tools.e2e.hosts import Hosts

    with Hosts(["prefill", "decode"], link=link) as hosts:
        return _pair_ttfts(side, error_handling, model, logs, seed, requests, warmup, hosts)


def _pair_ttfts(
    side: str,
    error_handling: str,
    model: str,
    logs: Path,
    seed: int,
    requests: int,
    warmup: bool,
    hosts: Hosts | None,
) -> list[float]:
    from kvcompose_tools.e2e.flow import decode_request, token_prompt
    from kvcompose_tools.e2e.warmup import warm

    nodes = [
        EngineNode(
            engine_spec(side, role, model, port, error_handling, hosts[role] if hosts else None),
            logs,
            host=hosts[role] if hosts else None,
        )
        for role, port in zip(("prefill", "decode"), free_ports(2))
    ]
    try:
        wait_all_ready(nodes)
        prefill, decode = nodes
        if warmup:
            warm([prefill], [decode])
        ttfts = []
        for i in range(requests):
            prompt = token_prompt(seed + i, PROMPT_TOKENS)
            (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}], timeout=TIMEOUT_S)
            d = decode_request(decode, prompt, 1, p["kv_transfer_params"], timeout_s=TIMEOUT_S)
            if d.nixl_bytes <= 0:
                raise RuntimeError(f"{side}: request {i + 1} pulled nothing over NIXL; see {decode.log_path}")
            ttfts.append(d.ttft_s)
        return ttfts
    finally:
        for n in nodes:
            n.close()


def run(
    quick: bool = False,
    repeats: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    error_handling: str = "none",
    link: str | None = None,
) -> Result:
    """First vs following decode TTFT over fresh pairs, per side (see the module docstring).
    ``link``: every pair across two hosts whose links run at that rate (``--hosts``)."""
    from kvcompose_tools.e2e.model import make_model

    pairs = repeats or (1 if quick else PAIRS)
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-cold-"))
    model = str(make_model(0))
    series = [(side, variant) for variant in VARIANTS for side in SIDES]
    runs: dict[str, list[list[float]]] = {_label(*s): [] for s in series}
    with engine_lock(echo=echo):
        for k in range(pairs):
            for side, variant in series if k % 2 == 0 else series[::-1]:
                label = _label(side, variant)
                seed = 1_000 * (len(runs[label]) + 1) + 100 * k + (50 if variant == "warmed" else 0)
                ttfts = pair_ttfts(
                    side, error_handling, model, logs, seed, REQUESTS, warmup=variant == "warmed", link=link
                )
                runs[label].append(ttfts)
                echo(f"   {label} pair {k + 1}: TTFT ms " + " ".join(f"{t * 1e3:.0f}" for t in ttfts))
    cases, ratios = [], []
    for side, rows in runs.items():
        first, steady = Samples([r[0] for r in rows]), Samples([t for r in rows for t in r[1:]])
        worst = max(first.values) / statistics.median(steady.values)
        cases.append(Case(side, {"first": first, "steady": steady}, {"worst_first_over_steady": round(worst, 2)}))
        ratios.append(ratio(side, {"first": first, "steady": steady}, "first", "steady"))
    return Result(
        "cold_start",
        f"First P/D request of a fresh pair vs the following ones (ucx_error_handling: {error_handling}"
        + (f"; prefill and decode on two hosts, links at {link})" if link else ")"),
        "ms",
        1e3,
        cases,
        ratios,
        Target("<=", 2.0, "first", "steady"),
        pairs,
        quick,
        [
            f"{pairs} fresh prefill/decode pair(s) per side and variant, alternating pair by pair; {REQUESTS} P/D "
            f"requests per pair ({PROMPT_TOKENS}-token prompts, all new); a sample is the decode engine's TTFT "
            "(vLLM's first_token_latency: the NIXL handshake and pull are in it)",
            "first: each pair's first request; steady: the requests after it; ratio = first / steady "
            "(best = fastest first over fastest steady); worst_first_over_steady in the JSON",
            "kvcompose: the shipped examples; NixlConnector: each example's NIXL child alone (vLLM's NixlConnector "
            "via the nixl plugin, same options)",
            "cold: the pair's first request is measured; after warm-up: `kvcompose warmup`'s one small P/D request "
            "first (not measured), then the measured ones",
        ],
        {
            "pairs": pairs,
            "requests": REQUESTS,
            "error_handling": error_handling,
            "link": link,
            "engine_logs": str(logs),
        },
    )


def _label(side: str, variant: str) -> str:
    return side if variant == "cold" else f"{side} after warm-up"
