"""Llama checkpoints with seeded random weights and a byte-level BPE tokenizer, made locally
(nothing is downloaded): :data:`MODELS` names them.

``tiny`` (hidden 128, 2 layers, 1 KiB of KV a token) is what the tests run: an engine starts fast
and a prompt costs microseconds a token. ``medium`` (hidden 512, 8 layers, 8 heads over 4 KV
heads, 16 KiB of KV a token, a 4,096-token context) is for the benchmarks that show time saved:
on this machine a token's prefill costs about 1.2 ms, so a conversation's history outweighs the
fixed cost of a request through the router and two engines (docs/e2e.md, "Two models").

vLLM's ``load_format="dummy"`` fills every tensor with U(-1e-3, 1e-3): the logits come out flat
and the output does not depend on the KV it attends to, so equal tokens would prove nothing.
These weights have realistic scales and peaked attention, so one changed token in the first
block changes the output, and two seeds give two models whose KV is not interchangeable.

The tokenizer (``tokenizer.json`` + ``tokenizer_config.json``, with a ChatML chat template) lets
servers start with a tokenizer, so text prompts and ``/v1/chat/completions`` work (vLLM's router
and OpenAI clients need them). It does not depend on the seed and does not touch the weights: a
seed gives the same tensors as before it existed. Its vocabulary is exactly the model's: 5 special
tokens (``<unk>``, ``<s>``, ``</s>`` at the ids config.json names, ``<|im_start|>``,
``<|im_end|>``), the 256 bytes, and BPE merges learnt from :data:`CORPUS` up to ``vocab_size``, so
any text encodes to ids below it and every id decodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib.util import find_spec
from pathlib import Path

#: The shipped config (hidden 128, 2 layers, 4 heads, 2 KV heads, vocab 512): the test kit's data,
#: which stays in kvcompose (found without importing the kit).
TINY_CONFIG = Path(find_spec("kvcompose.testing").origin).parent / "data" / "tiny-llama" / "config.json"
#: The medium model's config, kept with the tools (the tests never run it).
MEDIUM_CONFIG = Path(__file__).parent / "data" / "medium-llama" / "config.json"
#: The models by the name ``--model`` takes.
MODELS = {"tiny": TINY_CONFIG, "medium": MEDIUM_CONFIG}
#: How far an answer's logprobs may be from a single engine's when its prompt's KV was computed in
#: other batches (P/D, a host tier): the tiny model's are bit for bit the same; the medium model's
#: differ in float32's last bits (measured: up to 3.6e-5 on the demo's prompts, token ids equal).
LOGPROB_TOLERANCE = {"tiny": 0.0, "medium": 1e-3}
#: Larger q/k weights make attention peaked rather than a near-uniform average over the prompt.
ATTN_GAIN = 3.0
WEIGHTS = "model.safetensors"
STAMP = "kvcompose-model.json"
#: Bumped whenever what :func:`make_model` writes changes (2: the tokenizer), so that cached
#: models are made again, in a directory of their own (engines may be reading the old one).
VERSION = 2
#: Special tokens, in id order; config.json's ``bos_token_id``/``eos_token_id`` must be 1 and 2.
UNK, BOS, EOS, IM_START, IM_END = SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
#: ChatML, opened by ``<s>`` (what the tokenizer adds to a plain prompt, too).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: The text the BPE merges are learnt from (fixed: the same tokenizer everywhere, every time).
CORPUS = """\
A tiny model with a real tokenizer: prefill and decode engines share the key and value cache of a
prompt over the network, and a host tier keeps the blocks that the device cache has to drop. When
the next turn of a conversation arrives, the router sends it to the instance that holds its prefix,
which loads what it can from memory and computes only the new tokens. Every request is checked
against a single engine that computed everything itself: the same tokens, the same probabilities.
The quick brown fox jumps over the lazy dog; then it sleeps in the sun, because the day is warm.
Users ask questions, assistants answer them, and systems tell both what they should and should not
do. Hello, how are you today? I am fine, thank you for asking. What is the weather like where you
live? It is cold and raining here, so I will stay inside and read a book about distributed systems.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2048 appear in logs, ports and sizes.
"""


def work_dir() -> Path:
    """Where made models are cached: ``$KVCOMPOSE_WORK_DIR`` or ``~/.cache/kvcompose``."""
    env = os.environ.get("KVCOMPOSE_WORK_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvcompose"


def _recipe(config_text: str, seed: int) -> dict[str, object]:
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    return {"config_sha256": digest, "seed": seed, "attn_gain": ATTN_GAIN, "version": VERSION}


def model_config(name: str) -> Path:
    """The config of the model :data:`MODELS` calls ``name``; a clear error for another name."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}") from None


