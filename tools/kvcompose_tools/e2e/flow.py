"""Requests through the P/D pair, and what each did, from the decode engine's metrics.

Two ways in, one way to measure. The proxy flow (:func:`pd_request`) goes the way vLLM's
disaggregated proxy example does: to the prefill engine with
``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``, then to the decode engine
with the ``kv_transfer_params`` prefill returned. The routed flow (:func:`routed_request`,
:func:`routed_chat`) sends one request to vLLM's router (:mod:`kvcompose_tools.e2e.router`), which does
those two steps itself. Either way :func:`measured` reads the decode engine's own Prometheus
counters before and after the request (requests are sent one at a time): which children loaded
KV and how many tokens each (``vllm:kvcompose_loads{child}``, ``vllm:kvcompose_loaded_tokens{child}``,
counted by the composed connector; under ``load: ranges`` one request can be served by several,
e.g. the host tier's prefix and the rest over NIXL), tokens computed, bytes moved.
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcompose_tools.e2e.processes import CALL_TIMEOUT_S, NodeError

#: Counter keys, as :func:`kvcompose_tools.e2e.metrics.flatten_metrics` (and the HTTP parser) write them.
LOOKUPS = "vllm:kvcompose_lookups"
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_FAILED = "vllm:nixl_num_failed_transfers"
COMPUTED = "vllm:prompt_tokens_by_source{source=local_compute}"
EXTERNAL = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
HOST_LOADED_BLOCKS = "vllm:simple_kv_offload_load_blocks"
#: Bytes vLLM's OffloadingConnector loaded (a ``native-offload`` child), per transfer type.
NATIVE_LOADED_BYTES = "vllm:kv_offload_load_bytes"
#: vLLM's own split of connector-loaded prompt tokens by tier (each child's
#: ``get_external_cache_hit_sources``: ``host`` from the CPU tier, ``p2p`` from NIXL).
CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source{source="
#: Requests an engine finished, per finish reason: ``vllm:request_success{finished_reason=length}``.
SUCCESS = "vllm:request_success"
#: Counters reach /metrics when a server's output loop records the finished request, which may
#: trail the HTTP answer by a moment: waits for them are bounded by this.
SETTLE_TIMEOUT_S = 10.0
#: Sum of the requests' times from first to last token: one request's own when requests go one
#: at a time (what a client's wall time holds beyond the time to first token).
DECODE_TIME = "vllm:request_decode_time_seconds_sum"


def loads_key(child: str) -> str:
    return f"vllm:kvcompose_loads{{child={child}}}"


def tokens_key(child: str) -> str:
    return f"vllm:kvcompose_loaded_tokens{{child={child}}}"


class Engine(Protocol):
    """What the flow needs from an engine: an offline node (``node.EngineNode``) or an HTTP
    server (``server.ServerNode``, ``server.ServerClient``)."""

    @property
    def name(self) -> str: ...

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = ...,
    ) -> list[dict[str, Any]]: ...

    def metrics(self) -> dict[str, float]: ...

    def reset_prefix_cache(self) -> bool: ...


def full_blocks(prompt: list[int], block_size: int) -> int:
    """Tokens of the prompt's full blocks but the last token's: what a connector can load (vLLM
    always computes the last token)."""
    return (len(prompt) - 1) // block_size * block_size


def token_prompt(seed: int, length: int) -> list[int]:
    """``length`` random token ids in [3, 500) from ``seed`` (the tiny model's vocabulary is 512)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def next_turn(prompt: list[int], answer: list[int], message: list[int]) -> list[int]:
    """A conversation's next prompt: the previous prompt, its answer (decode's output token ids),
    then the new user message."""
    return [*prompt, *answer, *message]


def drop_prefix_cache(engine: Engine | Answered, tries: int = 50, wait_s: float = 0.1) -> None:
    """Drop the engine's own (device) prefix cache, as traffic evicting it would; the connectors
    keep what they hold. vLLM refuses while blocks are still held (a store to a connector in
    flight), so it is asked again, ``tries`` times at most."""
    for _ in range(tries):
        if engine.reset_prefix_cache():
            return
        time.sleep(wait_s)
    raise RuntimeError(f"the engine refused reset_prefix_cache {tries} times")


def same_output(token_ids: list[int], logprobs: list[float], expected: dict[str, Any]) -> bool:
    """The same token ids and, bit for bit, the same float32 logprobs as ``expected``.

    The engines compute logprobs in float32 and return them widened to doubles; the router
    re-encodes decode's JSON answer, and its float parsing can move a double by one unit in the
    last place (-3.8056788444519043 came back as -3.805678844451904), which rounds back to the
    same float32. So logprobs are compared as the float32 values the engine computed.
    """
    return token_ids == expected["token_ids"] and _f32(logprobs) == _f32(expected["logprobs"])


def _f32(values: list[float]) -> bytes:
    return array("f", values).tobytes()


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters that changed, by how much."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


@dataclass
class Served:
    """One request through the P/D pair, as the decode engine's counters saw it."""

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
    #: the time to first token as the client saw it: offline, prefill's wall time + decode's
    #: arrival-to-first-token; over HTTP, the client's wall time for the whole request less
    #: decode's time from its first token to its last (``vllm:request_decode_time_seconds``)
    ttft_s: float
    #: the params decode was sent (None through the router, which keeps them to itself)
    prefill_params: dict[str, Any] | None
    counters: dict[str, float] = field(default_factory=dict)
    #: the prompt's token ids as the server saw them (chat: rendered with the chat template)
    prompt_ids: list[int] | None = None
    #: the answer's text (chat)
    text: str | None = None
    #: the decode server that answered (routed requests; None for the proxy flow's one decode)
    decode: str | None = None
    #: the prefill server that computed the prompt, and the prompt tokens it computed (a fleet's
    #: routed requests; None elsewhere)
    prefill: str | None = None
    prefill_computed_tokens: int | None = None
    #: inside the decode engine, seconds per :data:`kvcompose_tools.e2e.node.PHASES` (offline engines only)
    phases_s: dict[str, float] | None = None

    @property
    def children(self) -> tuple[str, ...]:
        """The children that loaded part of the prompt, in composition order (empty: none)."""
        return tuple(self.loaded)

    @property
    def host_bytes(self) -> int:
        """Bytes a ``native-offload`` child (vLLM's OffloadingConnector) loaded for the request."""
        name = NATIVE_LOADED_BYTES
        return int(sum(n for k, n in self.counters.items() if k == name or k.startswith(name + "{")))

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

    def equals(self, expected: dict[str, Any]) -> bool:
        """This answer is ``expected``'s (:func:`same_output`)."""
        return same_output(self.token_ids, self.logprobs, expected)

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
    timeout_s: float = CALL_TIMEOUT_S,
) -> Served:
    """The proxy flow: prefill (``max_tokens=1``, ``do_remote_decode``), then decode with
    prefill's params; each call waits ``timeout_s`` at most."""
    t0 = time.perf_counter()
    (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}], timeout=timeout_s)
    prefill_s = time.perf_counter() - t0
    return decode_request(decode, prompt, max_tokens, p["kv_transfer_params"], label, children, prefill_s, timeout_s)


