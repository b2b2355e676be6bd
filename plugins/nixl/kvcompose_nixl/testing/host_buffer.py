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

On vLLM 0.32's CPU platform the path is off, decided from one platform fact, and the two
platform methods its copy op calls are missing:

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
``_NIXL_SUPPORTED_DEVICE["tpu"] == ("cpu",)``) and the two block copies, which are the CUDA
platform's own functions compiled from vLLM's source (:func:`vllm_block_copies`: that module does
not import without CUDA). Everything else runs unchanged: vLLM's NIXL worker and scheduler code
(host buffer allocation and registration, the save and receive paths, the side-channel
handshake), vLLM's ``copy_kv_blocks``, and NIXL itself. ``plugins/nixl/tests/test_nixl_kit_host_buffer.py``
pins every line named here.

What is simulated: the "device". The KV cache the worker is given is host memory that stands for
accelerator memory, so the device <-> host copies are host-to-host ``index`` copies here and the
timing of a real PCIe copy is not. The layouts, block ids, copy directions and bytes are real.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvcompose.testing.copy_op import CopyLog

#: The modules that read ``current_platform`` on the host-buffer path (see the module docstring).
PLATFORM_READERS = (
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler",
    "vllm.distributed.kv_transfer.kv_connector.utils",
)
#: The accelerator the stand-in platform claims to be.
DEVICE_TYPE = "tpu"
#: The platform methods ``copy_kv_blocks`` calls, which the CPU platform lacks.
BLOCK_COPIES = ("insert_blocks_to_device", "swap_out_blocks_to_host")
#: The platform module they are taken from.
COPIES_FROM = "vllm.platforms.cuda"


def vllm_block_copies(module: str = COPIES_FROM, names: tuple[str, ...] = BLOCK_COPIES) -> dict[str, Any]:
    """The block copies of a vLLM platform, compiled from its source (the first parameter, the
    platform class, unbound).

    ``vllm.platforms.cuda`` does not import without CUDA (it loads ``vllm._C_stable_libtorch``),
    but its ``insert_blocks_to_device`` / ``swap_out_blocks_to_host`` are plain torch indexing,
    which runs on host tensors as it does on device ones. Compiled under the file's own name, so
    a traceback points into vLLM's source.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"host buffer: vLLM has no module {module} to take its block copies from")
    tree = ast.parse(Path(spec.origin).read_text(), spec.origin)
    found: dict[str, list[ast.FunctionDef]] = {name: [] for name in names}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in found:
            found[node.name].append(node)
    wrong = {name: len(defs) for name, defs in found.items() if len(defs) != 1}
    if wrong:
        raise RuntimeError(
            f"host buffer: expected one definition each of {list(names)} in {spec.origin}, found {wrong}; "
            "the kit's stand-in platform needs vLLM's block copies (kvcompose_nixl/testing/host_buffer.py)"
        )
    defs = [found[name][0] for name in names]
    for d in defs:
        d.decorator_list = []  # @classmethod: bound to the stand-in's class below
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=list(defs), type_ignores=[]), spec.origin, "exec"), namespace)
    return {name: namespace[name] for name in names}


class HostBufferPlatform:
    """vLLM's current platform, seen as an accelerator that stages NIXL transfers in host memory.

    Every attribute is the wrapped platform's except :data:`DEVICE_TYPE` and the block copies
    (:func:`vllm_block_copies`).
    """

    device_type = DEVICE_TYPE

    def __init__(self, platform: Any, copies: dict[str, Any]) -> None:
        self._platform = platform
        for name, fn in copies.items():
            setattr(self, name, fn.__get__(type(self)))  # as classmethods of this class

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
        stand_in = HostBufferPlatform(_originals[PLATFORM_READERS[0]], vllm_block_copies())
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


def host_buffer_setting() -> dict[str, Any]:
    """The :class:`~kvcompose.testing.worker.WorkerHarness` keywords that put vLLM's NIXL workers
    on the host-buffer path: ``WorkerHarness(cfg, **host_buffer_setting())``.

    The stand-in platform (:func:`host_buffer_platform`, open for the harness's life) and a
    :class:`~kvcompose.testing.copy_op.CopyLog` as the copy op; fresh ones on every call.
    """
    return {"platform": host_buffer_platform(), "copy_op": CopyLog()}
