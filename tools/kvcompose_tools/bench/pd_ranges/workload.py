"""Benchmark 5c's workload: seeded multi-turn conversations, and each request's twin."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvcompose_tools.e2e.spec import BLOCK_SIZE, MAX_MODEL_LEN

CONVERSATIONS = 8
TURNS = 4
#: A new user message's length in tokens, drawn per turn (inclusive). Four turns of at most
#: 200 tokens plus three answers stay under the engines' ``max_model_len`` (1024).
MESSAGE_TOKENS = (64, 200)
ANSWER_TOKENS = 16
SEED = 20260
#: Seeds of the twin requests' prompts (see :func:`twin_prompt`).
TWIN_SEED = 7_000_000

# ---------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """The conversations' new user messages (``messages[conversation][turn]``, token ids)."""

    messages: tuple[tuple[tuple[int, ...], ...], ...]
    answer_tokens: int = ANSWER_TOKENS

    @property
    def conversations(self) -> int:
        return len(self.messages)

    @property
    def turns(self) -> int:
        return len(self.messages[0])

    def order(self) -> list[tuple[int, int]]:
        """``(conversation, turn)`` in the order sent: turn 0 of every conversation, then turn 1, ..."""
        return [(c, t) for t in range(self.turns) for c in range(self.conversations)]

    def prompt(self, conversation: int, turn: int, answers: Mapping[tuple[int, int], Sequence[int]]) -> list[int]:
        """The prompt of ``turn``: every earlier message followed by its answer, then this turn's
        message. ``answers[(conversation, k)]`` must be there for every ``k < turn``."""
        out: list[int] = []
        for k in range(turn):
            out += self.messages[conversation][k]
            out += answers[(conversation, k)]
        return out + list(self.messages[conversation][turn])

    def longest_prompt(self) -> int:
        """The longest prompt any answers can make (every answer at its full length)."""
        return max(sum(map(len, m)) + (len(m) - 1) * self.answer_tokens for m in self.messages)

    def kv_blocks(self) -> int:
        """Blocks a tier needs to hold every conversation whole (last prompt and its answer)."""
        return sum(-(-(sum(map(len, m)) + len(m) * self.answer_tokens) // BLOCK_SIZE) for m in self.messages)


def make_workload(
    conversations: int = CONVERSATIONS,
    turns: int = TURNS,
    lengths: tuple[int, int] = MESSAGE_TOKENS,
    seed: int = SEED,
    answer_tokens: int = ANSWER_TOKENS,
    max_model_len: int = MAX_MODEL_LEN,
) -> Workload:
    """Seeded messages of mixed lengths (uniform in ``lengths``, inclusive); refuses a workload
    whose longest conversation would not fit ``max_model_len`` with its last answer."""
    from kvcompose_tools.e2e.flow import token_prompt

    rng = random.Random(seed)
    messages = tuple(
        tuple(tuple(token_prompt(rng.randrange(2**31), rng.randint(*lengths))) for _ in range(turns))
        for _ in range(conversations)
    )
    w = Workload(messages, answer_tokens)
    if w.longest_prompt() + answer_tokens > max_model_len:
        raise ValueError(
            f"the longest conversation reaches {w.longest_prompt()} prompt tokens + {answer_tokens} answer "
            f"tokens, over max_model_len {max_model_len}: fewer turns or shorter messages"
        )
    return w


def twin_prompt(conversation: int, turn: int, length: int) -> list[int]:
    """The twin of a workload request: a prompt of the same length that no tier has seen, so
    every composition pulls it whole over NIXL (the same for every composition and run)."""
    from kvcompose_tools.e2e.flow import token_prompt

    return token_prompt(TWIN_SEED + 1000 * conversation + turn, length)