def decode_request(
    decode: Engine,
    prompt: list[int],
    max_tokens: int,
    params: dict[str, Any] | None,
    label: str = "",
    children: tuple[str, ...] = ("host", "pd"),
    prefill_s: float = 0.0,
    timeout_s: float = CALL_TIMEOUT_S,
) -> Served:
    """One decode request (with ``params`` from a prefill, or None for a local one) and its counters."""
    kv = [params] if params is not None else None
    return measured(
        decode,
        lambda: decode.generate([prompt], max_tokens, kv, timeout=timeout_s)[0],
        len(prompt),
        label,
        children,
        params,
        prefill_s,
    )


class Router(Protocol):
    """What the routed flow needs from the router (:class:`kvcompose_tools.e2e.router.RouterNode`)."""

    def generate(
        self, prompts: list[list[int]], max_tokens: int, timeout: float = ..., session: str | None = None
    ) -> list[dict[str, Any]]: ...

    def chat(
        self, messages: list[dict[str, str]], max_tokens: int, timeout: float = ..., session: str | None = None
    ) -> dict[str, Any]: ...


class Answered(Protocol):
    """A decode server behind a router: it counts the requests the router sent it
    (:meth:`~kvcompose_tools.e2e.server.ServerNode.answered_elsewhere`)."""

    @property
    def name(self) -> str: ...

    def metrics(self) -> dict[str, float]: ...

    def answered_elsewhere(self, n: int = 1) -> None: ...

    def reset_prefix_cache(self) -> bool: ...


