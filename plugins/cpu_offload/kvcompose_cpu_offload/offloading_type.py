"""The ``native-offload`` connector type: vLLM's own ``OffloadingConnector`` as a tier.

vLLM's native KV offloading (``--kv-offloading-backend native``; ``vllm/v1/kv_offload/``): a
host-memory tier with vLLM's manager and eviction policies (``lru``, ``arc``), optionally with a
list of secondary tiers behind it (vLLM's ``TieringOffloadingSpec``: ``fs``, ``obj``, ``p2p``,
``kvcr``, a class of your own; :mod:`kvcompose_cpu_offload.tiers`). The
connector class is vLLM's, unchanged; the options pick vLLM's offloading spec through vLLM's own
extension point (``spec_name`` / ``spec_module_path``, ``vllm/v1/kv_offload/factory.py``): the
plugin's :mod:`kvcompose_cpu_offload.native` specs, which are vLLM's on CUDA and XPU and differ
elsewhere only in how the worker copies bytes (docs/native-offload.md). Nothing here imports
vLLM.

Example::

    connectors:
      - name: host
        type: native-offload
        options:
          cpu_bytes: 4GiB
          eviction: arc
          tiers:                       # behind host memory, in order
            - {type: fs, root_dir: /mnt/nvme/kv}
            - {type: p2p, port: 5710}

``disk_dir: /mnt/nvme/kv`` is the short form of one ``fs`` tier.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from msgspec import Meta

from kvcompose.api import (
    ByteSize,
    ConnectorType,
    Listener,
    Options,
    Problem,
    beyond_host_memory,
    format_size,
    given_options,
)
from kvcompose_cpu_offload import tiers as tiers_
from kvcompose_nixl.trust import LOOPBACK_PEERS

if TYPE_CHECKING:
    from kvcompose.api import Child, Plan

PositiveInt = Annotated[int, Meta(gt=0)]

#: The module of the plugin's offloading specs, and their names (vLLM's factory imports them).
SPEC_MODULE = "kvcompose_cpu_offload.native"
CPU_SPEC = "PortableCPUOffloadingSpec"
TIERING_SPEC = "PortableTieringOffloadingSpec"
#: The module of vLLM's ``OffloadingConnector`` mapping vLLM's P/D protocol onto the p2p tier's keys.
P2P_MODULE = "kvcompose_cpu_offload.p2p"


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
    key_env: Annotated[
        Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None,
        Meta(
            description="with a p2p tier: the environment variable holding the deployment key that signs its P/D "
            "params (the nixl child's key; the first signs, all verify); the key itself never goes in the file"
        ),
    ] = None
    key_file: Annotated[
        Annotated[str, Meta(min_length=1)] | None,
        Meta(description="with a p2p tier: a file holding the deployment key, instead of key_env"),
    ] = None
    tiers: Annotated[
        list[dict[str, Any]] | None,
        Meta(
            description="secondary tiers behind host memory, in order (vLLM's secondary_tiers, its keys): "
            "{type: fs, root_dir: ...}, {type: obj, store_config: {...}}, {type: p2p, host: ..., port: ...}, "
            "{type: kvcr, ...}, or {type: MyTierClass, module_path: my.module, ...}"
        ),
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
        """vLLM's class, the options under vLLM's keys, the plugin's spec, and the secondary tiers
        (a list the key maps cannot express); with a p2p tier, vLLM's class answering vLLM's
        proxy and router through it (:mod:`kvcompose_cpu_offload.p2p`)."""
        cfg = super().vllm_config(child)
        opts = child.options_as(NativeOffloadOptions)
        extra = cfg["kv_connector_extra_config"]
        for key in ("tiers", "key_env", "key_file"):
            extra.pop(key, None)
        tiers = secondary_tiers(opts)
        extra["spec_name"] = TIERING_SPEC if tiers else CPU_SPEC
        extra["spec_module_path"] = SPEC_MODULE
        if tiers:
            extra["secondary_tiers"] = [tiers_.render(t) for t in tiers]
        p2p_tiers = [t for t in tiers if isinstance(t, tiers_.P2pTier)]
        if p2p_tiers:
            # vLLM's class, answering vLLM's proxy and router through the p2p tier (p2p.py)
            cfg["kv_connector_module_path"] = P2P_MODULE
            if opts.key_env is not None:
                extra[tiers_.P2P_KEY_ENV_KEY] = opts.key_env
            if opts.key_file is not None:
                extra[tiers_.P2P_KEY_FILE_KEY] = opts.key_file
            pools = [tiers_.pool_config(t) for t in p2p_tiers if t.pool is not None]
            if pools:
                extra[tiers_.P2P_POOL_KEY] = pools[0]
            delays = [t.progress_delay_us for t in p2p_tiers if t.progress_delay_us]
            if delays:
                extra[tiers_.P2P_PROGRESS_DELAY_KEY] = delays[0]
            if child.transport is not None:
                extra[tiers_.P2P_PD_TRANSPORT_KEY] = child.transport
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
        lines += [f"then tier {n}, {tiers_.describe(t)}" for n, t in enumerate(secondary_tiers(opts), 1)]
        lines += p2p_pd_lines(child)
        return "\n".join(lines)

    def brief(self, child: Child) -> str:
        """``check``'s lines, one short fact each (:meth:`describe` in full)."""
        opts = child.options_as(NativeOffloadOptions)
        lines = [
            f"prefix blocks in {format_size(int(opts.cpu_bytes))} of host memory, loaded back on a hit",
            f"vLLM's OffloadingConnector, {opts.eviction or 'lru'} eviction; stores deferred to the next step",
        ]
        lines += [f"then tier {n}, {tiers_.describe(t)}" for n, t in enumerate(secondary_tiers(opts), 1)]
        lines += p2p_pd_lines(child)
        return "\n".join(lines)

    def listeners(self, child: Child) -> Iterator[Listener]:
        """Each p2p tier's control socket (vLLM binds it in every worker; base port + DP index)."""
        for j, tier in enumerate(secondary_tiers(child.options_as(NativeOffloadOptions))):
            if isinstance(tier, tiers_.P2pTier):
                at = ("connectors", child.index, "options", "tiers", j)
                env_port = os.environ.get(tiers_.P2P_PORT_ENV)
                yield Listener(
                    what="p2p tier control socket",
                    host=tier.host or os.environ.get(tiers_.P2P_HOST_ENV) or "localhost",
                    port=tier.port or int(env_port or tiers_.P2P_DEFAULT_PORT),
                    set_by="its port option"
                    if tier.port
                    else f"${tiers_.P2P_PORT_ENV}" + ("" if env_port else "'s default"),
                    path=at + (("port",) if tier.port else ()),
                )

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
        has_p2p = any(isinstance(t, tiers_.P2pTier) for t in secondary_tiers(opts))
        for key in ("key_env", "key_file"):
            if key in given and not has_p2p:
                yield Problem(
                    f"{key} signs the p2p tier's P/D params; this child has no p2p tier",
                    path=at(key),
                    hint=f"add a p2p tier, or remove {key}",
                )
        if opts.key_env is not None and opts.key_file is not None:
            yield Problem("give key_env or key_file, not both", path=at("key_file"))
        if opts.key_env is not None and has_p2p and not os.environ.get(opts.key_env):
            yield Problem(
                f"key_env names ${opts.key_env}, which is not set in this process's environment: an engine "
                "started in this environment stops at start",
                path=at("key_env"),
                hint="give every engine of the deployment the same key (`openssl rand -hex 32`), e.g. from a Secret",
                warning=True,
            )
        if opts.tiers is None:
            for tier in secondary_tiers(opts):  # disk_dir, the short form of one fs tier
                assert isinstance(tier, tiers_.FsTier)
                yield from tiers_.fs_problems(tier, at("disk_dir"))
            return
        if opts.disk_dir is not None:
            yield Problem(
                "disk_dir is the short form of one fs tier; with tiers, write that tier in the list",
                path=at("disk_dir"),
                hint="move it into tiers as {type: fs, root_dir: ...}, in the place you want it",
            )
        tiers, problems = tiers_.parse(opts.tiers, at("tiers"))
        yield from problems
        keyed = opts.key_env is not None or opts.key_file is not None
        pooled = [j for j, t in enumerate(tiers) if isinstance(t, tiers_.P2pTier) and t.pool is not None]
        for j in pooled[1:]:
            yield Problem(
                "one pool a child: its connector runs one index of the fleet's peers",
                at("tiers") + (j, "pool"),
                "keep the pool on one p2p tier",
            )
        for j, tier in enumerate(tiers):
            yield from _tier_problems(tier, at("tiers") + (j,), plan, keyed)


