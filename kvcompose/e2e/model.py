"""A tiny Llama checkpoint with seeded random weights, made locally (nothing is downloaded).

vLLM's ``load_format="dummy"`` fills every tensor with U(-1e-3, 1e-3): the logits come out flat
and the output does not depend on the KV it attends to, so equal tokens would prove nothing.
These weights have realistic scales and peaked attention, so one changed token in the first
block changes the output, and two seeds give two models whose KV is not interchangeable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

#: The shipped config (hidden 128, 2 layers, 4 heads, 2 KV heads, vocab 512).
TINY_CONFIG = Path(__file__).resolve().parent.parent / "testing" / "data" / "tiny-llama" / "config.json"
#: Larger q/k weights make attention peaked rather than a near-uniform average over the prompt.
ATTN_GAIN = 3.0
WEIGHTS = "model.safetensors"
STAMP = "kvcompose-model.json"


def work_dir() -> Path:
    """Where made models are cached: ``$KVCOMPOSE_WORK_DIR`` or ``~/.cache/kvcompose``."""
    env = os.environ.get("KVCOMPOSE_WORK_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvcompose"


def _recipe(config_text: str, seed: int) -> dict[str, object]:
    digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    return {"config_sha256": digest, "seed": seed, "attn_gain": ATTN_GAIN, "version": 1}


def make_model(seed: int = 0, root: Path | None = None, config: Path = TINY_CONFIG) -> Path:
    """The model directory for ``seed`` (``config.json`` + ``model.safetensors``, ~1.7 MB).

    Made once under ``root`` (default :func:`work_dir`) and reused while the config and recipe
    are unchanged; written to a temporary directory and renamed, so concurrent makers never see
    half a checkpoint.
    """
    text = config.read_text()
    recipe = _recipe(text, seed)
    base = (root or work_dir()) / "models"
    path = base / f"tiny-llama-seed{seed}-{recipe['config_sha256']}"
    stamp = path / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return path
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=base))
    try:
        _write(tmp, json.loads(text), seed)
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


def kv_bytes_per_token(model: Path, dtype_bytes: int = 4) -> int:
    """KV bytes one token occupies: layers x (K, V) x KV heads x head dim x dtype size."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes
