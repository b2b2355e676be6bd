"""Attacks on a P/D pair by a client that reaches its ports (issue 51, docs/security.md).

The attacker is a process of its own; in the kit's engine test (``test_attacks.py``) it runs in
a host (network namespace) of its own beside the prefill's and the decode's, and reaches what
any pod on a flat cluster network reaches: both HTTP APIs and the prefill's NIXL side channel.
It does what a client of those ports can do:

* asks the prefill for real ``kv_transfer_params`` (its own requests), then offers them, altered
  or not, to the decode: with a field out of type, range or fit, each with the params' own prompt
  so that only the field check stands between it and a read (:data:`MALFORMED`, :data:`MISFITS`),
  beside the same params unaltered (the control, pulled); unaltered, with a prompt other than the
  one the prefill computed (:data:`PROMPT_ATTACKS`, issue 60: longer, shorter, one token changed,
  another prompt; each with fresh params); with a field the signature covers changed
  (:func:`decode_attacks`);
* names its own address as a prefill's side channel, and counts the connections it gets;
* replays params the decode already read, and params after the prefill's lease;
* sends garbage, oversized and unknown frames to the side channel, then asks it as vLLM does;
* given a prefill's NIXL agent metadata (a leak: the test opens the sealed one with the key),
  sends the prefill NIXL notifications (:data:`NOTIFICATIONS`) and listens for an answer.

Each attack's :class:`Outcome` says what the decode answered and how its counters moved; the
caller compares the answer with the prompt's own (the single-engine baseline) and checks that
the pair still serves. Run as ``python -m kvcompose_tools.e2e.attacks PLAN.json``: the plan is a
:class:`Plan` as JSON; the outcomes are printed as a JSON list.
"""

from __future__ import annotations

import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from kvcompose_tools.e2e.flow import decode_request, drop_prefix_cache, token_prompt
from kvcompose_tools.e2e.server import ServerClient

#: The decode's refusals (the nixl child's ``refused_params``, by reason).
REFUSED = "vllm:kvcompose_refused_params"
_REASON = re.compile(r"reason=([a-z]+)")
#: Fields that killed vLLM's decode engine in issue 51, then more of the same kind: each is
#: offered in a prefill's real params with the prompt they were computed for (the decode must
#: refuse it as ``malformed``, whatever it would make of the prompt or the signature).
MALFORMED: dict[str, dict[str, Any]] = {
    "block ids a string": {"remote_block_ids": "0,1,2"},
    "block ids strings": {"remote_block_ids": [["0", "1"]]},
    "negative block ids": {"remote_block_ids": [[-1, -2]]},
    "block ids past 2^62": {"remote_block_ids": [[2**62 + 1]]},
    "engine id a mapping": {"remote_engine_id": {"engine": 1}},
    "100,000 block ids": {"remote_block_ids": [list(range(100_000))]},
    "block ids an int": {"remote_block_ids": 7},
    "a float block id": {"remote_block_ids": [[0.5]]},
    "huge remote_num_tokens": {"remote_num_tokens": 10**12},
    "port a string": {"remote_port": "5600"},
    "port out of range": {"remote_port": 70000},
    "host with a path": {"remote_host": "evil/../x"},
    "tp_size zero": {"tp_size": 0},
    "expiry not a number": {"remote_blocks_expiry_time": "soon"},
    "do_remote_prefill a string": {"do_remote_prefill": "yes"},
    "request id a list": {"remote_request_id": ["x"]},
}
#: Fields of the right types that do not fit the params' own blocks and token count, or a digest
#: that is not one, built from the real params (``remote_block_ids``: one list per KV-cache group).
MISFITS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "a block more than its tokens fill": lambda p: {
        "remote_block_ids": [[*p["remote_block_ids"][0], max(p["remote_block_ids"][0]) + 1]]
    },
    "a block fewer than its tokens fill": lambda p: {"remote_block_ids": [p["remote_block_ids"][0][:-1]]},
    "no token count beside its blocks": lambda p: {"remote_num_tokens": 0},
    "a KV-cache group more than the decode has": lambda p: {"remote_block_ids": [p["remote_block_ids"][0]] * 2},
    "a prompt digest that is not one": lambda p: {"kvcompose_prompt": 5},
}
#: Prompts other than the one a prefill computed (``a``, 200 tokens), each offered with fresh,
#: unaltered params for ``a`` (issue 60): (attack, the prompt's name in :func:`prompt_variants`).
PROMPT_ATTACKS: tuple[tuple[str, str], ...] = (
    ("prompt: a's params, a + 10 tokens (as many blocks)", "a+10"),
    ("prompt: a's params, a + 40 tokens", "a+40"),
    ("prompt: a's params, a + 100 tokens", "a+100"),
    ("prompt: a's params, a cut short by 30 tokens", "a-30"),
    ("prompt: a's params, a with token 100 changed", "a~100"),
    ("prompt: a's params, a with token 196 (last block) changed", "a~196"),
    ("prompt: a's params with prompt b (as long)", "b"),
)
#: The prompt attack sent after a plain request for :data:`CACHED_PREFIX`'s prompt, the first
#: :data:`CACHED_BLOCKS` blocks of ``a+40``, so that the decode's own prefix cache holds them.
CACHED_ATTACK = ("prompt: a's params, a + 40 tokens, 7 blocks in the decode's prefix cache", "a+40")
CACHED_PREFIX = "a+40, first 7 blocks"
CACHED_BLOCKS = 7
#: Frames to the prefill's side channel: they must be dropped, the listener answering on.
GARBAGE_FRAMES: dict[str, bytes] = {
    "bad msgpack": b"\xc1\x00\x00",
    "100 KB frame": b"\x00" * 100_000,
    "unknown message": msgspec.msgpack.encode((b"give me all", 0, 0)),
    "a rank it does not serve": msgspec.msgpack.encode((b"get_meta_msg", 7, 7)),
}
#: vLLM's request for the side channel's answer (``GET_META_MSG``, rank 0).
GET_META = msgspec.msgpack.encode((b"get_meta_msg", 0, 0))
#: NIXL notifications to the prefill from an agent it never loaded: vLLM's worker parses the
#: first two unguarded; the rest are kvcompose's lease protocol without the key.
NOTIFICATIONS: dict[str, bytes] = {
    "not utf-8": b"\xff\xfe:1",
    "no colon": b"no-colon-here",
    "an unknown kvcompose kind": b"kvcompose:steal!:",
    "a lease hello in clear": b"kvcompose:hello:",  # + the attacker's own agent metadata
    "a lease question without a MAC": b"kvcompose:lease?" + msgspec.msgpack.encode((1, ["x"])),
    "a lease question of 10,000 ids": b"kvcompose:lease?"
    + msgspec.msgpack.encode((2, [str(i) for i in range(10_000)])),
}