def routed_request(
    router: Router,
    decodes: Sequence[Answered],
    prompt: list[int],
    max_tokens: int,
    label: str = "",
    children: tuple[str, ...] = ("host", "pd"),
    session: str | None = None,
    prefills: Sequence[Answered] = (),
) -> Served:
    """One ``/v1/completions`` request to the router (which sends it to prefill, then to one of
    ``decodes`` with prefill's params), measured on the decode that answered it (and on the one
    of ``prefills`` that computed it, when given)."""

    def send() -> dict[str, Any]:
        return router.generate([prompt], max_tokens, session=session)[0]

    return routed(decodes, send, len(prompt), label, children, prefills)


def routed_chat(
    router: Router,
    decodes: Sequence[Answered],
    messages: list[dict[str, str]],
    max_tokens: int,
    label: str = "",
    children: tuple[str, ...] = ("host", "pd"),
    session: str | None = None,
) -> Served:
    """One ``/v1/chat/completions`` request to the router, measured on the decode that answered
    it; ``prompt_ids`` holds the prompt as decode rendered it, ``text`` the reply."""
    return routed(decodes, lambda: router.chat(messages, max_tokens, session=session), 0, label, children)


def routed(
    decodes: Sequence[Answered],
    send: Callable[[], dict[str, Any]],
    prompt_tokens: int,
    label: str,
    children: tuple[str, ...],
    prefills: Sequence[Answered] = (),
) -> Served:
    """``send()`` one request through a router, and what the decode that answered it did. The
    router does not say which decode it chose; the decode whose ``vllm:request_success`` moved
    did (requests go one at a time). With ``prefills`` (a fleet's), the prefill that answered is
    found the same way: :attr:`Served.prefill` and the prompt tokens it computed."""
    before = [d.metrics() for d in decodes]
    p_before = [p.metrics() for p in prefills]
    answer = send()
    i, after = which_answered(decodes, before, label, "decode")
    s = served(answer, delta(before[i], after), prompt_tokens, label, children, decode=decodes[i].name)
    if prefills:
        j, p_after = which_answered(prefills, p_before, label, "prefill")
        s.prefill = prefills[j].name
        s.prefill_computed_tokens = int(delta(p_before[j], p_after).get(COMPUTED, 0))
    return s


