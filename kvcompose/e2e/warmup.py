"""Warm prefill/decode pairs before traffic: one small P/D request per pair.

A fresh pair's first P/D request pays what no later one does: the NIXL handshake (the decode
fetches the prefill's agent metadata over the side channel and registers its memory), the first
UCX transfer between the two agents, and each engine's first pass over a request of that kind
(``docs/performance.md``, cold start). :func:`warm` sends every ``(prefill, decode)`` pair one
P/D request of :data:`WARMUP_TOKENS` new tokens (the proxy flow: prefill with
``do_remote_decode`` and one token, then decode with prefill's ``kv_transfer_params``), so that a
user's first request does not. Run it after a deploy, a restart or a scale-out, before the
router sends traffic to the new instances (``kvcompose warmup``); in an xPyD deployment it
warms all N x M pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcompose.e2e.flow import Engine, pd_request, token_prompt
from kvcompose.e2e.node import BLOCK_SIZE

#: Two whole blocks and one more token: the decode pulls the KV of all of them (two blocks and a
#: partial one) and computes none.
WARMUP_TOKENS = 2 * BLOCK_SIZE + 1


@dataclass(frozen=True)
class Warmed:
    """One pair's warm-up request: its decode TTFT and the bytes NIXL moved."""

    prefill: str
    decode: str
    ttft_s: float
    nixl_bytes: int


def warm(
    prefills: Sequence[Engine],
    decodes: Sequence[Engine],
    echo: Callable[[str], None] | None = None,
    seed: int = 9_000,
) -> list[Warmed]:
    """One P/D request through every ``(prefill, decode)`` pair, each with a prompt of its own (no
    prefix cache serves it). Raises what the flow raises when a pair does not answer."""
    out = []
    for i, p in enumerate(prefills):
        for j, d in enumerate(decodes):
            prompt = token_prompt(seed + 100 * i + j, WARMUP_TOKENS)
            served = pd_request(p, d, prompt, 1, label="warm-up", children=())
            w = Warmed(p.name, d.name, served.ttft_s, served.nixl_bytes)
            out.append(w)
            if echo is not None:
                ttft = f"decode TTFT {w.ttft_s * 1e3:.0f} ms"
                echo(f"{w.prefill} -> {w.decode}: warm ({ttft}, {w.nixl_bytes:,} B over NIXL)")
    return out