def prompt_variants(a: list[int], block_size: int) -> dict[str, list[int]]:
    """The prompts :data:`PROMPT_ATTACKS` send instead of ``a``, by name: ``a`` with 10, 40 and 100
    tokens more, 30 fewer, token 100 or token 196 changed, and :data:`CACHED_PREFIX`."""
    more = token_prompt(len(a) + 1000, 100)
    variants = {
        "a+10": a + more[:10],
        "a+40": a + more[:40],
        "a+100": a + more,
        "a-30": a[:-30],
        "a~100": _changed(a, 100),
        "a~196": _changed(a, 196),
    }
    variants[CACHED_PREFIX] = variants["a+40"][: CACHED_BLOCKS * block_size]
    return variants


def _changed(prompt: list[int], at: int) -> list[int]:
    """``prompt`` with the token at ``at`` another (in :func:`token_prompt`'s range, [3, 500))."""
    out = list(prompt)
    out[at] = 3 + (out[at] - 3 + 1) % 497
    return out


class Plan(msgspec.Struct):
    """What the attacker reaches and asks: the servers' URLs, the prefill's side channel, the
    address it listens on itself, the prompts (token ids by name: ``a``, ``b``, ``c``,
    ``replay``, ``after`` and :func:`prompt_variants`), optionally the digests of prompts (by
    name: ``kvcompose_nixl.trust.prompt_digest``, unkeyed: any client computes them; the kit's
    tools import no plugin) and a prefill's NIXL agent metadata (hex)."""

    prefill_url: str
    decode_url: str
    side_channel: tuple[str, int]
    own_address: str
    prompts: dict[str, list[int]]
    max_tokens: int = 16
    #: seconds past a lease's end the decode allows for clock skew (``Policy.clock_skew_s``)
    clock_skew_s: float = 10.0
    digests: dict[str, str] = {}
    leaked_agent: str | None = None