def which_answered(
    servers: Sequence[Answered], before: Sequence[dict[str, float]], label: str, role: str
) -> tuple[int, dict[str, float]]:
    """The one of ``servers`` whose answered count moved since ``before`` (waited for, bounded),
    and its counters now; it counts the request (:meth:`Answered.answered_elsewhere`)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        after = [d.metrics() for d in servers]
        moved = [i for i in range(len(servers)) if answered(after[i]) > answered(before[i])]
        if len(moved) == 1:
            break
        if time.monotonic() >= deadline:
            names = ", ".join(servers[i].name for i in moved) or "none"
            raise NodeError(f"{label or 'request'}: one {role} should have answered; counted by {names}")
        time.sleep(0.05)
    (i,) = moved
    servers[i].answered_elsewhere()
    return i, after[i]


def answered(metrics: dict[str, float]) -> float:
    """Requests the engine finished (``vllm:request_success``, every finish reason)."""
    return sum(v for k, v in metrics.items() if k == SUCCESS or k.startswith(SUCCESS + "{"))


def measured(
    decode: Any,
    send: Callable[[], dict[str, Any]],
    prompt_tokens: int,
    label: str,
    children: tuple[str, ...],
    params: dict[str, Any] | None = None,
    prefill_s: float = 0.0,
) -> Served:
    """``send()`` one request whose decode step runs on ``decode``, and what decode's counters
    say it did (their change across the request)."""
    before = decode.metrics()
    d = send()
    return served(d, delta(before, decode.metrics()), prompt_tokens, label, children, params, prefill_s)


def served(
    d: dict[str, Any],
    moved: dict[str, float],
    prompt_tokens: int,
    label: str,
    children: tuple[str, ...],
    params: dict[str, Any] | None = None,
    prefill_s: float = 0.0,
    decode: str | None = None,
) -> Served:
    """The :class:`Served` of answer ``d``, given how decode's counters ``moved`` across it."""
    if d.get("ttft_s") is not None:  # the offline engine reports the request's own
        ttft = prefill_s + d["ttft_s"]
    else:
        ttft = prefill_s + d["wall_s"] - moved.get(DECODE_TIME, 0.0)
    prompt_ids = d.get("prompt_token_ids")
    return Served(
        label=label,
        prompt_tokens=len(prompt_ids) if prompt_ids is not None else prompt_tokens,
        token_ids=d["token_ids"],
        logprobs=d["logprobs"],
        finish_reason=d.get("finish_reason"),
        loaded={c: int(moved.get(tokens_key(c), 0)) for c in children if moved.get(loads_key(c), 0) > 0},
        computed_tokens=int(moved.get(COMPUTED, 0)),
        nixl_bytes=int(moved.get(NIXL_BYTES, 0)),
        host_blocks=int(moved.get(HOST_LOADED_BLOCKS, 0)),
        failed_transfers=int(moved.get(NIXL_FAILED, 0)),
        ttft_s=ttft,
        prefill_params=params,
        counters=moved,
        prompt_ids=prompt_ids,
        text=d.get("text"),
        decode=decode,
        phases_s=d.get("phases_s"),
    )


def hit_rates(
    before: dict[str, float], after: dict[str, float], children: tuple[str, ...]
) -> dict[str, tuple[int, int]]:
    """child -> (requests it loaded, requests looked up) between two metric snapshots."""
    moved = delta(before, after)
    lookups = int(moved.get(LOOKUPS, 0))
    return {c: (int(moved.get(loads_key(c), 0)), lookups) for c in children}


def session_per_decode(
    router: Router, decodes: Sequence[Answered], candidates: int = 32, prompt_tokens: int = 8
) -> dict[str, str]:
    """decode name -> a session id the router sends to it, asked of the router itself: one short
    request per candidate (``session-0``, ``session-1``, ...) until every decode has one. Under
    ``consistent_hash`` the answer depends on the servers' URLs, so it is asked, not computed. The
    probes are shorter than a block: nothing of them reaches a prefix cache or a connector."""
    found: dict[str, str] = {}
    for n in range(candidates):
        session = f"session-{n}"
        s = routed_request(router, decodes, token_prompt(1000 + n, prompt_tokens), 1, session, (), session)
        assert s.decode is not None
        found.setdefault(s.decode, session)
        if len(found) == len(decodes):
            return found
    missing = [d.name for d in decodes if d.name not in found]
    raise NodeError(f"the router sent none of {candidates} sessions to {', '.join(missing)}")