def p2p_pd_lines(child: Child) -> list[str]:
    """Who carries the P/D legs when the child has a p2p tier (``kvcompose check``)."""
    if not any(isinstance(t, tiers_.P2pTier) for t in secondary_tiers(child.options_as(NativeOffloadOptions))):
        return []
    if child.transport is not None:
        return [f"  p2p: P/D is {child.transport}'s; the p2p tier carries no P/D leg, it serves the pool"]
    return ["  p2p: carries the P/D legs of vLLM's proxy and router (do_remote_decode -> remote_decoder)"]


def secondary_tiers(opts: NativeOffloadOptions) -> list[tiers_.AnyTier]:
    """The child's tiers behind host memory, in order (``disk_dir``: one fs tier); the entries
    :meth:`NativeOffloadType.check` refused are left out."""
    if opts.tiers is not None:
        return tiers_.parse(opts.tiers, ())[0]
    if opts.disk_dir is None:
        return []
    threads = opts.disk_threads
    return [tiers_.FsTier(root_dir=opts.disk_dir, n_read_threads=threads, n_write_threads=threads)]


def _tier_problems(
    tier: tiers_.AnyTier, at: tuple[str | int, ...], plan: Plan | None, keyed: bool = False
) -> Iterator[Problem]:
    """What vLLM would refuse at start, or what the file should not hold, in one valid entry
    (``keyed``: the child names the deployment key)."""
    if isinstance(tier, tiers_.P2pTier) and tier.pool is not None:
        yield from _pool_problems(tier.pool, at + ("pool",), keyed)
    if isinstance(tier, tiers_.FsTier):
        yield from tiers_.fs_problems(tier, at + ("root_dir",))
    if isinstance(tier, tiers_.P2pTier) and tier.backpressure is not None:
        yield Problem(
            "vLLM's p2p tier refuses backpressure (it cannot fail fast in P/D mode)",
            at + ("backpressure",),
            "remove backpressure from the p2p tier",
        )
    if isinstance(tier, tiers_.Tier) and tier.backpressure is not None and "backpressure_cls" not in tier.backpressure:
        yield Problem(
            "backpressure needs backpressure_cls (vLLM's EMABackpressureDetector, or a class of your own)",
            at + ("backpressure",),
        )
    if isinstance(tier, tiers_.ObjTier):
        for key in ("access_key", "secret_key", "session_token"):
            if getattr(tier.store_config, key):
                yield Problem(
                    f"store_config.{key} is written in the file, and so in vLLM's command line and its logs",
                    at + ("store_config", key),
                    "leave it empty: NIXL's OBJ backend then takes the AWS credential chain (AWS_* variables, "
                    "a mounted credentials file, the pod's IAM role)",
                    warning=True,
                )
    if plan is not None and plan.import_modules and importlib.util.find_spec("vllm") is not None:
        yield from tiers_.import_problems(tier, at)


def _pool_problems(pool: tiers_.Pool, at: tuple[str | int, ...], keyed: bool) -> Iterator[Problem]:
    """A pool's peers: each once, each endpoint's port in range (an ``ipc://`` one for a peer on
    this host only), and the deployment key unless every peer is this machine."""
    seen: set[tuple[str, int]] = set()
    for j, peer in enumerate(pool.peers):
        here = at + ("peers", j)
        if (peer.host, peer.p2p_port) in seen:
            yield Problem(f"peer {peer.host}:{peer.p2p_port} is listed twice", here, "list each peer once")
        seen.add((peer.host, peer.p2p_port))
        for key in ("kv_events", "kv_events_replay"):
            endpoint = getattr(peer, key)
            if endpoint is None:
                continue
            if endpoint.startswith("ipc://") and not LOOPBACK_PEERS.allows(peer.host, peer.p2p_port):
                yield Problem(
                    f"{key} {endpoint!r} is a socket of this host, but the peer is {peer.host}",
                    here + (key,),
                    "give a peer beyond this host its publisher's tcp://HOST:PORT",
                )
            elif endpoint.startswith("tcp://") and not 0 < int(endpoint.rpartition(":")[2]) < 65536:
                yield Problem(f"{key} {endpoint!r}: the port is not 1-65535", here + (key,))
    # The loopback the p2p class lets a role name without a key (kvcompose_nixl.trust), one definition.
    remote = [p for p in pool.peers if not LOOPBACK_PEERS.allows(p.host, p.p2p_port)]
    if remote and not keyed:
        yield Problem(
            f"a pool with peers beyond this machine ({remote[0].host}, ...) needs the deployment key: a source "
            "must be a deployment peer that holds the key, as the p2p tier's P/D params are signed with it",
            at + ("peers",),
            "set key_env (or key_file) on this child, the same key on every instance, or list only loopback peers",
        )
