"""A multi-turn chat through the router, and the single-engine answers it must equal.

Each turn sends the whole history (system prompt, every earlier user message and reply) plus a
new user message to ``/v1/chat/completions``; the server renders it with the demo model's chat
template (ChatML). The reference is an offline engine given the same token ids, rendered here
with the model's own tokenizer (``transformers``' ``apply_chat_template``). The check is strict
and covers every step:

- the prompt decode rendered (the answer's ``prompt_token_ids``) equals the local rendering, so
  both engines were asked the same thing;
- the reply's token ids and logprobs equal the baseline's bit for bit (logprobs as the float32
  values the engine computed: :func:`~kvcompose_tools.e2e.flow.same_output`), and its text equals the
  baseline's, detokenized by vLLM's own detokenizer, so the next turn's history is the same text
  on both sides.

Bit-equal logprobs need the baseline to compute what decode computes, in the same shapes
(vLLM's CPU attention rounds a token's logits differently when it is computed in a batch over a
cached prefix than alone; see docs/e2e.md). Two choices give that:

- every turn's prompt is one past a block boundary (the user message is padded with words until
  it is): decode loads all of the prompt's KV and recomputes the last prompt token alone; the
  baseline, asked the turn a second time, finds every full block in its prefix cache and also
  computes that token alone. The second answer is the reference; the first (its new part
  computed in one batch) is kept to show the gap;
- the baseline is asked the turns in order, as prefill is, so the KV of the earlier turns that
  it reuses was computed the way prefill computed the KV that decode pulls. A reply of at most
  16 tokens after a prompt one past a boundary stays inside the prompt's last, partial block,
  so no block holding a reply's KV (computed token by token) is ever shared.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcompose_tools.e2e.flow import Answered, Router, Served, drop_prefix_cache, routed_chat
from kvcompose_tools.e2e.node import EngineNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE

SYSTEM = (
    "You are the assistant of a serving stack: a router sends each request to a prefill engine, "
    "then to a decode engine that pulls the key and value cache over the network, and a host tier "
    "keeps the blocks the device cache has to drop. Answer briefly and stay on topic."
)
#: A second conversation's system prompt (1P2D: one conversation per decode): words of its own, so
#: that no block of one conversation is a block of the other.
OTHER_SYSTEM = (
    "You answer questions about key and value caches for a team that runs many decode engines "
    "behind one router. Keep every answer short, concrete and friendly."
)
USER_TURNS = (
    "Hello, how are you today? Tell me what a prefill engine does.",
    "What is the weather like where you live? And what does the decode engine do?",
    "Thank you for asking. Which blocks come from host memory when the next turn arrives?",
)
#: What the padding appends, one at a time, until the rendered prompt is one past a block boundary:
#: a word that is one token of the demo vocabulary however often it repeats, so a block's worth of
#: tries always gets there.
FILLER = " and"


def load_tokenizer(model: str | Path) -> Any:
    """The demo model's tokenizer (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """``messages`` as the server renders them for ``/v1/chat/completions``: the chat template
    with the assistant's generation prompt, as token ids."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def padded(tokenizer: Any, history: list[dict[str, str]], text: str, max_words: int = BLOCK_SIZE) -> str:
    """``text`` with :data:`FILLER` appended until ``history`` + it renders one past a block
    boundary."""
    for _ in range(max_words):
        if len(render(tokenizer, [*history, {"role": "user", "content": text}])) % BLOCK_SIZE == 1:
            return text
        text += FILLER
    raise ValueError(f"no padding of {text[:40]!r} renders one past a block boundary")


@dataclass
class ChatTurn:
    """One turn of the scripted chat and the baseline's answers to it."""

    #: the request: the history, then this turn's (padded) user message
    messages: list[dict[str, str]]
    #: the messages rendered with the chat template
    prompt_ids: list[int]
    #: the baseline's answer computed the way decode computes it (asked a second time)
    expected: dict[str, Any]
    #: its first answer (the new part computed in one batch): the same tokens, logprobs may differ
    first: dict[str, Any]
    #: the reply's text, by vLLM's own detokenizer (the offline engine's, the server's code)
    text: str

    def problems(self, s: Served) -> list[str]:
        """How ``s`` (this turn through the router) differs from the baseline; empty: equal."""
        out = []
        if s.prompt_ids != self.prompt_ids:
            out.append("prompt rendered differently")
        if s.token_ids != self.expected["token_ids"]:
            out.append("token ids differ")
        elif not s.equals(self.expected):
            out.append("logprobs differ")
        if s.text != self.text:
            out.append(f"text {str(s.text)[:30]!r} differs from the baseline's {self.text[:30]!r}")
        return out


def baseline_chat(
    baseline: EngineNode,
    tokenizer: Any,
    max_tokens: int,
    system: str = SYSTEM,
    users: tuple[str, ...] = USER_TURNS,
) -> list[ChatTurn]:
    """The scripted chat on the offline ``baseline`` engine: each turn's padded request, its
    rendering, and the baseline's answers; each reply's text goes into the next turn's history."""
    history = [{"role": "system", "content": system}]
    turns = []
    for user in users:
        message = {"role": "user", "content": padded(tokenizer, history, user)}
        messages = [*history, message]
        ids = render(tokenizer, messages)
        first = baseline.generate([ids], max_tokens)[0]
        # Its last prompt token alone; the text as the server's detokenizer writes it (the
        # tokenizer's one-shot decode can differ from vLLM's incremental one).
        expected = baseline.generate([ids], max_tokens, detokenize=True)[0]
        turns.append(ChatTurn(messages, ids, expected, first, expected["text"]))
        history = [*messages, {"role": "assistant", "content": expected["text"]}]
    return turns


def chat_through_router(
    router: Router,
    decodes: Sequence[Answered],
    turns: list[ChatTurn],
    max_tokens: int,
    children: tuple[str, ...] = ("host", "pd"),
    session: str | None = None,
) -> Iterator[tuple[ChatTurn, Served]]:
    """The scripted chat through the router, turn by turn, as ``session`` (the router's
    ``consistent_hash`` key). The history is built from the router's own replies (only the user
    messages come from the script), so a reply that differs from the baseline's shows in the
    next turn's rendering too. Every decode's own prefix cache is dropped before every turn but
    the first, standing in for the traffic that would evict it: under ``load: ranges`` a later
    turn is then served by the host tier (the earlier turns' blocks decode stored) and NIXL (the
    rest, from prefill)."""
    history = turns[0].messages[:-1] if turns else []
    for i, turn in enumerate(turns):
        if i:
            for decode in decodes:
                drop_prefix_cache(decode)
        messages = [*history, turn.messages[-1]]
        label = f"chat {i + 1} ({len(turn.prompt_ids)})"
        s = routed_chat(router, decodes, messages, max_tokens, label=label, children=children, session=session)
        yield turn, s
        history = [*messages, {"role": "assistant", "content": s.text or ""}]
