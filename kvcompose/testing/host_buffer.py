"""vLLM's NIXL host-buffer path (the TPU path) run on the CPU platform, and what the kit changes for it.

On an accelerator NIXL cannot register (TPU; also CUDA or XPU with ``kv_buffer_device: cpu``),
vLLM's NIXL worker stages KV in host buffers it allocates itself
(``initialize_host_xfer_buffer``) and registers those with NIXL instead of the KV cache. The
prefill side copies each saved request's blocks device -> host after the step's forward
(``save_kv_to_host``, from ``wait_for_save``), NIXL moves host buffer to host buffer, and the
decode side copies host -> device once a read is done (``sync_recved_kv_to_device``). Both copies
call the ``CopyBlocksOp`` the model runner hands over with ``set_host_xfer_buffer_ops``: vLLM's
``copy_kv_blocks``, which calls the platform's ``swap_out_blocks_to_host`` /
``insert_blocks_to_device`` per layer.

On vLLM 0.32's CPU platform the path is off, decided from one platform fact, and one platform
method is missing:

- ``nixl/base_worker.py:682,696-697``: ``self.device_type = current_platform.device_type``, then
  ``if self.device_type == "cpu": self.use_host_buffer = False``;
  ``nixl/base_scheduler.py:89-90``: the same for the scheduler half, which then never builds
  ``reqs_to_save`` (``_build_save_meta``, :496);
  ``nixl/base_worker.py:1213``: ``set_host_xfer_buffer_ops`` drops the op when ``device_type`` is
  ``"cpu"``.
- ``kv_connector/utils.py:235-241``: ``copy_kv_blocks`` takes
  ``current_platform.insert_blocks_to_device`` / ``swap_out_blocks_to_host``, which only the
  CUDA, ROCm and XPU platforms (and TPU's out-of-tree one) define. On the CPU platform vLLM's
  ``Platform.__getattr__`` (``platforms/interface.py:1296-1310``) logs "Current platform cpu does
  not have 'swap_out_blocks_to_host' attribute." and answers ``None``, and line 241 fails with
  ``TypeError: 'NoneType' object is not callable``.

:func:`host_buffer_platform` changes exactly those: while it is active, the three modules above
see :class:`HostBufferPlatform` as ``current_platform``, which is vLLM's CPU platform in every
attribute but ``device_type`` (``"tpu"``: the platform whose only NIXL buffer is the host one,
``_NIXL_SUPPORTED_DEVICE["tpu"] == ("cpu",)``) and the two block copies (the CUDA platform's
code, written out because ``vllm.platforms.cuda`` does not import without CUDA; tests pin the
text to vLLM's). Everything else runs unchanged: vLLM's NIXL worker and scheduler code (host
buffer allocation and registration, the save and receive paths, the side-channel handshake),
vLLM's ``copy_kv_blocks``, and NIXL itself.

What is simulated: the "device". The KV cache the worker is given is host memory that stands for
accelerator memory, so the device <-> host copies are host-to-host ``index`` copies here and the
timing of a real PCIe copy is not. The layouts, block ids, copy directions and bytes are real.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

#: The modules that read ``current_platform`` on the host-buffer path (see the module docstring).
PLATFORM_READERS = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
    "vllm.distributed.kv_transfer.kv_connector.utils",
)
#: The accelerator the stand-in platform claims to be.
DEVICE_TYPE = "tpu"


def insert_blocks_to_device(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    src_block_indices: torch.Tensor,
    dst_block_indices: torch.Tensor,
) -> None:
    """Copy blocks from src_cache to dst_cache on GPU."""
    _src_cache = src_cache[src_block_indices]
    dst_cache[dst_block_indices] = _src_cache.to(dst_cache.device)


def swap_out_blocks_to_host(
    src_cache: torch.Tensor,
    dst_cache: torch.Tensor,
    src_block_indices: torch.Tensor,
    dst_block_indices: torch.Tensor,
) -> None:
    """Copy blocks from GPU to host (CPU)."""
    _src_cache = src_cache[src_block_indices]
    dst_cache[dst_block_indices] = _src_cache.cpu()


class HostBufferPlatform:
    """vLLM's current platform, seen as an accelerator that stages NIXL transfers in host memory.

    Every attribute is the wrapped platform's except :data:`DEVICE_TYPE` and the two block copies.
    """

    device_type = DEVICE_TYPE
    insert_blocks_to_device = staticmethod(insert_blocks_to_device)
    swap_out_blocks_to_host = staticmethod(swap_out_blocks_to_host)

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def __repr__(self) -> str:
        return f"HostBufferPlatform({self._platform!r})"


# While any host_buffer_platform() block is open: how many, and vLLM's platform per module.
_users = 0
_originals: dict[str, Any] = {}


@contextmanager
def host_buffer_platform() -> Iterator[HostBufferPlatform]:
    """vLLM's NIXL host-buffer path on, in this process, for connectors built inside the block.

    Blocks may overlap (two harnesses of one test): the first installs the stand-in, the last
    to close restores vLLM's platform in the modules. A connector built inside keeps the decision
    it made (``use_host_buffer``) but reads the platform again when it copies, so keep the block
    open for the connector's whole life.
    """
    import importlib

    global _users
    modules = [importlib.import_module(name) for name in PLATFORM_READERS]
    if _users == 0:
        _originals.update({m.__name__: m.current_platform for m in modules})
        stand_in = HostBufferPlatform(_originals[PLATFORM_READERS[0]])
        for m in modules:
            m.current_platform = stand_in  # type: ignore[attr-defined]
    _users += 1
    try:
        yield modules[0].current_platform
    finally:
        _users -= 1
        if _users == 0:
            for m in modules:
                m.current_platform = _originals.pop(m.__name__)  # type: ignore[attr-defined]


def host_buffer_active() -> bool:
    """Whether a :func:`host_buffer_platform` block is open in this process."""
    return _users > 0


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
    """Wrap ``method`` on each of ``connectors`` (by name) (instance attribute): the returned list
    fills with the names of those it is called on, and each call goes on to the connector's own.

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
