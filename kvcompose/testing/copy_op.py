"""The copy op vLLM's model runner hands a connector (``set_host_xfer_buffer_ops``), logged.

vLLM's ``copy_kv_blocks`` moves blocks between the KV cache and a connector's host transfer
buffers; :class:`CopyLog` is that op counting what it copies, and :func:`record_receivers`
names the connectors it was handed to. ``WorkerHarness(copy_op=CopyLog())`` uses both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch


@dataclass(frozen=True)
class Copy:
    """One call of the host-buffer copy op."""

    direction: Literal["h2d", "d2h"]
    #: Block ids copied (source ids; vLLM's NIXL worker copies each block to the same id).
    blocks: tuple[int, ...]
    #: Bytes copied over every layer.
    nbytes: int


@dataclass
class CopyLog:
    """vLLM's ``copy_kv_blocks`` (the op the model runner hands over), counting what it copies.

    The copy itself is vLLM's; the log records each call, so a test can tell which blocks went
    device -> host on the prefill side and host -> device on the decode side.
    """

    copies: list[Copy] = field(default_factory=list)

    def __call__(
        self,
        src_kv_caches: dict[str, torch.Tensor],
        dst_kv_caches: dict[str, torch.Tensor],
        src_block_ids: list[int],
        dst_block_ids: list[int],
        direction: Literal["h2d", "d2h"],
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

        copy_kv_blocks(src_kv_caches, dst_kv_caches, src_block_ids, dst_block_ids, direction)
        per_block = sum(t[0].nbytes for t in src_kv_caches.values())
        self.copies.append(Copy(direction, tuple(src_block_ids), per_block * len(src_block_ids)))

    def blocks(self, direction: Literal["h2d", "d2h"]) -> list[int]:
        """Every block copied in ``direction``, in call order."""
        return [b for c in self.copies if c.direction == direction for b in c.blocks]

    def nbytes(self, direction: Literal["h2d", "d2h"]) -> int:
        return sum(c.nbytes for c in self.copies if c.direction == direction)


def record_receivers(connectors: dict[str, Any], method: str = "set_host_xfer_buffer_ops") -> list[str]:
    """Wrap ``method`` on each of ``connectors`` (name -> connector, as an instance attribute):
    the returned list fills with the names of those it is called on, and each call goes on to
    the connector's own method.

    The composite resolves a child's method when it first forwards that call, so wrap before it.
    """
    received: list[str] = []
    for name, child in connectors.items():
        own = getattr(child, method)

        def spy(*args: Any, _own: Any = own, _name: str = name, **kwargs: Any) -> Any:
            received.append(_name)
            return _own(*args, **kwargs)

        setattr(child, method, spy)
    return received
