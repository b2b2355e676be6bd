"""The ``cpu-offload`` connector type: a prefix-cache tier in host memory (or a file on disk).

It stands for vLLM's ``SimpleCPUOffloadConnector``, loaded from
:mod:`kvcompose_cpu_offload.connector` so that the worker also runs where vLLM's CUDA-only copy
path cannot (the CPU platform). Nothing here imports vLLM: this module only validates options
and renders them as the ``KVTransferConfig`` keys vLLM reads.

Example::

    connectors:
      - name: host
        type: cpu-offload
        options: {cpu_bytes: 32GiB, lazy: true}
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from msgspec import Meta

from kvcompose.api import (
    ByteSize,
    ConnectorType,
    Options,
    Problem,
    beyond_host_memory,
    format_size,
    given_options,
    hookimpl,
)

if TYPE_CHECKING:
    from kvcompose.api import Child, Plan

PositiveInt = Annotated[int, Meta(gt=0)]

# vLLM's defaults (SimpleCPUOffloadConnector.__init__), for the descriptions.
VLLM_DEFAULT_CPU_BYTES = 8 * 2**30
VLLM_DEFAULT_DISK_CAPACITY = 100 * 2**30


class CpuOffloadOptions(Options):
    """Options of a ``cpu-offload`` child; each maps to one vLLM ``kv_connector_extra_config`` key.

    A field left at its default is not passed to vLLM, which then applies its own default (the
    same value). Sizes take units (``32GiB``, ``512MiB``) or a number of bytes.
    """

    backend: Annotated[
        Literal["cpu", "disk"],
        Meta(description="where evicted blocks live: host memory, or a file (kv_offload_backend)"),
    ] = "cpu"
    cpu_bytes: Annotated[
        ByteSize | None,
        Meta(
            description="host pool for the whole server, split evenly across ranks "
            "(cpu_bytes_to_use; vLLM's default is 8GiB)"
        ),
    ] = None
    cpu_bytes_per_rank: Annotated[
        ByteSize | None,
        Meta(description="host pool per rank; overrides cpu_bytes (cpu_bytes_to_use_per_rank)"),
    ] = None
    num_cpu_blocks: Annotated[
        PositiveInt | None,
        Meta(description="host pool as a number of KV blocks per rank; overrides both sizes (num_cpu_blocks)"),
    ] = None
    lazy: Annotated[
        bool,
        Meta(
            description="copy blocks out only when they are about to be evicted, instead of as soon "
            "as they are computed (lazy_offload)"
        ),
    ] = False
    disk_path: Annotated[
        str | None,
        Meta(description="disk backend: path of the backing file; each rank appends .rank_<n> (disk_path)"),
    ] = None
    disk_capacity: Annotated[
        ByteSize | None,
        Meta(description="disk backend: file size per rank (disk_capacity_bytes; vLLM's default is 100GiB)"),
    ] = None
    disk_buffer_slots: Annotated[
        PositiveInt | None,
        Meta(
            description="disk backend: staging slots per direction (disk_buffer_slots; vLLM's default is 2; "
            "vLLM's CUDA worker only: the portable worker sizes its staging itself)"
        ),
    ] = None
    use_page_cache: Annotated[
        bool | None,
        Meta(
            description="disk backend: buffered I/O through the page cache instead of O_DIRECT "
            "(use_page_cache; vLLM's default is false)"
        ),
    ] = None


#: Options that only mean something under one backend (vLLM warns and ignores them otherwise).
DISK_ONLY = ("disk_path", "disk_capacity", "disk_buffer_slots", "use_page_cache")
CPU_ONLY = ("cpu_bytes", "cpu_bytes_per_rank", "num_cpu_blocks")
SIZES = ("cpu_bytes", "cpu_bytes_per_rank", "disk_capacity")
#: Sizes of host memory (a disk file is not).
HOST_SIZES = ("cpu_bytes", "cpu_bytes_per_rank")


class CpuOffloadType(ConnectorType):
    """The ``cpu-offload`` connector type: vLLM's ``SimpleCPUOffloadConnector``.

    It extends the prefix cache: full blocks are copied to a host pool (or a disk file) and a
    later request with the same prefix loads them back instead of recomputing them. It needs
    ``enable_prefix_caching`` (vLLM's default) and never owns a handshake or request params.
    """

    name: ClassVar[str] = "cpu-offload"
    summary: ClassVar[str] = "prefix-cache tier in host memory or on disk (vLLM SimpleCPUOffloadConnector)"
    options: ClassVar[type[Options]] = CpuOffloadOptions
    # vLLM's scheduler half already loads from the ``num_computed_tokens`` it was asked with:
    # it looks hashes up from there and copies into the blocks from there on (``manager.py``).
    range_loads: ClassVar[bool] = True
    # vLLM's class copies whole blocks per step: its per-layer hooks, and these, are empty bodies.
    empty_calls: ClassVar[frozenset[str]] = frozenset(
        {
            "wait_for_layer_load",
            "save_kv_layer",
            "finish_forward",
            "reset_capture_state",
            "get_mem_pool_context",
            "set_host_xfer_buffer_ops",
            "get_kv_connector_kv_cache_events",
            "get_handshake_metadata",
            "on_new_request",
        }
    )
    # The literal upstream name: vLLM looks the connector up by name
    # (``KVTransferConfig.has_connector("SimpleCPUOffloadConnector")``) to align its block
    # counts, and the module path makes that name resolve to our subclass.
    vllm_connector: ClassVar[str] = "SimpleCPUOffloadConnector"
    vllm_module_path: ClassVar[str | None] = "kvcompose_cpu_offload.connector"
    extra_config_keys: ClassVar[Mapping[str, str]] = {
        "backend": "kv_offload_backend",
        "cpu_bytes": "cpu_bytes_to_use",
        "cpu_bytes_per_rank": "cpu_bytes_to_use_per_rank",
        "num_cpu_blocks": "num_cpu_blocks",
        "lazy": "lazy_offload",
        "disk_path": "disk_path",
        "disk_capacity": "disk_capacity_bytes",
        "disk_buffer_slots": "disk_buffer_slots",
        "use_page_cache": "use_page_cache",
    }

    def portable_worker(self, vllm_config: Any, kv_cache_config: Any, cpu_capacity_bytes: int, **options: Any) -> Any:
        """A new portable worker (the CPU platform's ``SimpleCPUOffloadWorker``), vLLM's arguments.

        ``kvcompose bench cpu-copy`` measures it through this type, because the core never imports
        a plugin package. Imported on call: it needs torch and vLLM, and describing a composition
        must work without them.
        """
        from kvcompose_cpu_offload.portable_worker import PortableSimpleCPUOffloadWorker

        return PortableSimpleCPUOffloadWorker(vllm_config, kv_cache_config, cpu_capacity_bytes, **options)

    def huge_page_buffer(self, nbytes: int) -> memoryview:
        """Host memory as the disk backend takes its I/O buffers (:mod:`kvcompose_cpu_offload.host_memory`):
        ``kvcompose bench cpu-copy``'s sequential-I/O baseline reads and writes from it, through this type."""
        from kvcompose_cpu_offload.host_memory import huge_page_buffer

        return huge_page_buffer(nbytes)

    def describe(self, child: Child) -> str:
        """What the child does, in one sentence (``kvcompose check`` / ``explain``)."""
        opts = child.options_as(CpuOffloadOptions)
        mode = "lazy offload" if opts.lazy else "eager offload"
        if opts.backend == "disk":
            cap = format_size(int(opts.disk_capacity or VLLM_DEFAULT_DISK_CAPACITY))
            where = f"a {cap} file per rank at {opts.disk_path or '(no disk_path set)'}"
            io = "page cache" if opts.use_page_cache else "O_DIRECT"
            return f"keeps evicted prefix blocks in {where} and loads them back on a hit ({mode}, {io} I/O)"
        return f"keeps evicted prefix blocks in {_host_size(opts)} of host memory and loads them back on a hit ({mode})"

    def brief(self, child: Child) -> str:
        """``check``'s lines: where the blocks are kept, then what is stored (:meth:`describe` in full)."""
        opts = child.options_as(CpuOffloadOptions)
        if opts.backend == "disk":
            cap = format_size(int(opts.disk_capacity or VLLM_DEFAULT_DISK_CAPACITY))
            io = "page cache" if opts.use_page_cache else "O_DIRECT"
            first = f"prefix blocks in a {cap} file per rank, loaded back on a hit ({io} I/O)"
            where = [f"disk_path: {opts.disk_path or '(not set)'}"]
        else:
            first, where = f"prefix blocks in {_host_size(opts)} of host memory, loaded back on a hit", []
        stores = (
            "the blocks it evicts (lazy offload)" if opts.lazy else "every block a request computes (eager offload)"
        )
        return "\n".join([first, *where, f"stores: {stores}"])

    def save_hooks_needed(self, child: Child) -> str | None:
        """Always: vLLM's scheduler half plans the stores and its worker starts them in ``wait_for_save``."""
        opts = child.options_as(CpuOffloadOptions)
        which = "the blocks it evicts" if opts.lazy else "every block a request computes"
        return (
            f"is vLLM's SimpleCPUOffloadConnector: its scheduler plans a store of {which}, which only its "
            "worker's wait_for_save starts, and keeps those KV blocks in use until the store is reported "
            "done; they would never be freed, and the engine stalls once its KV cache is used up"
        )

    def check(self, child: Child, plan: Plan) -> Iterator[Problem]:
        """Contradictory or incomplete options, each located at the key to change."""
        opts = child.options_as(CpuOffloadOptions)
        given = given_options(opts)

        def at(key: str) -> tuple[str | int, ...]:
            return ("connectors", child.index, "options", key)

        for key in SIZES:
            if key in given and given[key] == 0:
                yield Problem(f"{key} is 0 bytes", path=at(key), hint="give a size such as 4GiB")
        for key in HOST_SIZES:
            beyond = beyond_host_memory(given[key]) if key in given else None
            if beyond:
                yield Problem(
                    f"{key}: {beyond}",
                    path=at(key),
                    hint="fine for a file written for a bigger server; here vLLM would fail to allocate it",
                    warning=True,
                )

        if opts.backend == "disk":
            if not opts.disk_path:
                yield Problem(
                    "backend disk needs a file to write blocks to",
                    path=at("disk_path"),
                    hint="set disk_path, e.g. /mnt/nvme/kv.bin (rank n writes kv.bin.rank_n)",
                )
            for key in CPU_ONLY:
                if key in given:
                    yield Problem(
                        f"{key} sizes the host pool, which backend disk does not use",
                        path=at(key),
                        hint="size the disk tier with disk_capacity, or set backend: cpu",
                    )
        else:
            for key in DISK_ONLY:
                if key in given:
                    yield Problem(
                        f"{key} only applies to backend disk; vLLM would ignore it",
                        path=at(key),
                        hint=f"set backend: disk, or remove {key}",
                    )
            if "num_cpu_blocks" in given:
                for key in ("cpu_bytes", "cpu_bytes_per_rank"):
                    if key in given:
                        yield Problem(
                            f"num_cpu_blocks and {key} both size the host pool; num_cpu_blocks would win",
                            path=at(key),
                            hint="give one of them",
                        )
            elif "cpu_bytes" in given and "cpu_bytes_per_rank" in given:
                yield Problem(
                    "cpu_bytes_per_rank overrides cpu_bytes; giving both is ambiguous",
                    path=at("cpu_bytes"),
                    hint="give cpu_bytes (whole server) or cpu_bytes_per_rank, not both",
                )


def _host_size(opts: CpuOffloadOptions) -> str:
    """The host pool size as the user stated it."""
    if opts.num_cpu_blocks is not None:
        return f"{opts.num_cpu_blocks} KV blocks per rank"
    if opts.cpu_bytes_per_rank is not None:
        return f"{format_size(int(opts.cpu_bytes_per_rank))} per rank"
    if opts.cpu_bytes is not None:
        return format_size(int(opts.cpu_bytes))
    return f"{format_size(VLLM_DEFAULT_CPU_BYTES)} (vLLM's default)"


@hookimpl
def kvcompose_connector_types() -> list[ConnectorType]:
    """Contribute the ``cpu-offload`` type and the ``native-offload`` type (vLLM's OffloadingConnector)."""
    from kvcompose_cpu_offload.offloading_type import NativeOffloadType

    return [CpuOffloadType(), NativeOffloadType()]