def make_model(seed: int = 0, root: Path | None = None, config: Path = TINY_CONFIG) -> Path:
    """The model directory for ``seed`` (``config.json``, ``model.safetensors`` (1.7 MB tiny, 96
    MB medium) and the tokenizer files), named after the config's folder (``tiny-llama``, ...).

    Made once under ``root`` (default :func:`work_dir`) and reused while the config and recipe
    are unchanged; written to a temporary directory and renamed, so concurrent makers never see
    half a checkpoint.
    """
    text = config.read_text()
    recipe = _recipe(text, seed)
    base = (root or work_dir()) / "models"
    path = base / f"{config.parent.name}-seed{seed}-v{VERSION}-{recipe['config_sha256']}"
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=base))
    try:
        cfg = json.loads(text)
        _write(tmp, cfg, seed)
        write_tokenizer(tmp, cfg)
        (tmp / "config.json").write_text(text)
        (tmp / STAMP).write_text(json.dumps(recipe))
        try:
            tmp.rename(path)
        except OSError:  # another maker won the race, or a stale copy: keep one complete copy
            if not (stamp.exists() and json.loads(stamp.read_text()) == recipe):
                shutil.rmtree(path, ignore_errors=True)
                tmp.rename(path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write(path: Path, cfg: dict[str, object], seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    hidden, inter, vocab = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    head_dim = hidden // int(cfg["num_attention_heads"])
    kv_dim = int(cfg["num_key_value_heads"]) * head_dim
    g = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations O(1) through the layers.
        return torch.randn(out_f, in_f, generator=g) * (gain / in_f**0.5)

    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": linear(vocab, hidden),
    }
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": linear(hidden, hidden, ATTN_GAIN),
            p + "self_attn.k_proj.weight": linear(kv_dim, hidden, ATTN_GAIN),
            p + "self_attn.v_proj.weight": linear(kv_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, hidden),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / WEIGHTS))


def write_tokenizer(path: Path, cfg: dict[str, object]) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` for a model of config ``cfg`` in ``path``.

    Byte-level BPE (GPT-2's byte-to-character map and pre-tokenizer, so any text encodes and any
    id sequence decodes, invalid UTF-8 as U+FFFD); a plain prompt gets ``<s>`` in front.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab_size = int(cfg["vocab_size"])
    for name, token in (("bos_token_id", BOS), ("eos_token_id", EOS)):
        if cfg.get(name) != SPECIAL_TOKENS.index(token):
            raise ValueError(
                f"config.json: {name} is {cfg.get(name)}, the tokenizer has {token} at {SPECIAL_TOKENS.index(token)}"
            )
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in _byte_chars():
        vocab[char] = len(vocab)
    merges = _learn_merges([word for word, _ in pre.pre_tokenize_str(CORPUS)], vocab_size - len(vocab))
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"tokenizer: {len(vocab)} tokens, the model has {vocab_size} (the corpus is too short)")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS))]
    )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": UNK,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(cfg["max_position_embeddings"]),
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _byte_chars() -> list[str]:
    """GPT-2's printable character for each byte 0..255 (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + len(chars) - len(printable)
    return [chr(chars[b]) for b in range(256)]


def _learn_merges(words: list[str], n: int) -> list[tuple[str, str]]:
    """Up to ``n`` BPE merges over ``words``: the most frequent adjacent pair each time, ties by the
    pair's text (deterministic, whatever the ``tokenizers`` version)."""
    seqs: dict[tuple[str, ...], int] = {}
    for word in words:
        seqs[tuple(word)] = seqs.get(tuple(word), 0) + 1
    merges: list[tuple[str, str]] = []
    while len(merges) < n:
        pairs: dict[tuple[str, str], int] = {}
        for seq, count in seqs.items():
            for pair in zip(seq, seq[1:]):
                pairs[pair] = pairs.get(pair, 0) + count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for seq, count in seqs.items():
            out: list[str] = []
            i = 0
            while i < len(seq):
                if seq[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + count
        seqs = merged
    return merges


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """KV bytes one token occupies: layers x (K, V) x KV heads x head dim x dtype size."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes
