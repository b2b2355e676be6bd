"""The secondary tiers of a ``native-offload`` child: vLLM's ``secondary_tiers``, typed and checked.

vLLM's ``TieringOffloadingSpec`` puts an ordered list of tiers behind its CPU tier
(``vllm/v1/kv_offload/tiering/spec.py``); each entry is a ``type`` and the keyword arguments of
that tier's manager (``tiering/factory.py`` ``create_secondary_tier``). The built-in types are
vLLM's ``fs``, ``obj``, ``p2p`` and ``kvcr``; any other ``type`` is a ``SecondaryTierManager``
class name that vLLM imports from the entry's ``module_path``.

The composition file writes the entries with vLLM's own keys (what vLLM's documentation names),
so each tier here is a struct whose fields are its manager's parameters: a typo or a wrong type is
refused at its line before an engine starts, where vLLM would raise a ``TypeError`` in the worker.
A test pins each struct's fields to its manager's signature in the installed vLLM.
Nothing here imports vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from kvcompose.api import Problem, convert, did_you_mean

PositiveInt = Annotated[int, Meta(gt=0)]
Port = Annotated[int, Meta(ge=1, le=65535)]
#: Where the tier's storage is, relative to this instance (vLLM's ``Locality``), in its KV events.
Locality = Literal["LOCAL", "REMOTE"]
Path = tuple[str | int, ...]

#: The ``kv_connector_extra_config`` keys naming the deployment key that signs the p2p tier's
#: P/D params (the child's ``key_env`` / ``key_file``; :mod:`kvcompose_cpu_offload.p2p` reads them).
P2P_KEY_ENV_KEY, P2P_KEY_FILE_KEY = "kvcompose_p2p_key_env", "kvcompose_p2p_key_file"
#: The ``kv_connector_extra_config`` key of the p2p tier's pool (kvcompose's, not vLLM's: the
#: tier's own entry keeps vLLM's keys only; :mod:`kvcompose_cpu_offload.p2p` reads it).
P2P_POOL_KEY = "kvcompose_p2p_pool"
#: The ``kv_connector_extra_config`` key naming the composition's P/D transport where another child
#: is it (NIXL): the p2p tier then leaves the P/D legs to it and serves the pool only.
P2P_PD_TRANSPORT_KEY = "kvcompose_pd_transport"
#: The ``kv_connector_extra_config`` key of the p2p tier's NIXL progress-thread delay (kvcompose's:
#: vLLM's tier builds its agent with NIXL's default, a thread that polls without sleeping).
P2P_PROGRESS_DELAY_KEY = "kvcompose_p2p_progress_delay_us"
#: vLLM's defaults for the p2p tier's control socket (``VLLM_P2P_SIDE_CHANNEL_HOST`` / ``_PORT``).
P2P_HOST_ENV, P2P_PORT_ENV, P2P_DEFAULT_PORT = "VLLM_P2P_SIDE_CHANNEL_HOST", "VLLM_P2P_SIDE_CHANNEL_PORT", 5710


class Tier(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True, tag_field="type"):
    """One built-in tier: its manager's keyword arguments under vLLM's names; unset: vLLM's default."""

    #: The manager class vLLM's factory registers for this ``type`` (``tiering/factory.py``).
    manager: ClassVar[str]
    #: Fields that are kvcompose's, not the manager's parameters (never rendered into vLLM's entry).
    own_fields: ClassVar[frozenset[str]] = frozenset()
    #: The tier's own ``backpressure`` settings (vLLM's ``backpressure_cls`` and its options),
    #: merged over the top-level ones by vLLM (``spec.py``).
    backpressure: dict[str, Any] | None = None


class StorageTier(Tier, kw_only=True):
    """A tier that stores blocks somewhere and can announce them (hash-only ``BlockStored``
    events, medium ``STORAGE``, when the engine publishes KV events)."""

    enable_kv_events: bool | None = None
    locality: Locality | None = None


class FsTier(StorageTier, tag="fs", kw_only=True):
    """Files under a directory that several instances may share (``tiering/fs/manager.py``)."""

    manager: ClassVar[str] = "vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager"
    root_dir: Annotated[str, Meta(min_length=1)]
    n_read_threads: PositiveInt | None = None
    n_write_threads: PositiveInt | None = None


