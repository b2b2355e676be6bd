"""The demo model's tokenizer in a real server (marker ``engine``): text prompts and chat work, and
token-id prompts answer what they answered before the model had a tokenizer.

One baseline server (no connector) on the seed-0 demo model; its process group is killed on
teardown.
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import wait_all_ready
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec

pytestmark = pytest.mark.engine

MAX_TOKENS = 16
#: Greedy answers of the seed-0 model to random token-id prompts, recorded from an engine started
#: with ``skip_tokenizer_init=True`` (how engines ran before the tokenizer), same settings.
BEFORE = {
    (7, 100): [68, 74, 81, 54, 369, 169, 17, 466, 217, 219, 216, 49, 35, 379, 359, 276],
    (8, 40): [76, 39, 168, 57, 494, 347, 459, 61, 213, 47, 446, 119, 384, 124, 415, 79],
}
#: The first's logprobs (float32 on this machine's CPU).
BEFORE_LOGPROBS_7_100 = [
    -3.576491117477417, -3.228793144226074, -3.821014404296875, -3.681051015853882,
    -3.3150293827056885, -3.7789816856384277, -3.780320644378662, -3.7358264923095703,
    -3.222433090209961, -3.705531358718872, -4.186782360076904, -3.0879359245300293,
    -3.072181224822998, -3.4665229320526123, -3.4036526679992676, -3.8088479042053223,
]  # fmt: skip


def random_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


@pytest.fixture(scope="module")
def model() -> Path:
    return make_model(0)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[ServerNode]:
    with tempfile.TemporaryDirectory(prefix="kvcompose-e2e-tokenizer-") as tmp:
        node = ServerNode(EngineSpec("baseline", str(model)), Path(tmp))
        try:
            wait_all_ready([node])
            yield node
        finally:
            node.close()


def test_token_id_prompts_answer_as_before_the_tokenizer(server: ServerNode) -> None:
    for (seed, length), expected in BEFORE.items():
        (got,) = server.generate([random_prompt(seed, length)], MAX_TOKENS)
        assert got["token_ids"] == expected, (seed, length)
        if (seed, length) == (7, 100):
            assert got["logprobs"] == pytest.approx(BEFORE_LOGPROBS_7_100, abs=1e-4)


def test_token_id_answer_is_detokenized_lone_bytes_included(server: ServerNode, tokenizer: Any) -> None:
    # The answer holds byte tokens (ids 5..260) of UTF-8 lead bytes with no continuation: the
    # detokenizer writes replacement characters and the request still succeeds.
    answer = server.complete(random_prompt(7, 100), MAX_TOKENS, logprobs=1, return_token_ids=True)
    choice = answer["choices"][0]
    assert choice["token_ids"] == BEFORE[(7, 100)]
    assert isinstance(choice["text"], str) and "\ufffd" in choice["text"]
    assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert len(choice["logprobs"]["tokens"]) == MAX_TOKENS


def test_text_prompt_is_tokenized_by_the_models_tokenizer(server: ServerNode, tokenizer: Any) -> None:
    text = "Hello, how are you today? Tell me about the key and value cache."
    answer = server.complete(text, MAX_TOKENS, return_token_ids=True)
    choice = answer["choices"][0]
    ids = tokenizer(text)["input_ids"]
    assert choice["prompt_token_ids"] == ids and ids[0] == tokenizer.bos_token_id
    assert isinstance(choice["text"], str) and choice["text"]
    assert answer["usage"]["completion_tokens"] == len(choice["token_ids"]) > 0
    # The same prompt as token ids: the same answer.
    (by_ids,) = server.generate([ids], MAX_TOKENS)
    assert by_ids["token_ids"] == choice["token_ids"]


def test_chat_completion_uses_the_chat_template(server: ServerNode, tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "What does a prefill engine do?"},
    ]
    answer = server.chat(messages, MAX_TOKENS, return_token_ids=True)
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert answer["prompt_token_ids"] == expected
    assert answer["usage"]["prompt_tokens"] == len(expected)
    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert isinstance(message["content"], str) and message["content"]
    # A second turn carries the first answer in its history.
    turn_2 = [*messages, {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "More?"}]
    again = server.chat(turn_2, MAX_TOKENS, return_token_ids=True)
    assert again["prompt_token_ids"][: len(expected)] == expected
    assert isinstance(again["choices"][0]["message"]["content"], str)
