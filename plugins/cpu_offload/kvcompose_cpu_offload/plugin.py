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

from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from msgspec import Meta

from kvcompose import hookimpl
from kvcompose.catalog import ConnectorType, Options
from kvcompose.errors import Problem
from kvcompose.units import ByteSize, format_size

if TYPE_CHECKING:
    from kvcompose.catalog import Child, Plan

#: The class name vLLM is given. It must stay the literal upstream name: vLLM looks the
#: connector up by name (``KVTransferConfig.has_connector("SimpleCPUOffloadConnector")``) to
#: align its block counts, and the module path below makes it resolve to our subclass.
VLLM_CONNECTOR = "SimpleCPUOffloadConnector"
VLLM_MODULE_PATH = "kvcompose_cpu_offload.connector"

PositiveInt = Annotated[int, Meta(gt=0)]

# vLLM's defaults (SimpleCPUOffloadConnector.__init__), for the descriptions.
VLLM_DEFAULT_CPU_BYTES = 8 * 2**30
VLLM_DEFAULT_DISK_CAPACITY = 100 * 2**30
VLLM_DEFAULT_DISK_BUFFER_SLOTS = 2


class CpuOffloadOptions(Options):
    """Options of a ``cpu-offload`` child; each maps to one vLLM ``kv_connector_extra_config`` key.

    A field left at its default is not passed to vLLM, which then applies its own default (the
    same value). Sizes take units (``32GiB``, ``512MiB``) or a number of bytes.
    """

    #: Where evicted blocks live: host memory, or a file (``kv_offload_backend``).
    backend: Literal["cpu", "disk"] = "cpu"
    #: Host pool for the whole server, split evenly across ranks (``cpu_bytes_to_use``;
    #: vLLM's default is 8GiB).
    cpu_bytes: ByteSize | None = None
    #: Host pool per rank; overrides ``cpu_bytes`` (``cpu_bytes_to_use_per_rank``).
    cpu_bytes_per_rank: ByteSize | None = None
    #: Host pool as a number of KV blocks per rank; overrides both sizes (``num_cpu_blocks``).
    num_cpu_blocks: PositiveInt | None = None
    #: Copy blocks out only when they are about to be evicted, instead of as soon as they are
    #: computed (``lazy_offload``).
    lazy: bool = False
    #: Disk backend: path of the backing file; each rank appends ``.rank_<n>`` (``disk_path``).
    disk_path: str | None = None
    #: Disk backend: file size per rank (``disk_capacity_bytes``; vLLM's default is 100GiB).
    disk_capacity: ByteSize | None = None
    #: Disk backend: staging slots per direction (``disk_buffer_slots``; vLLM's default is 2).
    disk_buffer_slots: PositiveInt | None = None
    #: Disk backend: buffered I/O through the page cache instead of ``O_DIRECT``
    #: (``use_page_cache``; vLLM's default is false).
    use_page_cache: bool | None = None


#: Option field -> vLLM extra-config key.
VLLM_KEYS: dict[str, str] = {
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

#: Options that only mean something under one backend (vLLM warns and ignores them otherwise).
DISK_ONLY = ("disk_path", "disk_capacity", "disk_buffer_slots", "use_page_cache")
CPU_ONLY = ("cpu_bytes", "cpu_bytes_per_rank", "num_cpu_blocks")
SIZES = ("cpu_bytes", "cpu_bytes_per_rank", "disk_capacity")

_DEFAULTS: dict[str, Any] = {"backend": "cpu", "lazy": False}


def _given(options: CpuOffloadOptions) -> dict[str, Any]:
    """The options the user set: not None, and not equal to a non-None default."""
    given = {}
    for name in VLLM_KEYS:
        value = getattr(options, name)
        if value is None or (name in _DEFAULTS and value == _DEFAULTS[name]):
            continue
        given[name] = value
    return given


def _vllm_value(value: Any) -> Any:
    # ByteSize is an int subclass; vLLM and JSON rendering want a plain int.
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    return int(value)


class CpuOffloadType(ConnectorType):
    """The ``cpu-offload`` connector type: vLLM's ``SimpleCPUOffloadConnector``.

    It extends the prefix cache: full blocks are copied to a host pool (or a disk file) and a
    later request with the same prefix loads them back instead of recomputing them. It needs
    ``enable_prefix_caching`` (vLLM's default) and never owns a handshake or request params.
    """

    name: ClassVar[str] = "cpu-offload"
    summary: ClassVar[str] = (
        "prefix-cache tier in host memory or on disk (vLLM SimpleCPUOffloadConnector)"
    )
    options: ClassVar[type[Options]] = CpuOffloadOptions

    def vllm_config(self, child: Child) -> dict[str, Any]:
        """``KVTransferConfig`` kwargs: our module path, and only the keys the user set."""
        opts = _options(child)
        extra = {VLLM_KEYS[k]: _vllm_value(v) for k, v in _given(opts).items()}
        return {
            "kv_connector": VLLM_CONNECTOR,
            "kv_connector_module_path": VLLM_MODULE_PATH,
            "kv_connector_extra_config": extra,
        }

    def describe(self, child: Child) -> str:
        """What the child does, in one sentence (``kvcompose check`` / ``explain``)."""
        opts = _options(child)
        mode = "lazy offload" if opts.lazy else "eager offload"
        if opts.backend == "disk":
            cap = format_size(int(opts.disk_capacity or VLLM_DEFAULT_DISK_CAPACITY))
            where = f"a {cap} file per rank at {opts.disk_path or '(no disk_path set)'}"
            io = "page cache" if opts.use_page_cache else "O_DIRECT"
            return (
                f"keeps evicted prefix blocks in {where} and loads them back on a hit "
                f"({mode}, {io} I/O)"
            )
        return (
            f"keeps evicted prefix blocks in {_host_size(opts)} of host memory and loads them "
            f"back on a hit ({mode})"
        )

    def check(self, child: Child, plan: Plan) -> Iterator[Problem]:
        """Contradictory or incomplete options, each located at the key to change."""
        opts = _options(child)
        given = _given(opts)

        def at(key: str) -> tuple[str | int, ...]:
            return ("connectors", child.index, "options", key)

        for key in SIZES:
            if key in given and given[key] == 0:
                yield Problem(f"{key} is 0 bytes", path=at(key), hint="give a size such as 4GiB")

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
                            f"num_cpu_blocks and {key} both size the host pool; "
                            "num_cpu_blocks would win",
                            path=at(key),
                            hint="give one of them",
                        )
            elif "cpu_bytes" in given and "cpu_bytes_per_rank" in given:
                yield Problem(
                    "cpu_bytes_per_rank overrides cpu_bytes; giving both is ambiguous",
                    path=at("cpu_bytes"),
                    hint="give cpu_bytes (whole server) or cpu_bytes_per_rank, not both",
                )


def _options(child: Child) -> CpuOffloadOptions:
    opts = child.options
    if not isinstance(opts, CpuOffloadOptions):
        raise TypeError(f"cpu-offload child {child.name!r} has options of type {type(opts)!r}")
    return opts


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
    """Contribute the ``cpu-offload`` type."""
    return [CpuOffloadType()]
