"""The ``native-offload`` connector type: vLLM's own ``OffloadingConnector`` as a tier.

vLLM's native KV offloading (``--kv-offloading-backend native``; ``vllm/v1/kv_offload/``): a
host-memory tier with vLLM's manager and eviction policies (``lru``, ``arc``), optionally with a
file-system tier behind it (vLLM's ``TieringOffloadingSpec`` and its ``fs`` secondary tier). The
connector class is vLLM's, unchanged; the options pick vLLM's offloading spec through vLLM's own
extension point (``spec_name`` / ``spec_module_path``, ``vllm/v1/kv_offload/factory.py``): the
plugin's :mod:`kvcompose_cpu_offload.native` specs, which are vLLM's on CUDA and XPU and differ
elsewhere only in how the worker copies bytes (docs/native-offload.md). Nothing here imports
vLLM.

Example::

    connectors:
      - name: host
        type: native-offload
        options: {cpu_bytes: 4GiB, eviction: arc, disk_dir: /mnt/nvme/kv}
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from msgspec import Meta

from kvcompose.api import ByteSize, ConnectorType, Options, Problem, beyond_host_memory, format_size, given_options

if TYPE_CHECKING:
    from kvcompose.api import Child, Plan

PositiveInt = Annotated[int, Meta(gt=0)]

#: The module of the plugin's offloading specs, and their names (vLLM's factory imports them).
SPEC_MODULE = "kvcompose_cpu_offload.native"
CPU_SPEC = "PortableCPUOffloadingSpec"
TIERING_SPEC = "PortableTieringOffloadingSpec"


class NativeOffloadOptions(Options):
    """Options of a ``native-offload`` child; each maps to one key vLLM's offloading spec reads.

    A field left unset is not passed to vLLM, which then applies its own default.
    """

    cpu_bytes: Annotated[
        ByteSize,
        Meta(description="host memory for the whole server (cpu_bytes_to_use; vLLM requires it)"),
    ]
    eviction: Annotated[
        Literal["lru", "arc"] | None,
        Meta(description="which blocks leave host memory first (eviction_policy; vLLM's default is lru)"),
    ] = None
    block_size: Annotated[
        PositiveInt | None,
        Meta(
            description="tokens per offloaded block, a multiple of the engine's block size "
            "(block_size; vLLM's default is the engine's)"
        ),
    ] = None
    store_threshold: Annotated[
        PositiveInt | None,
        Meta(description="times a block must be offered before it is stored (store_threshold; 0: every time)"),
    ] = None
    prompt_only: Annotated[
        bool | None,
        Meta(description="store only prompt blocks, not generated ones (offload_prompt_only; vLLM's default true)"),
    ] = None
    disk_dir: Annotated[
        str | None,
        Meta(
            description="a file-system tier behind host memory: a directory for block files (vLLM's fs "
            "secondary tier, root_dir); instances on the same directory share what it holds"
        ),
    ] = None
    disk_threads: Annotated[
        PositiveInt | None,
        Meta(description="with disk_dir: read and write threads each (n_read_threads, n_write_threads; vLLM's 16)"),
    ] = None


class NativeOffloadType(ConnectorType):
    """The ``native-offload`` connector type: vLLM's ``OffloadingConnector``.

    It extends the prefix cache like ``cpu-offload``, with vLLM's native offloading code: its
    manager and eviction policies, its stores deferred to the next step, its stats and KV events,
    and optionally vLLM's file-system tier behind host memory. It never owns a handshake or
    request params.
    """

    name: ClassVar[str] = "native-offload"
    summary: ClassVar[str] = "prefix-cache tier in host memory, optionally a directory (vLLM OffloadingConnector)"
    options: ClassVar[type[Options]] = NativeOffloadOptions
    # vLLM's OffloadingConnector stores at the step's end; its per-layer hooks are empty.
    empty_calls: ClassVar[frozenset[str]] = frozenset({"wait_for_layer_load", "save_kv_layer"})
    vllm_connector: ClassVar[str] = "OffloadingConnector"
    extra_config_keys: ClassVar[Mapping[str, str]] = {
        "cpu_bytes": "cpu_bytes_to_use",
        "eviction": "eviction_policy",
        "block_size": "block_size",
        "store_threshold": "store_threshold",
        "prompt_only": "offload_prompt_only",
    }

    def vllm_config(self, child: Child) -> dict[str, Any]:
        """vLLM's class, the options under vLLM's keys, the plugin's spec, and the fs tier (a
        list of tier configs the key maps cannot express)."""
        cfg = super().vllm_config(child)
        opts = child.options_as(NativeOffloadOptions)
        extra = cfg["kv_connector_extra_config"]
        extra["spec_name"] = CPU_SPEC if opts.disk_dir is None else TIERING_SPEC
        extra["spec_module_path"] = SPEC_MODULE
        if opts.disk_dir is not None:
            tier: dict[str, Any] = {"type": "fs", "root_dir": opts.disk_dir}
            if opts.disk_threads is not None:
                tier["n_read_threads"] = tier["n_write_threads"] = opts.disk_threads
            extra["secondary_tiers"] = [tier]
        return cfg

    def options_from_vllm(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """None: an ``OffloadingConnector`` entry of an existing MultiConnector config stays
        ``type: vllm``, rendered as written (this type would add the plugin's spec to it)."""
        return None

    def describe(self, child: Child) -> str:
        """What the child does, one fact a line (``kvcompose check`` / ``explain``)."""
        opts = child.options_as(NativeOffloadOptions)
        lines = [
            f"keeps prefix blocks in {format_size(int(opts.cpu_bytes))} of host memory and loads them back on a hit "
            f"(vLLM's OffloadingConnector, {opts.eviction or 'lru'} eviction)",
            "stores are deferred to the next step (vLLM's own schedule)",
        ]
        if opts.disk_dir is not None:
            lines.append(
                f"behind it, vLLM's fs tier at {opts.disk_dir}: blocks evicted from host memory are kept as files, "
                "and any instance on that directory (this one restarted) loads them"
            )
        return "\n".join(lines)

    def save_hooks_needed(self, child: Child) -> str | None:
        """Always: its worker queues the stores its scheduler planned in ``wait_for_save``."""
        return (
            "is vLLM's OffloadingConnector: its worker queues the stores its scheduler planned in "
            "wait_for_save and starts them at the next start_load_kv, and the scheduler keeps those KV "
            "blocks until the stores are reported done"
        )

    def check(self, child: Child, plan: Plan) -> Iterator[Problem]:
        """Contradictory or impossible options, each located at the key to change."""
        opts = child.options_as(NativeOffloadOptions)
        given = given_options(opts)

        def at(key: str) -> tuple[str | int, ...]:
            return ("connectors", child.index, "options", key)

        if int(opts.cpu_bytes) == 0:
            yield Problem("cpu_bytes is 0 bytes", path=at("cpu_bytes"), hint="give a size such as 4GiB")
        beyond = beyond_host_memory(opts.cpu_bytes)
        if beyond:
            yield Problem(
                f"cpu_bytes: {beyond}",
                path=at("cpu_bytes"),
                hint="fine for a file written for a bigger server; here vLLM would fail to allocate it",
                warning=True,
            )
        if "disk_threads" in given and opts.disk_dir is None:
            yield Problem(
                "disk_threads only applies with disk_dir; vLLM would have no fs tier to give them",
                path=at("disk_threads"),
                hint="set disk_dir, or remove disk_threads",
            )
