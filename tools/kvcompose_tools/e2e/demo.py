"""``kvcompose demo``: P/D over NIXL plus the CPU tier, between real vLLM engines, checked.

1. a single-engine baseline (no connector) answers every prompt: the reference tokens/logprobs;
2. a prefill and a decode engine start from ``examples/pd-prefill.yaml`` / ``pd-decode.yaml``;
3. each prompt goes through the proxy flow (prefill, then decode with prefill's params): decode
   pulls the prompt's KV over NIXL (child ``pd``);
4. the decode engine's own prefix cache is dropped, and some prompts come again as a repeated
   turn: the host-memory tier (child ``host``) loads their full blocks, NIXL at most the tail;
5. a two-turn conversation: turn 2 is turn 1's prompt, turn 1's answer and a new user message.
   Decode's own prefix cache is dropped before turn 2 (as other traffic would evict it), so under
   ``load: ranges`` one request is served by both children: ``host`` loads the prefix it stored
   while decode served turn 1, and ``pd`` pulls only the rest from the prefill engine;
6. every decode output is compared with the baseline; any difference exits 1.

``http=True`` (``kvcompose demo --http``) is the serving stack: prefill and decode run as vLLM's
OpenAI-compatible HTTP servers (:mod:`kvcompose_tools.e2e.server`) behind vLLM's router
(:mod:`kvcompose_tools.e2e.router`, P/D mode over NIXL), and every request is one ``/v1/completions``
call to the router, which sends it to prefill and then to decode with prefill's
``kv_transfer_params``. The counters come from decode's ``/metrics``, into the same report. A
three-turn chat (``/v1/chat/completions``, :mod:`kvcompose_tools.e2e.chat`) follows, decode's prefix
cache dropped between turns so that later turns are served by host and NIXL together. The
baseline stays an offline engine, so the check also shows that the router and the HTTP path
return the same token ids and logprobs as ``vllm.LLM``.

``decodes=2`` (``kvcompose demo --http --decodes 2``) is 1P2D: two decode servers behind the
router, whose ``consistent_hash`` policy routes by the ``X-Session-ID`` header. The demo asks the
router which decode each session lands on (:func:`~kvcompose_tools.e2e.flow.session_per_decode`), sends
the table's requests as one session, and runs one conversation per decode: each conversation's
turns must reach the decode whose host tier holds its earlier turns.

``link="800mbit"`` (``kvcompose demo --hosts [--link RATE]``) is that serving stack across hosts
(:mod:`kvcompose_tools.e2e.hosts`): the prefill server in a host of its own, each decode server in
another, their links at ``link`` (the default, :data:`~kvcompose_tools.e2e.hosts.DEFAULT_LINK`, scales
a 100 Gbit/s link for Llama-3-8B's KV to the tiny model's), UCX held to tcp over each host's
``eth0``; the baseline and the router stay in the root namespace. The table's header names the
link, and a column gives each request's NIXL pull time (decode's
``vllm:nixl_xfer_time_seconds``, the reads of that request). The outputs must still equal the
baseline's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any, TextIO

from kvcompose.examples import ExampleError, pd_pair
from kvcompose_tools.e2e.chat import OTHER_SYSTEM, SYSTEM, ChatTurn, baseline_chat, chat_through_router, load_tokenizer
from kvcompose_tools.e2e.flow import (
    Served,
    drop_prefix_cache,
    hit_rates,
    next_turn,
    pd_request,
    routed_request,
    session_per_decode,
    token_prompt,
)
from kvcompose_tools.e2e.hosts import Hosts, HostsError, parse_rate
from kvcompose_tools.e2e.model import LOGPROB_TOLERANCE, make_model, model_config
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

CHILDREN = ("host", "pd")
MAX_TOKENS = 16
#: (label, seed, length): lengths that are not whole blocks, so the partial tail shows.
PROMPTS = (("A", 0, 600), ("B", 1, 450), ("C", 2, 300))
REPEATS = ("A", "B")
#: The conversation: turn 1's prompt (seed, length); turn 2 appends turn 1's answer and a new
#: user message (seed, at least this length), as many tokens as make turn 2 one past a block
#: boundary (300 + 16 + 389 = 705). The decode engine loads all of turn 2's KV but the last prompt
#: token's and computes that one alone; a single engine does the same when asked turn 2 a second
#: time (its prefix cache then holds every full block), and that answer is the one decode's must
#: equal bit for bit. Its first answer computes the new part in one batch, the last token inside
#: it: the same tokens, logprobs ~1e-7 apart (float rounding in vLLM's CPU attention), shown in
#: the summary. Turn 1's answer ends inside its last block, so the host tier holds turn 1's
#: prompt blocks, whose KV prefill computed as the baseline did.
TURN_1 = (3, 300)
NEW_MESSAGE = (4, 380)


def one_past_a_block(prefix: int, at_least: int) -> int:
    """A new message's length: ``at_least`` or more, so that ``prefix`` + it is one past a block
    boundary (all of the prompt in full blocks but its last token)."""
    return at_least + (1 - prefix - at_least) % BLOCK_SIZE


def _progress(out: TextIO) -> Any:
    def show(nodes: list[Any], elapsed: float) -> None:
        states = ", ".join(f"{n.spec.name}: {n.stage}" for n in nodes)
        print(f"  ... {elapsed:4.0f} s  {states}", file=out, flush=True)

    return show


#: The table's header; :func:`_row` writes its rows.
HEADER = f"  {'request':<12} {'loaded by':<18} {'computed':>8}  {'bytes moved':<42} {'time to first token':<21} output"


def _moved(s: Served) -> str:
    parts = []
    if s.host_blocks:
        parts.append(f"{s.host_blocks} blocks from host")
    if s.host_bytes:
        parts.append(f"{s.host_bytes:,} B from host")
    if s.nixl_bytes:
        parts.append(f"{s.nixl_bytes:,} B over NIXL")
    return " + ".join(parts) or "-"


#: decode's NIXL transfer-time histogram (its sum moves by the request's reads' durations).
XFER_TIME = "vllm:nixl_xfer_time_seconds_sum"


def _pull(s: Served) -> str:
    """The request's NIXL pull time (decode's reads), or ``-`` where it pulled nothing."""
    return f"{s.counters.get(XFER_TIME, 0.0) * 1000:7.1f} ms" if s.nixl_bytes else f"{'-':>10}"


def _row(s: Served, ok: bool, pull: bool = False) -> str:
    return (
        f"  {s.label:<12} {s.served_by():<18} {s.computed_tokens:>8}  {_moved(s):<42} "
        f"TTFT {s.ttft_s * 1000:9.1f} ms    {_pull(s) + '   ' if pull else ''}{'equal' if ok else 'MISMATCH'}"
    )


def run(
    work: Path | None = None,
    out: TextIO = sys.stdout,
    prefill_yaml: Path | None = None,
    decode_yaml: Path | None = None,
    http: bool = False,
    decodes: int = 1,
    link: str | None = None,
    model: str = "tiny",
    host_tier: str = "simple",
) -> int:
    """Run the demo; 0 when every decode output equals the baseline, 1 otherwise. ``http``:
    prefill and decode are vLLM API servers behind vLLM's router, else offline engines (the
    baseline is offline). ``decodes`` (with ``http``): that many decode servers behind the
    router, which keeps each conversation on one of them (``consistent_hash``). ``link`` (implies
    ``http``): the prefill and each decode server in a host of its own, links at that rate.
    ``model``: a name of :data:`~kvcompose_tools.e2e.model.MODELS`. ``host_tier``: a name of
    :data:`~kvcompose.examples.HOST_TIERS`, the shipped pair run (unless ``prefill_yaml``/``decode_yaml`` say)."""
    try:
        shipped = pd_pair(host_tier)
    except ExampleError as exc:
        print(f"demo: --host-tier: {exc}", file=out)
        return 2
    prefill_yaml = prefill_yaml or shipped[0]
    decode_yaml = decode_yaml or shipped[1]
    try:
        model_config(model)
    except ValueError as exc:
        print(f"demo: --model: {exc}", file=out)
        return 2
    if link is not None:
        http = True
        try:
            parse_rate(link)
        except ValueError as exc:
            print(f"demo: --link: {exc}", file=out)
            return 2
    if decodes not in (1, 2) or (decodes > 1 and not http):
        print(f"demo: --decodes {decodes}: 1 (offline or --http) or 2 (--http only)", file=out)
        return 2
    if link is None:
        return _run(work, out, prefill_yaml, decode_yaml, http, decodes, None, model)
    names = ["prefill"] + (["decode"] if decodes == 1 else [f"decode{i + 1}" for i in range(decodes)])
    try:
        with Hosts(names, link=link) as hosts:
            return _run(work, out, prefill_yaml, decode_yaml, http, decodes, hosts, model)
    except HostsError as exc:
        print(f"demo: --hosts: {exc}", file=out)
        return 2


def _run(
    work: Path | None,
    out: TextIO,
    prefill_yaml: Path,
    decode_yaml: Path,
    http: bool,
    decodes: int,
    hosts: Hosts | None,
    model_name: str = "tiny",
) -> int:
    where = (lambda name: hosts[name.replace("-", "")]) if hosts is not None else (lambda name: None)
    started = time.monotonic()
    model = make_model(0, config=model_config(model_name))
    tolerance = LOGPROB_TOLERANCE[model_name]
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-demo-"))
    print(f"model: {model} (seeded random weights)\nengine logs: {logs}", file=out)
    prompts = {label: token_prompt(seed, n) for label, seed, n in PROMPTS}
    turn_1 = token_prompt(*TURN_1)
    p_port, *d_ports = free_ports(1 + decodes)
    Node: Any = ServerNode if http else EngineNode
    kind = "HTTP server" if http else "engine"
    nodes: list[Any] = []
    chats: list[list[ChatTurn]] = []
    try:
        print(f"starting baseline (offline engine, no connector) and prefill {kind} ...", file=out, flush=True)
        baseline = EngineNode(EngineSpec("baseline", str(model)), logs)
        nodes.append(baseline)
        placed = {"host": where("prefill")} if hosts is not None else {}
        prefill = Node(EngineSpec("prefill", str(model), str(prefill_yaml), p_port), logs, **placed)
        nodes.append(prefill)
        wait_all_ready([baseline, prefill], progress=_progress(out))
        expected = {label: baseline.generate([ids], MAX_TOKENS)[0] for label, ids in prompts.items()}
        # Turn 2 follows the baseline's own turn-1 answer (decode's must be the same tokens).
        expected["turn 1"] = baseline.generate([turn_1], MAX_TOKENS)[0]
        seed, at_least = NEW_MESSAGE
        message = token_prompt(seed, one_past_a_block(len(turn_1) + len(expected["turn 1"]["token_ids"]), at_least))
        turn_2 = next_turn(turn_1, expected["turn 1"]["token_ids"], message)
        first_answer = baseline.generate([turn_2], MAX_TOKENS)[0]
        expected["turn 2"] = baseline.generate([turn_2], MAX_TOKENS)[0]  # its last prompt token alone
        if http:  # one conversation per decode server
            tokenizer = load_tokenizer(model)
            systems = (SYSTEM, OTHER_SYSTEM)[:decodes]
            chats = [baseline_chat(baseline, tokenizer, MAX_TOKENS, system=system) for system in systems]
        baseline.close()
        nodes.remove(baseline)
        names = ["decode"] if decodes == 1 else [f"decode-{i + 1}" for i in range(decodes)]
        print(f"baseline done; starting {', '.join(names)} {kind} ...", file=out, flush=True)
        pool = [
            Node(EngineSpec(name, str(model), str(decode_yaml), port), logs, **({"host": where(name)} if hosts else {}))
            for name, port in zip(names, d_ports)
        ]
        nodes += pool
        wait_all_ready(pool, progress=_progress(out))
        if http:
            # consistent_hash keeps a session on one decode; with one decode there is nothing to choose.
            policy = "consistent_hash" if decodes > 1 else "round_robin"
            router = RouterNode([prefill], pool, str(model), logs, policy=policy)
            nodes.append(router)
            router.wait_ready()
            via = f"vLLM's router {router.url} ({policy}) -> prefill {prefill.url}, " + ", ".join(
                f"{d.name} {d.url}" for d in pool
            )
            # The table's requests are one session: they reach one decode (the router's choice).
            sessions = session_per_decode(router, pool)
            table_decode, table_session = next(iter(sessions.items()))
            if decodes > 1:
                via += f"; the table's requests as {table_session}, which the router sends to {table_decode}"
        else:
            via = "offline engines, proxy flow"
        if hosts is not None:
            placed_at = ", ".join(f"{h.name} {h.address}" for h in hosts)
            via += (
                f"; prefill and each decode in a host of its own ({placed_at}), "
                f"links at {link_text(next(iter(hosts)).rate)}, UCX over tcp on each host's eth0"
            )
        channels = ", ".join(f"{d.spec.name} :{port}" for d, port in zip(pool, d_ports))
        print(
            f"engines ready after {time.monotonic() - started:.0f} s "
            f"({via}; NIXL side channels: prefill :{p_port}, {channels})\n",
            file=out,
        )

        def serve(ids: list[int], label: str) -> Served:
            if http:  # one request to the router: it does prefill, then decode
                return routed_request(router, pool, ids, MAX_TOKENS, label, CHILDREN, table_session)
            return pd_request(prefill, pool[0], ids, MAX_TOKENS, label=label, children=CHILDREN)

        def drop_all() -> None:
            for d in pool:
                drop_prefix_cache(d)

        before = [d.metrics() for d in pool]
        served: list[tuple[Served, bool]] = []

        def add_row(s: Served, ok: bool, why: str = "") -> None:
            served.append((s, ok))
            print(_row(s, ok, hosts is not None) + why, file=out, flush=True)

        if hosts is not None:
            print(f"  across hosts, links at {link_text(next(iter(hosts)).rate)}", file=out)
            print(HEADER.replace("output", f"{'NIXL pull':<13}output"), file=out)
        else:
            print(HEADER, file=out)

        def check(s: Served, want: dict[str, Any]) -> None:
            add_row(s, *verdict(s, want, tolerance))

        for label, ids in prompts.items():
            check(serve(ids, f"{label} ({len(ids)})"), expected[label])
        drop_all()
        print("  -- decode's own prefix cache dropped; repeated turns --", file=out)
        for label in REPEATS:
            check(serve(prompts[label], f"{label} again"), expected[label])
        answer = len(expected["turn 1"]["token_ids"])
        print(
            f"  -- conversation: turn 2 = turn 1 + its {answer}-token answer + {len(message)} new tokens; "
            "decode's prefix cache dropped before turn 2 --",
            file=out,
        )
        first = serve(turn_1, f"turn 1 ({len(turn_1)})")
        check(first, expected["turn 1"])
        drop_all()
        turn_2 = next_turn(turn_1, first.token_ids, message)
        second = serve(turn_2, f"turn 2 ({len(turn_2)})")
        check(second, expected["turn 2"])
        chat_gaps: list[float] = []
        for chat, (decode_name, session) in zip(chats, sessions.items() if http else ()):
            where = f" as {session}, which the router sends to {decode_name}" if decodes > 1 else ""
            print(
                f"  -- chat (/v1/chat/completions){where}: each turn = the whole history + a new user message; "
                "decode's prefix cache dropped before turns 2 and 3 --",
                file=out,
            )
            for turn, s in chat_through_router(router, pool, chat, MAX_TOKENS, CHILDREN, session):
                problems = turn.problems(s)
                if s.decode != decode_name:
                    problems.append(f"routed to {s.decode}, not {decode_name}")
                chat_gaps.append(_logprob_gap(s, turn.first))
                add_row(s, not problems, f" ({', '.join(problems)})" if problems else "")
        rates = {c: (0, 0) for c in CHILDREN}
        for d, was in zip(pool, before):
            for c, (loads, lookups) in hit_rates(was, d.metrics(), CHILDREN).items():
                rates[c] = (rates[c][0] + loads, rates[c][1] + lookups)
    except NodeError as exc:
        print(f"\ndemo failed: {exc}", file=out)
        return 1
    finally:
        for n in reversed(nodes):
            n.close()
    bad = [s.label for s, ok in served if not ok]
    if second.token_ids != first_answer["token_ids"]:
        bad.append(f"{second.label} (vs the baseline's first answer)")
    print(f"\nsummary ({' + '.join(names)}, from the vllm:kvcompose_* counters):", file=out)
    for child, (loads, lookups) in rates.items():
        pct = 100.0 * loads / lookups if lookups else 0.0
        tokens = sum(s.loaded.get(child, 0) for s, _ in served)
        print(f"  {child:<5} served {loads} of {lookups} lookups ({pct:.0f}%), {tokens:,} tokens", file=out)
    sources: dict[str, int] = {}
    for s, _ in served:
        for source, n in s.cached_by_source().items():
            sources[source] = sources.get(source, 0) + n
    split = ", ".join(f"{source} {n:,}" for source, n in sorted(sources.items()))
    print(f"  vLLM's own count (prompt_tokens_cached_by_source): {split or 'none'}", file=out)
    both = sum(len(s.children) > 1 for s, _ in served)
    print(f"  served by more than one child (load: ranges): {both} of {len(served)} requests", file=out)
    nixl = sum(s.nixl_bytes for s, _ in served)
    host = sum(s.host_blocks for s, _ in served)
    host_bytes = sum(s.host_bytes for s, _ in served)
    computed = sum(s.computed_tokens for s, _ in served)
    from_host = f"{host} blocks ({BLOCK_SIZE} tokens each)" if host or not host_bytes else f"{host_bytes:,} B"
    print(
        f"  moved: {nixl:,} B over NIXL, {from_host} from host memory; {computed:,} prompt tokens computed on decode",
        file=out,
    )
    within = f"logprobs within {tolerance:g} ({model_name} model)" if tolerance else "logprobs bit for bit"
    print(
        f"  outputs equal to the single-engine baseline (token ids, {within}): "
        f"{sum(ok for _, ok in served)}/{len(served)}",
        file=out,
    )
    print(
        f"  turn 2 vs the baseline's first answer to it (last prompt token computed in the batch): token ids "
        f"{'equal' if second.token_ids == first_answer['token_ids'] else 'DIFFER'}, logprobs within "
        f"{_logprob_gap(second, first_answer):.1e}",
        file=out,
    )
    if chats:
        print(
            "  chat turns vs the baseline's first answers (new part computed in one batch): logprobs within "
            + ", ".join(f"{g:.1e}" for g in chat_gaps),
            file=out,
        )
    print(f"  wall time: {time.monotonic() - started:.0f} s", file=out)
    if bad:
        print(f"MISMATCH in {', '.join(bad)}", file=out)
        return 1
    return 0


def link_text(bits: int | None) -> str:
    """A link rate for the table's header (``800 Mbit/s``)."""
    if bits is None:
        return "unshaped"
    for unit, n in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if bits >= n:
            return f"{bits / n:g} {unit}"
    return f"{bits} bit/s"


def verdict(s: Served, expected: dict[str, Any], tolerance: float = 0.0) -> tuple[bool, str]:
    """Whether ``s`` answered as the baseline did: the same token ids and logprobs, bit for bit
    or within ``tolerance``; and, when not bit for bit, what differs (for the row)."""
    if s.equals(expected):
        return True, ""
    if s.token_ids != expected["token_ids"]:
        k = next((i for i, (a, b) in enumerate(zip(s.token_ids, expected["token_ids"])) if a != b), None)
        return False, f" (token ids differ from token {(k if k is not None else len(s.token_ids)) + 1})"
    gap = _logprob_gap(s, expected)
    return gap <= tolerance, f" (token ids equal, logprobs within {gap:.1e})"


def _logprob_gap(s: Served, expected: dict[str, Any]) -> float:
    """The largest logprob difference, between the float32 values the engines computed (the
    router's JSON re-encoding moves doubles by an ulp: see :func:`~kvcompose_tools.e2e.flow.same_output`)."""
    got, want = array("f", s.logprobs), array("f", expected["logprobs"])
    return max((abs(a - b) for a, b in zip(got, want, strict=False)), default=0.0)
