"""The disaggregated-proxy flow over engine nodes, and what each request did, from engine metrics.

A request goes the way vLLM's disaggregated proxy sends it: to the prefill engine with
``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``, then to the decode engine
with the ``kv_transfer_params`` prefill returned. What the decode engine did is read from its own
Prometheus counters before and after the request (requests are sent one at a time): which
children loaded KV and how many tokens each (``vllm:kvcompose_loads{child}``,
``vllm:kvcompose_loaded_tokens{child}``, counted by the composed connector; under ``load: ranges``
one request can be served by several, e.g. the host tier's prefix and the rest over NIXL), tokens
computed, bytes moved.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Counter keys, as :func:`kvcompose.e2e.node.flatten_metrics` (and the HTTP parser) write them.
LOOKUPS = "vllm:kvcompose_lookups"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_FAILED = "vllm:nixl_num_failed_transfers"
COMPUTED = "vllm:prompt_tokens_by_source{source=local_compute}"
EXTERNAL = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
HOST_LOADED_BLOCKS = "vllm:simple_kv_offload_load_blocks"
#: vLLM's own split of connector-loaded prompt tokens by tier (each child's
#: ``get_external_cache_hit_sources``: ``host`` from the CPU tier, ``p2p`` from NIXL).
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source{source="
#: Sum of arrival-to-first-token times: one request's own when requests go one at a time.
TTFT_SUM = "vllm:time_to_first_token_seconds_sum"


def loads_key(child: str) -> str:
    return f"vllm:kvcompose_loads{{child={child}}}"


def tokens_key(child: str) -> str:
    return f"vllm:kvcompose_loaded_tokens{{child={child}}}"


class Engine(Protocol):
    """What the flow needs from an engine: an offline node (``node.EngineNode``) or an HTTP
    server (``server.ServerNode``)."""

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = ...,
    ) -> list[dict[str, Any]]: ...

    def metrics(self) -> dict[str, float]: ...

    def reset_prefix_cache(self) -> bool: ...


def token_prompt(seed: int, length: int) -> list[int]:
    """``length`` random token ids in [3, 500) from ``seed`` (the tiny model's vocabulary is 512)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def next_turn(prompt: list[int], answer: list[int], message: list[int]) -> list[int]:
    """A conversation's next prompt: the previous prompt, its answer (decode's output token ids),
    then the new user message."""
    return [*prompt, *answer, *message]


def drop_prefix_cache(engine: Engine, tries: int = 50, wait_s: float = 0.1) -> None:
    """Drop the engine's own (device) prefix cache, as traffic evicting it would; the connectors
    keep what they hold. vLLM refuses while blocks are still held (a store to a connector in
    flight), so it is asked again, ``tries`` times at most."""
    for _ in range(tries):
        if engine.reset_prefix_cache():
            return
        time.sleep(wait_s)
    raise RuntimeError(f"the engine refused reset_prefix_cache {tries} times")


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters that changed, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@dataclass
class Served:
    """One request through the proxy flow, as the decode engine's counters saw it."""

    label: str
    prompt_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    #: child -> tokens it loaded, for each child whose load counter moved, in composition order:
    #: empty when the prompt was computed locally; two under ``load: ranges`` when the host tier
    #: loaded a prefix and NIXL the rest.
    loaded: dict[str, int]
    computed_tokens: int
    nixl_bytes: int
    host_blocks: int
    failed_transfers: int
    #: prefill wall time (client side) + decode's time from arrival to first token
    ttft_s: float
    prefill_params: dict[str, Any] | None
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def children(self) -> tuple[str, ...]:
        """The children that loaded part of the prompt, in composition order (empty: none)."""
        return tuple(self.loaded)

    @property
    def loaded_tokens(self) -> int:
        """Tokens loaded by all children together."""
        return sum(self.loaded.values())

    def cached_by_source(self) -> dict[str, int]:
        """vLLM's ``prompt_tokens_cached_by_source`` for this request, device hits left out:
        ``{"host": 288, "p2p": 417}`` when the host tier and NIXL served it."""
        return {
            key[len(CACHED_BY_SOURCE) : -1]: int(n)
            for key, n in self.counters.items()
            if key.startswith(CACHED_BY_SOURCE) and key != f"{CACHED_BY_SOURCE}device}}"
        }

    def served_by(self) -> str:
        """``"host 576 + pd 24"``: each loading child and its tokens; ``"none"`` when none loaded."""
        return " + ".join(f"{c} {n}" for c, n in self.loaded.items()) or "none"


def pd_request(
    prefill: Engine,
    decode: Engine,
    prompt: list[int],
    max_tokens: int,
    label: str = "",
    children: tuple[str, ...] = ("host", "pd"),
) -> Served:
    """Prefill (``max_tokens=1``, ``do_remote_decode``), then decode with prefill's params."""
    t0 = time.perf_counter()
    (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    prefill_s = time.perf_counter() - t0
    return decode_request(decode, prompt, max_tokens, p["kv_transfer_params"], label, children, prefill_s)


def decode_request(
    decode: Engine,
    prompt: list[int],
    max_tokens: int,
    params: dict[str, Any] | None,
    label: str = "",
    children: tuple[str, ...] = ("host", "pd"),
    prefill_s: float = 0.0,
    timeout_s: float = 120.0,
) -> Served:
    """One decode request (with ``params`` from a prefill, or None for a local one) and its counters."""
    before = decode.metrics()
    t0 = time.perf_counter()
    (d,) = decode.generate([prompt], max_tokens, [params] if params is not None else None, timeout=timeout_s)
    wall = time.perf_counter() - t0
    moved = delta(before, decode.metrics())
    # The offline engine reports the request's own TTFT; the HTTP server does not, and its
    # TTFT histogram moved by exactly this request's (the same RequestStateStats figure).
    ttft = d.get("ttft_s")
    if ttft is None and TTFT_SUM in moved:
        ttft = moved[TTFT_SUM]
    return Served(
        label=label,
        prompt_tokens=len(prompt),
        token_ids=d["token_ids"],
        logprobs=d["logprobs"],
        finish_reason=d.get("finish_reason"),
        loaded={c: int(moved.get(tokens_key(c), 0)) for c in children if moved.get(loads_key(c), 0) > 0},
        computed_tokens=int(moved.get(COMPUTED, 0)),
        nixl_bytes=int(moved.get(NIXL_BYTES, 0)),
        host_blocks=int(moved.get(HOST_LOADED_BLOCKS, 0)),
        failed_transfers=int(moved.get(NIXL_FAILED, 0)),
        ttft_s=prefill_s + (ttft if ttft is not None else wall),
        prefill_params=params,
        counters=moved,
    )


def hit_rates(
    before: dict[str, float], after: dict[str, float], children: tuple[str, ...]
) -> dict[str, tuple[int, int]]:
    """child -> (requests it loaded, requests looked up) between two metric snapshots."""
    moved = delta(before, after)
    lookups = int(moved.get(LOOKUPS, 0))
    return {c: (int(moved.get(loads_key(c), 0)), lookups) for c in children}
