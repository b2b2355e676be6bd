"""Engine-shaped KV caches on CPU for the cpu-offload tests.

The caches are built by vLLM's own code (``get_kv_cache_config_from_groups`` places the layers,
``allocate_kv_cache`` makes the per-layer views the model runner hands to a connector), so the
worker under test sees exactly what it sees inside an engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvcompose.testing.harness import make_vllm_config


@dataclass
class EngineKV:
    """A KV cache config, the per-layer views, and the config they were made for."""

    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, torch.Tensor]

    @property
    def raw(self) -> torch.Tensor:
        """The one backing allocation all layers live in, as bytes."""
        first = next(iter(self.kv_caches.values()))
        return torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())

    def block(self, layer: str, block_id: int) -> torch.Tensor:
        """A copy of one layer's block, as the attention kernels see it."""
        return self.kv_caches[layer][block_id].clone()


def make_engine_kv(
    *,
    num_layers: int = 2,
    block_size: int = 16,
    num_blocks: int = 24,
    num_kv_heads: int = 2,
    head_size: int = 32,
    dtype: torch.dtype = torch.float32,
    layout: str = "LBNHC",
    sliding_window: int | None = None,
    kv_transfer_config: dict | None = None,
) -> EngineKV:
    """Lay out and allocate a KV cache the way an engine does, for ``num_blocks`` blocks.

    With ``sliding_window`` the model gets a second (sliding-window) group of the same number
    of layers; vLLM overlays the groups on the same bytes.
    """
    vllm_config = make_vllm_config(kv_transfer_config, block_size=block_size)
    vllm_config.cache_config.kv_cache_layout = layout
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype
    )
    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn" for i in range(num_layers)], full)]
    if sliding_window is not None:
        swa = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            sliding_window=sliding_window,
        )
        groups.append(
            KVCacheGroupSpec(
                [f"model.layers.{num_layers + i}.attn" for i in range(num_layers)], swa
            )
        )
    kv_cache_config = get_kv_cache_config_from_groups(vllm_config, groups, 1 << 34)
    assert kv_cache_config.num_blocks == num_blocks
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    kv_caches = allocate_kv_cache(
        kv_cache_config,
        torch.device("cpu"),
        KVCacheLayout[layout],
        [block_size] * len(groups),
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