class ObjStore(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """The object store's connection (vLLM's ``ObjStoreConfig``, ``tiering/obj/config.py``)."""

    bucket: Annotated[str, Meta(min_length=1)]
    endpoint_override: str
    access_key: str = ""
    secret_key: str = ""
    session_token: str = ""
    region: str = ""
    scheme: Literal["http", "https"] = "http"
    ca_bundle: str = ""


class ObjTier(StorageTier, tag="obj", kw_only=True):
    """An S3-compatible bucket through NIXL's OBJ backend (``tiering/obj/manager.py``)."""

    manager: ClassVar[str] = "vllm.v1.kv_offload.tiering.obj.manager.ObjectStoreSecondaryTierManager"
    store_config: ObjStore
    prefix: str | None = None
    io_threads: PositiveInt | None = None


#: A ZMQ endpoint a peer publishes on: ``tcp://HOST:PORT`` (vLLM binds ``tcp://*:PORT``), or
#: ``ipc:///PATH`` for a peer on this host (vLLM binds it as given; nothing beyond the host reaches it).
Endpoint = Annotated[str, Meta(pattern=r"^(tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):[0-9]{1,5}|ipc:///[^\s]{1,200})$")]


class PoolPeer(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """A peer of the fleet's pool: its p2p tier's control socket and its KV events publisher."""

    host: Annotated[str, Meta(min_length=1, max_length=253)]
    p2p_port: Port
    kv_events: Endpoint
    #: vLLM's replay endpoint of that publisher (``replay_endpoint``), to fill a sequence gap.
    kv_events_replay: Endpoint | None = None


class Pool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """The fleet's pool (kvcompose's, not vLLM's): which peer holds a request's prefix, from the
    peers' KV events, names the tier's ``remote_kv_source`` (:mod:`kvcompose_cpu_offload.pool`)."""

    peers: Annotated[list[PoolPeer], Meta(min_length=1)]
    #: how long a request waits for a source's lookup answer before it is computed here
    wait_ms: PositiveInt | None = None
    #: seconds without a peer's events before it is no longer offered as a source
    silent_s: PositiveInt | None = None
    #: hashes kept per peer (the oldest stored dropped past it)
    max_blocks: PositiveInt | None = None


#: The pool's defaults: wait for a source's answer, silence before a peer is not offered, entries a peer.
POOL_WAIT_MS, POOL_SILENT_S, POOL_MAX_BLOCKS = 1000, 60, 1_000_000


class P2pTier(Tier, tag="p2p", kw_only=True):
    """KV between instances over NIXL, each request's role named by its ``kv_transfer_params``
    (``remote_decoder``, ``remote_prefiller``, ``remote_kv_source``; ``tiering/p2p/manager.py``);
    ``pool`` and ``progress_delay_us`` are kvcompose's, rendered beside the tier
    (:data:`P2P_POOL_KEY`, :data:`P2P_PROGRESS_DELAY_KEY`), not in it."""

    manager: ClassVar[str] = "vllm.v1.kv_offload.tiering.p2p.manager.P2PSecondaryTierManager"
    own_fields: ClassVar[frozenset[str]] = frozenset({"pool", "progress_delay_us"})
    host: Annotated[str, Meta(min_length=1)] | None = None
    port: Port | None = None
    backends: list[str] | None = None
    num_threads: PositiveInt | None = None
    unbound_store_timeout_s: Annotated[float, Meta(gt=0)] | None = None
    #: µs the tier's NIXL progress thread sleeps between polls (unset: NIXL's 0, a core per engine)
    progress_delay_us: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    pool: Pool | None = None


class KvcrTier(Tier, tag="kvcr", kw_only=True):
    """The external ``kvcr`` service's tier (``tiering/kvcr/manager.py``; imports the ``kvcr`` package)."""

    manager: ClassVar[str] = "vllm.v1.kv_offload.tiering.kvcr.manager.KVCRSecondaryTierManager"
    #: The package vLLM's manager imports at start.
    package: ClassVar[str] = "kvcr"
    router_capabilities: list[str] | None = None
    control_host: str | None = None
    control_ports: list[Port] | None = None
    control_advertise_host: str | None = None
    eager_ctrl_connect: bool | None = None
    opportunistic_query: bool | None = None
    enable_telemetry: bool | None = None
    operation_timeout_ms: PositiveInt | None = None
    abandon_timeout_ms: PositiveInt | None = None
    metadata_retry_interval_ms: PositiveInt | None = None
    secondary_g2_slots: Annotated[int, Meta(ge=0)] | None = None
    kvcr_service_socket_path: str | None = None
    compatibility_digest: str | None = None
    policy: str | None = None
    g3: dict[str, Any] | None = None
    local_dram_backend: str | None = None
    remote_fw_dram_backend: str | None = None


#: The built-in tier types, by vLLM's ``type``.
BUILT_IN: Mapping[str, type[Tier]] = {cls.__struct_config__.tag: cls for cls in (FsTier, ObjTier, P2pTier, KvcrTier)}


@dataclass(frozen=True)
class ClassTier:
    """An out-of-tree ``SecondaryTierManager``: vLLM imports ``type`` from ``module_path`` and
    passes it the other keys as they are."""

    type: str
    module_path: str
    options: dict[str, Any] = field(default_factory=dict)

    def vllm_config(self) -> dict[str, Any]:
        return {"type": self.type, "module_path": self.module_path, **self.options}


AnyTier = Tier | ClassTier


def parse(entries: Sequence[Any], at: Path) -> tuple[list[AnyTier], list[Problem]]:
    """The tiers of ``tiers:`` (at ``at`` in the document), and what is wrong with each entry."""
    tiers: list[AnyTier] = []
    problems: list[Problem] = []
    for j, raw in enumerate(entries):
        here = at + (j,)
        tier, problem = _parse_one(raw, here)
        if problem is not None:
            problems.append(problem)
        elif tier is not None:
            tiers.append(tier)
    return tiers, problems


def _parse_one(raw: Any, at: Path) -> tuple[AnyTier | None, Problem | None]:
    if not isinstance(raw, dict):
        return None, Problem(
            f"a tier is a mapping with a type, not {type(raw).__name__}", at, "e.g. {type: fs, root_dir: /mnt/kv}"
        )
    kind = raw.get("type")
    if not isinstance(kind, str) or not kind:
        return None, Problem(
            "a tier needs a type", at, "one of " + ", ".join(BUILT_IN) + ", or a class name with module_path"
        )
    cls = BUILT_IN.get(kind)
    if cls is not None:
        if "module_path" in raw:
            return None, Problem(
                f"{kind} is one of vLLM's built-in tiers: vLLM ignores module_path for it",
                at + ("module_path",),
                "remove module_path, or give your class a name of its own",
            )
        return convert(raw, cls, at)
    module_path = raw.get("module_path")
    if module_path is None:
        close = did_you_mean(kind, BUILT_IN)
        return None, Problem(
            f"unknown tier type {kind!r}",
            at + ("type",),
            (close + " " if close.startswith("did you mean") else "")
            + "vLLM's tiers are "
            + ", ".join(BUILT_IN)
            + "; a class of your own also needs module_path",
        )
    if not isinstance(module_path, str) or not all(module_path.split(".")):
        return None, Problem(
            f"module_path {module_path!r} is not a module's full dotted name",
            at + ("module_path",),
            "write the module's full name from its top-level package, e.g. my_package.tiers",
        )
    options = {k: v for k, v in raw.items() if k not in ("type", "module_path")}
    return ClassTier(kind, module_path, options), None


def render(tier: AnyTier) -> dict[str, Any]:
    """The tier as one entry of vLLM's ``secondary_tiers``: only the keys given, vLLM's names."""
    if isinstance(tier, ClassTier):
        return tier.vllm_config()
    entry = msgspec.to_builtins(tier)
    for key in tier.own_fields:
        entry.pop(key, None)  # kvcompose's: vLLM's manager would refuse the keyword
    return entry


def pool_config(tier: P2pTier) -> dict[str, Any] | None:
    """The tier's pool as :mod:`kvcompose_cpu_offload.p2p` reads it (defaults filled in), or None."""
    if tier.pool is None:
        return None
    return {
        "peers": [msgspec.to_builtins(peer) for peer in tier.pool.peers],
        "wait_ms": tier.pool.wait_ms or POOL_WAIT_MS,
        "silent_s": tier.pool.silent_s or POOL_SILENT_S,
        "max_blocks": tier.pool.max_blocks or POOL_MAX_BLOCKS,
    }


def import_problems(tier: AnyTier, at: Path) -> Iterator[Problem]:
    """What fails when vLLM imports the tier's code (``--import-modules``: importing runs it)."""
    if isinstance(tier, KvcrTier) and importlib.util.find_spec(KvcrTier.package) is None:
        yield Problem(
            f"the kvcr tier imports the {KvcrTier.package!r} package, which is not installed here",
            at + ("type",),
            "install the kvcr client where the engine runs, or remove the tier",
        )
    if not isinstance(tier, ClassTier):
        return
    try:
        module = importlib.import_module(tier.module_path)
    except Exception as exc:  # whatever the module raises is what vLLM would meet at start
        yield Problem(
            f"module_path {tier.module_path!r} does not import: {type(exc).__name__}: {exc}",
            at + ("module_path",),
            "install the package that holds it where the engine runs",
        )
        return
    cls = getattr(module, tier.type, None)
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    if not (isinstance(cls, type) and issubclass(cls, SecondaryTierManager)):
        what = "has no" if cls is None else "has a non-SecondaryTierManager"
        yield Problem(
            f"{tier.module_path} {what} {tier.type}",
            at + ("type",),
            "type names a vLLM SecondaryTierManager subclass in module_path",
        )


def describe(tier: AnyTier) -> str:
    """What the tier holds and where, its first line; then the fs tier's sharing and the p2p
    tier's pool, a fact a line (``kvcompose check``)."""
    more: list[str] = []
    if isinstance(tier, FsTier):
        text = f"fs: block files in {tier.root_dir}, shared by the instances on it"
        more = describe_shared(tier)
    elif isinstance(tier, ObjTier):
        text = f"obj: bucket {tier.store_config.bucket} at {tier.store_config.endpoint_override}"
    elif isinstance(tier, P2pTier):
        host = tier.host or f"${P2P_HOST_ENV} (localhost)"
        port = tier.port or f"${P2P_PORT_ENV} ({P2P_DEFAULT_PORT})"
        text = f"p2p: KV between instances over NIXL; control socket {host}:{port} + DP index"
        more = [
            f"  p2p: NIXL's progress thread sleeps {tier.progress_delay_us} µs between polls"
            if tier.progress_delay_us
            else "  p2p: NIXL's progress thread polls without sleeping (a core per engine): set progress_delay_us"
        ]
        more += describe_pool(tier.pool) if tier.pool is not None else []
    elif isinstance(tier, KvcrTier):
        text = "kvcr: the kvcr service (its client package, kvcr)"
    else:
        text = f"{tier.type} from {tier.module_path}"
    if isinstance(tier, StorageTier) and tier.enable_kv_events:
        text += "; stores published as KV events"
    return "\n".join([text, *more])


#: Where vLLM's fs tier writes a block (``kv_offload/file_mapper.py``: ``FileMapper``).
FS_LAYOUT = "<model>_<digest>_r0/<hhh>/<hh>_g<group>/<block hash>.bin"


def describe_shared(tier: FsTier) -> list[str]:
    """What instances sharing the fs tier's directory must agree on, and who may write it
    (``kvcompose check``; the checks are :func:`fs_problems`)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return [
        f"  fs: each block a file {FS_LAYOUT}; the digest is of the model's name as given to vLLM, its "
        "dtype, tokens per block, blocks per file and KV groups: instances that differ in one write beside each other",
        "  fs: a block's file is named by vLLM's prefix hash: sha256 (vLLM's default) is seeded alike everywhere, "
        "or by PYTHONHASHSEED where it is set: give every instance on the directory the same PYTHONHASHSEED, or "
        f"none (here: {'PYTHONHASHSEED=' + seed if seed is not None else 'not set'}); xxhash without it never shares",
        "  fs: vLLM trusts every file there as KV: whoever may write the directory decides what the instances on "
        "it load; let only the fleet's instances write it",
    ]


def fs_problems(tier: FsTier, at: Path) -> Iterator[Problem]:
    """A shared directory any user may write, one that is not a directory, or a relative one
    (each engine resolves it in its own working directory); ``at``: the key that names it
    (``root_dir``, or ``disk_dir`` in the short form)."""
    root, key = pathlib.Path(tier.root_dir), at[-1]
    if not root.is_absolute():
        yield Problem(
            f"{key} {tier.root_dir!r} is relative: each engine resolves it in its own working directory, "
            "so instances started elsewhere do not share it",
            at,
            "give an absolute path",
            warning=True,
        )
    if root.exists() and not root.is_dir():
        yield Problem(f"{key} {tier.root_dir} exists and is not a directory", at)
    elif root.is_dir() and root.stat().st_mode & stat.S_IWOTH:
        yield Problem(
            f"{key} {tier.root_dir} may be written by any user of this host, and vLLM loads every block "
            "file there as KV: any of them could put KV under an instance's answers",
            at,
            f"chmod o-w {tier.root_dir} (the fleet's instances run as one user or group), or give a directory of "
            "their own",
        )


def describe_pool(pool: Pool) -> list[str]:
    """The pool, one fact a line (``kvcompose check``)."""
    lines = [
        f"  pool: {len(pool.peers)} peer(s); a prefix a peer's CPU or storage tier holds further than this "
        "instance is loaded from it (remote_kv_source)",
    ]
    lines += [
        f"  pool peer {p.host}:{p.p2p_port}, its KV events from {p.kv_events}"
        + (f" (replay {p.kv_events_replay})" if p.kv_events_replay else " (no replay: a gap forgets its entries)")
        for p in pool.peers
    ]
    lines.append(
        f"  pool: a source's lookup waits {pool.wait_ms or POOL_WAIT_MS} ms at most, then the prompt is computed here"
    )
    lines.append(
        f"  pool: a peer silent {pool.silent_s or POOL_SILENT_S} s is not offered; "
        f"{pool.max_blocks or POOL_MAX_BLOCKS} entries a peer at most, the oldest dropped"
    )
    return lines
