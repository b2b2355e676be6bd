"""Engine-shaped configs and KV caches on CPU: the kit's one vLLM-config, KV-cache-config and KV-tensor builder.

vLLM's own code does the work: ``get_kv_cache_config_from_groups`` places the layers in one
backing allocation and ``allocate_kv_cache`` makes the per-layer views the model runner hands to
a connector's ``register_kv_caches``. So a worker under test sees exactly what it sees inside an
engine. The defaults follow the kit's tiny Llama config (2 KV heads of 32, float32) and the
layout of vLLM's CPU attention backend (``LBHNC``, the only one it supports).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

#: The kit's model: a tiny Llama ``config.json`` only (no weights, no tokenizer, no download).
TINY_MODEL = Path(__file__).parent / "data" / "tiny-llama"

#: The layout vLLM's CPU attention backend supports (``CPUAttentionBackend.supported_kv_cache_layouts``).
CPU_LAYOUT = "LBHNC"


def layer_name(i: int) -> str:
    """The name vLLM gives attention layer ``i`` of a Llama model."""
    return f"model.layers.{i}.self_attn.attn"


@dataclass
class EngineKV:
    """A KV cache config, its per-layer CPU tensors (empty when not allocated), and its config."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, torch.Tensor]

    @property
    def layer_names(self) -> list[str]:
        """Every attention layer, in the order of the KV cache groups (the forward order)."""
        return [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names]

    @property
    def raw(self) -> torch.Tensor:
        """The one backing allocation all layers live in, as bytes."""
        first = next(iter(self.kv_caches.values()))
        return torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        """A copy of one layer's block, as the attention kernels see it."""
        return self.kv_caches[layer][block_id].clone()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every layer, to compare against after a transfer."""
        return {name: view.clone() for name, view in self.kv_caches.items()}


def make_vllm_config(
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None,
    *,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 2048,
    disable_hybrid_kv_cache_manager: bool | None = None,
    model: str | Path = TINY_MODEL,
    data_parallel_index: int = 0,
    kv_events_config: dict[str, Any] | None = None,
) -> VllmConfig:
    """A ``VllmConfig`` for the CPU platform around a local model config (no download).

    ``data_parallel_index`` is the data-parallel rank this engine is (connectors offset their
    ports by it), set as the engine core sets it before it builds the scheduler.
    ``kv_events_config``: vLLM's ``KVEventsConfig`` as keywords (the engine publishes KV events;
    ``{"enable_kv_cache_events": True, "publisher": "null"}`` has the scheduler build them and
    hand them to a publisher that drops them, which a test can replace).
    """
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    ktc = KVTransferConfig(**kv_transfer_config) if isinstance(kv_transfer_config, dict) else kv_transfer_config
    model_config = ModelConfig(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = 0
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
        **({"kv_events_config": KVEventsConfig(**kv_events_config)} if kv_events_config is not None else {}),
    )
    config.parallel_config.data_parallel_index = data_parallel_index
    return config


def make_engine_kv(
    *,
    num_layers: int = 2,
    block_size: int = 16,
    num_blocks: int = 24,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: torch.dtype = torch.float32,
    layout: str = CPU_LAYOUT,
    sliding_window: int | None = None,
    kv_transfer_config: dict[str, Any] | None = None,
    vllm_config: VllmConfig | None = None,
    allocate: bool = True,
) -> EngineKV:
    """Lay out (and, with ``allocate``, allocate) a KV cache as an engine does.

    ``num_layers`` full-attention layers share one group; with ``sliding_window`` a second,
    sliding-window group of as many layers is overlaid on the same bytes (vLLM's hybrid
    allocator). ``vllm_config`` defaults to the kit's CPU config for ``kv_transfer_config``;
    its cache config receives the layout and block count, as the engine core records them.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from kvcompose.testing.versions import kv_cache_config_from_groups

    get_kv_cache_config_from_groups = kv_cache_config_from_groups()
    if num_layers < 1 or num_blocks < 2:
        raise ValueError(
            f"make_engine_kv: need num_layers >= 1 and num_blocks >= 2 "
            f"(block 0 is vLLM's null block), got {num_layers} and {num_blocks}"
        )
    if vllm_config is None:
        vllm_config = make_vllm_config(kv_transfer_config, block_size=block_size)
    cache = vllm_config.cache_config
    cache.kv_cache_layout = KVCacheLayout[layout].name
    cache.num_gpu_blocks_override = num_blocks
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    groups = [KVCacheGroupSpec([layer_name(i) for i in range(num_layers)], full)]
    if sliding_window is not None:
        swa = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=sliding_window,
        )
        groups.append(KVCacheGroupSpec([layer_name(num_layers + i) for i in range(num_layers)], swa))
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 40)
    assert kv_cache_config.num_blocks == num_blocks, (kv_cache_config.num_blocks, num_blocks)
    kv_cache_config.kv_cache_layout = cache.kv_cache_layout
    cache.num_gpu_blocks = num_blocks
    kv_caches = (
        allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], [block_size] * len(groups))
        if allocate
        else {}
    )
    return EngineKV(vllm_config, kv_cache_config, kv_caches)


def fill_random(kv: EngineKV, seed: int = 0) -> None:
    """Give every byte of the cache a seeded random value, so every block is distinct."""
    g = torch.Generator().manual_seed(seed)
    raw = kv.raw
    raw.copy_(torch.randint(-128, 128, raw.shape, dtype=torch.int8, generator=g))


def pattern_for(prefix: Sequence[int], nbytes: int) -> torch.Tensor:
    """Stand-in for a block's KV: bytes that depend on the whole token prefix, like real KV."""
    seed = int.from_bytes(hashlib.sha256(repr(tuple(prefix)).encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=g)
