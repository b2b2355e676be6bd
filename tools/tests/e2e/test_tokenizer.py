"""The demo model's tokenizer, loaded the way vLLM loads it (``AutoTokenizer``); no engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompose_tools.e2e import model as demo_model
from kvcompose_tools.e2e.model import EOS, IM_END, IM_START, make_model, write_tokenizer

TEXTS = [
    "Hello, how are you today?",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "Ünïcödé: 日本語, emoji 🙂🚀, math ∑∫ and a NUL \x00 byte",
    "",
]


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(0, root=tmp_path_factory.mktemp("work"))


@pytest.fixture(scope="module")
def tokenizer(made: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(made))


def test_model_dir_has_tokenizer_and_a_versioned_name(made: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (made / name).is_file(), name
    assert f"-v{demo_model.VERSION}-" in made.name
    assert json.loads((made / demo_model.STAMP).read_text())["version"] == demo_model.VERSION
    assert make_model(0, root=made.parent.parent) == made  # reused, not made again
    assert made.name.startswith("tiny-llama-seed0-")


def test_the_medium_model_is_the_tiny_ones_recipe_at_its_size() -> None:
    """``--model medium`` (the benchmarks of time saved): 16 KiB of KV a token, a 4,096-token
    context, the same tokenizer and special ids (a config only; making it writes 96 MB)."""
    tiny = json.loads(demo_model.model_config("tiny").read_text())
    medium = json.loads(demo_model.model_config("medium").read_text())
    sizes = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"}
    assert {k for k in tiny if tiny[k] != medium[k]} == sizes | {"max_position_embeddings"}
    layers, kv_heads = medium["num_hidden_layers"], medium["num_key_value_heads"]
    head_dim = medium["hidden_size"] // medium["num_attention_heads"]
    assert layers * 2 * kv_heads * head_dim * 4 == 16 * 1024  # float32 K and V
    assert medium["max_position_embeddings"] >= 4096
    with pytest.raises(ValueError, match="unknown model 'huge'; choose from tiny, medium"):
        demo_model.model_config("huge")


def test_vocabulary_is_the_models_and_special_ids_match_config(made: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg = json.loads((made / "config.json").read_text())
    assert len(tokenizer) == cfg["vocab_size"] == 512
    assert sorted(tokenizer.get_vocab().values()) == list(range(cfg["vocab_size"]))
    assert tokenizer.bos_token_id == cfg["bos_token_id"]
    assert tokenizer.eos_token_id == cfg["eos_token_id"]
    assert tokenizer.eos_token == EOS


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_with_ids_under_the_vocabulary(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # a plain prompt starts with <s>, as Llama's do
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_merges_shorten_english(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "the key and value cache of the prompt"
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) < len(text.encode()) / 2


def test_every_id_decodes_even_lone_bytes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = tokenizer.decode(list(range(512)), skip_special_tokens=True)
    assert isinstance(text, str) and "\ufffd" in text  # bytes >= 0x80 alone: replacement characters
    for i in range(512):
        assert isinstance(tokenizer.decode([i]), str)


def test_chat_template_renders_chatml(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello?<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nWhat is a KV cache?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    vocab = tokenizer.get_vocab()
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(vocab[IM_START]) == 5 and ids.count(vocab[IM_END]) == 4
    assert all(0 <= i < 512 for i in ids)


def test_tokenizer_is_deterministic_and_independent_of_the_seed(tmp_path: Path, made: Path) -> None:
    cfg = json.loads((made / "config.json").read_text())
    write_tokenizer(tmp_path, cfg)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (made / name).read_bytes(), name


def test_config_with_other_special_ids_is_refused(tmp_path: Path, made: Path) -> None:
    cfg = json.loads((made / "config.json").read_text()) | {"eos_token_id": 7}
    with pytest.raises(ValueError, match="eos_token_id"):
        write_tokenizer(tmp_path, cfg)