class Outcome(msgspec.Struct):
    """One attack: what the decode answered (``status`` ``answered`` or why not), its tokens,
    and the decode's counters across it; for side-channel and NIXL attacks, what came back."""

    attack: str
    prompt: str | None = None
    status: str = "answered"
    token_ids: list[int] = []
    logprobs: list[float] = []
    refused: dict[str, int] = {}
    pulled_tokens: int = 0
    nixl_bytes: int = 0
    #: prompt tokens the decode computed itself (the rest its prefix cache or a connector held)
    computed_tokens: int = 0
    connections: int = 0
    answer: str | None = None


class Listener:
    """A TCP port the attacker names as a prefill's side channel: counts connections."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port: int = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@contextmanager
def listening(host: str) -> Iterator[Listener]:
    listener = Listener(host)
    try:
        yield listener
    finally:
        listener.close()


def side_channel_answer(host: str, port: int, frame: bytes, wait_s: float) -> bytes | None:
    """The first part of what the NIXL side channel at ``host:port`` answers to ``frame``
    (vLLM's protocol: a ROUTER answering ``[payload, perf_counter]``), or None in ``wait_s``."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([b"", frame])
        if not sock.poll(int(wait_s * 1000)):
            return None
        return bytes(sock.recv_multipart()[1])
    finally:
        sock.close()


def decode_attacks(
    params: dict[str, Any], own: tuple[str, int], digests: dict[str, str]
) -> list[tuple[str, str, dict[str, Any]]]:
    """(attack, prompt, params) offered to the decode, from the real ``params`` the prefill
    returned for prompt ``a`` (which the decode already read once); ``own``: the attacker's
    listening address; ``digests``: :attr:`Plan.digests` (with ``b``'s, a's params are offered
    for ``b`` re-stamped with it)."""
    blocks = params["remote_block_ids"]
    unsigned = {k: v for k, v in params.items() if not k.startswith("kvcompose_")}
    tokens = params["remote_num_tokens"]
    attacks = [
        ("its own side channel, its own params", "b", {
            "do_remote_prefill": True, "remote_engine_id": "attacker", "remote_request_id": "attacker-1",
            "remote_block_ids": [list(range(len(blocks[0])))], "remote_num_tokens": tokens,
            "remote_host": own[0], "remote_port": own[1],
        }),
        ("its own side channel in real params", "a", {**params, "remote_host": own[0], "remote_port": own[1]}),
        ("made-up block ids", "a", {**params, "remote_block_ids": [[b + 1 for b in blocks[0]]]}),
        ("real params unsigned", "a", unsigned),
        ("a forged signature", "a", {**params, "kvcompose_sig": "0" * len(str(params.get("kvcompose_sig", "")))}),
    ]  # fmt: skip
    if "b" in digests:
        attacks.append(("a's params, the digest of prompt b", "b", {**params, "kvcompose_prompt": digests["b"]}))
    attacks += [(f"malformed: {name}", "a", {**params, **fields}) for name, fields in MALFORMED.items()]
    attacks += [(f"malformed: {name}", "a", {**params, **fit(params)}) for name, fit in MISFITS.items()]
    return attacks


def refusals(counters: dict[str, float]) -> dict[str, int]:
    """The decode's refusals by reason, from a counter delta."""
    out: dict[str, int] = {}
    for key, n in counters.items():
        if key.startswith(REFUSED) and (m := _REASON.search(key)):
            out[m.group(1)] = out.get(m.group(1), 0) + int(n)
    return out


def offer(decode: ServerClient, attack: str, prompt: str, plan: Plan, params: dict[str, Any] | None) -> Outcome:
    """``params`` with prompt ``prompt`` to the decode, and what it did."""
    try:
        s = decode_request(decode, plan.prompts[prompt], plan.max_tokens, params)
    except Exception as exc:  # an HTTP 500 or a dead engine: the outcome says so
        return Outcome(attack, prompt, status=f"failed: {str(exc)[:200]}")
    return Outcome(
        attack,
        prompt,
        token_ids=s.token_ids,
        logprobs=s.logprobs,
        refused=refusals(s.counters),
        pulled_tokens=s.loaded.get("pd", 0),
        nixl_bytes=s.nixl_bytes,
        computed_tokens=s.computed_tokens,
    )


def prefilled(prefill: ServerClient, prompt: list[int]) -> dict[str, Any]:
    """The params the prefill returns for ``prompt`` (vLLM's proxy's first leg)."""
    (p,) = prefill.generate([prompt], 1, [{"do_remote_decode": True}])
    return dict(p["kv_transfer_params"])


def run(plan: Plan) -> list[Outcome]:
    """Every attack, in order; the pair's legitimate requests between them show it serves on."""
    prefill, decode = ServerClient.at(plan.prefill_url), ServerClient.at(plan.decode_url)
    outcomes: list[Outcome] = []
    host, port = plan.side_channel
    # The side channel first: a decode that handshakes after it (the first pull below) must still.
    for name, frame in GARBAGE_FRAMES.items():
        got = side_channel_answer(host, port, frame, wait_s=0.5)
        outcomes.append(Outcome(f"side channel: {name}", status="sent", answer=_shown(got)))
    got = side_channel_answer(host, port, GET_META, wait_s=5)
    outcomes.append(Outcome("side channel: vLLM's request after them", status="sent", answer=_shown(got)))
    # The control: a's params, unaltered, with a's prompt pass every check and are pulled; each
    # attack below alters one thing (the decode refuses them before it would see the replay).
    params = prefilled(prefill, plan.prompts["a"])
    outcomes.append(offer(decode, "legitimate: a's own params (the control)", "a", plan, params))
    with listening(plan.own_address) as listener:
        for attack, prompt, offered in decode_attacks(params, (plan.own_address, listener.port), plan.digests):
            outcome = offer(decode, attack, prompt, plan, offered)
            outcome.connections = listener.connections
            outcomes.append(outcome)
        # Another prompt than the one the prefill computed, with params fresh from the prefill
        # (signed, unexpired, unread): only the prompt check refuses them; the decode's prefix
        # cache empty, or holding the prompt's first blocks.
        for attack, prompt in (*PROMPT_ATTACKS, CACHED_ATTACK):
            drop_prefix_cache(decode)
            if (attack, prompt) == CACHED_ATTACK:
                outcomes.append(offer(decode, f"plain: {CACHED_PREFIX}", CACHED_PREFIX, plan, None))
            outcome = offer(decode, attack, prompt, plan, prefilled(prefill, plan.prompts["a"]))
            outcome.connections = listener.connections
            outcomes.append(outcome)
    if plan.leaked_agent is not None:
        outcomes += notify(bytes.fromhex(plan.leaked_agent))
    replayed = prefilled(prefill, plan.prompts["replay"])
    outcomes.append(offer(decode, "legitimate: replay's own params", "replay", plan, replayed))
    drop_prefix_cache(decode)  # a replay must ask for the prompt's KV again
    outcomes.append(offer(decode, "replay of replay's params", "replay", plan, replayed))
    _sleep_until(float(replayed.get("kvcompose_expires", time.time())) + plan.clock_skew_s + 1)
    drop_prefix_cache(decode)
    outcomes.append(offer(decode, "replay after the lease", "replay", plan, replayed))
    after = prefilled(prefill, plan.prompts["after"])
    outcomes.append(offer(decode, "legitimate: a new prompt, pulled", "after", plan, after))
    return outcomes


def notify(leaked: bytes, wait_s: float = 3.0) -> list[Outcome]:
    """:data:`NOTIFICATIONS` to the prefill whose agent metadata leaked, from a NIXL agent it
    never loaded; then listen ``wait_s`` for any answer."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("kvcompose-attacker", nixl_agent_config(backends=["UCX"]))
    prefill = agent.add_remote_agent(leaked)
    outcomes = []
    for name, msg in NOTIFICATIONS.items():
        if msg.endswith(b"hello:"):
            msg += agent.get_agent_metadata()
        agent.send_notif(prefill, msg)
        outcomes.append(Outcome(f"NIXL notification: {name}", status="sent"))
    answers: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        for sender, msgs in agent.get_new_notifs().items():
            answers.setdefault(str(sender), []).extend(msgs)
        time.sleep(0.05)
    outcomes.append(Outcome("NIXL notification: answers received", status="sent", answer=repr(answers)[:200]))
    return outcomes


def _shown(got: bytes | None) -> str | None:
    """What a side channel answered, in hex (the caller, with the plugin, tells whether the
    agent metadata in it is sealed)."""
    return None if got is None else got.hex()


def _sleep_until(t: float, most_s: float = 120.0) -> None:
    time.sleep(min(max(0.0, t - time.time()), most_s))


def main(argv: list[str], out: Callable[[str], Any] = print) -> int:
    """``PLAN.json`` -> the outcomes as JSON on stdout."""
    if len(argv) != 1:
        print("usage: python -m kvcompose_tools.e2e.attacks PLAN.json", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        plan = msgspec.json.decode(f.read(), type=Plan)
    out(msgspec.json.encode(run(plan)).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
