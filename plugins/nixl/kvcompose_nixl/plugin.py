"""The kvcompose plugin for connector type ``nixl`` (vLLM's P/D transfer over NIXL).

Registered through the ``kvcompose`` entry-point group (``nixl = "kvcompose_nixl.plugin"``).
Nothing here imports vLLM or NIXL: describing and checking a composition must work on a machine
that has neither. The facts about vLLM below are from vLLM 0.32's ``kv_connector/v1/nixl/``:

- ``kv_connector_extra_config`` keys and defaults: ``backends`` ["UCX"] and ``num_threads`` 4
  (``base_worker.py``), ``kv_lease_duration`` 30, ``kv_recompute_threshold`` 64,
  ``bidirectional_kv_xfer`` False, ``decoder_kv_blocks_ttl`` 480 (``base_scheduler.py``),
  ``engine_ttl`` 3600 and ``enforce_handshake_compat`` True (``base_worker.py``),
  ``push_registration_timeout`` = ``decoder_kv_blocks_ttl`` (``push_scheduler.py``).
- The side channel comes only from ``VLLM_NIXL_SIDE_CHANNEL_HOST`` / ``_PORT`` (default
  localhost:5600, port + data-parallel index); :mod:`kvcompose_nixl.connector` adds the
  ``side_channel_*`` options on top.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

from kvcompose.api import ConnectorType, Listener, Options, Problem, hookimpl
from kvcompose_nixl import (
    ACCEPT_UNSIGNED_KEY,
    CONNECTOR_MODULE,
    HANDSHAKE_TRIES_KEY,
    HANDSHAKE_TRY_S,
    INSECURE_SIDE_CHANNEL_KEY,
    KEY_ENV_KEY,
    KEY_FILE_KEY,
    LEASE_ANSWERS_KEY,
    PEERS_KEY,
    PROGRESS_DELAY_KEY,
    SIDE_CHANNEL_HOST_KEY,
    SIDE_CHANNEL_PORT_KEY,
    UCX_ERROR_HANDLING_KEY,
)
from kvcompose_nixl.backends import NETWORK_BACKENDS, backend_names
from kvcompose_nixl.trust import SIGNED_KEYS, Keyring, Peers, TrustConfigError

if TYPE_CHECKING:
    from kvcompose.api import Child, Plan

#: A NIXL backend plugin name. Built from the names NIXL's source builds plus the plugins on
#: this machine, so an unknown name fails validation with the list of good ones.
BackendName = Literal[backend_names()]  # type: ignore[valid-type]

#: vLLM's defaults for what the options leave unset (quoted in descriptions and checks).
DEFAULT_BACKENDS: tuple[str, ...] = ("UCX",)
DEFAULT_LEASE_SECONDS = 30
DEFAULT_SIDE_CHANNEL_HOST = "localhost"
DEFAULT_SIDE_CHANNEL_PORT = 5600

#: The vLLM class per mode. The names must stay vLLM's: vLLM looks for the literal
#: "NixlConnector" with ``KVTransferConfig.has_connector`` (config/vllm.py, platforms/cpu.py).
CONNECTOR_CLASS: dict[str, str] = {"pull": "NixlConnector", "push": "NixlPushConnector"}
#: The mode each of vLLM's registered NIXL names stands for (``NixlPullConnector`` is an alias).
MODE_OF_CLASS: dict[str, str] = {"NixlPullConnector": "pull", **{cls: mode for mode, cls in CONNECTOR_CLASS.items()}}

#: ``kv_transfer_params`` keys NixlConnector reads or returns, in pull and push mode.
PARAM_KEYS: frozenset[str] = frozenset(
    {
        # What a prefill instance returns from request_finished (pull_scheduler.py,
        # push_scheduler.py) and a decode instance reads back.
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_request_id",
        "remote_host",
        "remote_port",
        "tp_size",
        "dcp_size",
        "pp_size",
        "remote_num_tokens",
        "remote_blocks_expiry_time",  # pull only (lease deadline for bidirectional readback)
        LEASE_ANSWERS_KEY,  # this type's prefill answers lease questions (kvcompose_nixl.lease)
        "transfer_mode",  # "pull" | "push": lets a router tell the two apart
        "remote_registration_generation",  # vLLM 0.33 (NIXL metadata version 15)
        # Read by the worker when a router supplies it (metadata.py, ReqMeta.remote_block_size).
        "remote_block_size",
    }
    | SIGNED_KEYS  # a signing prefill's (kvcompose_nixl.trust)
)

#: Markers NixlConnector writes into a request's own ``kv_transfer_params`` and reads back, so
#: that a request is transferred once and a prefill prompt is truncated once
#: (``pull_scheduler.py``, ``base_scheduler.py``). Never returned, not part of the P/D contract
#: with routers; whoever hands a child a filtered view of the params must keep them.
INTERNAL_PARAM_KEYS: frozenset[str] = frozenset({"_remote_blocks_processed", "_p_side_truncated"})

_Seconds = Annotated[float, msgspec.Meta(gt=0)]
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class NixlOptions(Options):
    """``options:`` of a ``nixl`` child. Unset options keep vLLM's defaults."""

    backends: Annotated[
        list[BackendName],  # type: ignore[valid-type]
        msgspec.Meta(min_length=1, description="NIXL backend plugins, in preference order"),
    ] = msgspec.field(default_factory=lambda: list(DEFAULT_BACKENDS))
    buffer_device: Annotated[
        Literal["cuda", "cpu", "xpu", "tpu"] | None,
        msgspec.Meta(description="KV transfer buffer (kv_buffer_device); unset: the platform's device"),
    ] = None
    mode: Annotated[
        Literal["pull", "push"],
        msgspec.Meta(description="pull: decode READs (NixlConnector); push: prefill WRITEs (NixlPushConnector)"),
    ] = "pull"
    side_channel_host: Annotated[
        _NonEmpty | None,
        msgspec.Meta(description="handshake listener host; unset: $VLLM_NIXL_SIDE_CHANNEL_HOST"),
    ] = None
    side_channel_port: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=65535)] | None,
        msgspec.Meta(
            description="handshake listener base port (+ data-parallel index); unset: $VLLM_NIXL_SIDE_CHANNEL_PORT"
        ),
    ] = None
    lease_seconds: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(description="how long a prefill instance holds unread blocks (kv_lease_duration, 30)"),
    ] = None
    recompute_threshold: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        msgspec.Meta(description="fewer remote tokens than this are recomputed (kv_recompute_threshold, 64)"),
    ] = None
    num_threads: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(description="NIXL UCX worker threads (num_threads, 4; UCX-only backends)"),
    ] = None
    progress_delay_us: Annotated[
        Annotated[int, msgspec.Meta(ge=0)] | None,
        msgspec.Meta(
            description="microseconds NIXL's progress thread sleeps between polls; unset: NIXL's 0, "
            "which busy-spins a core per engine (use 100 on CPU-only hosts)"
        ),
    ] = None
    ucx_error_handling: Annotated[
        Literal["peer", "none"] | None,
        msgspec.Meta(
            description="UCX error handling of the NIXL agent (ucx_error_handling_mode); unset: NIXL's peer, "
            "whose tcp wire-up makes a new pair's first transfer wait for the idle prefill instance; none: "
            "shared memory between engines on one host, a dead peer shows as failed reads (UCX only); across "
            "hosts UCX uses tcp in either mode, and a cut link holds a read until it is back in both"
        ),
    ] = None
    handshake_tries: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        msgspec.Meta(
            description=f"how many times a worker asks a peer's side channel for its NIXL metadata, each "
            f"waiting vLLM's {HANDSHAKE_TRY_S} s, before the requests waiting on that peer fail; unset: vLLM's "
            "one try"
        ),
    ] = None
    enforce_handshake_compat: Annotated[
        bool | None,
        msgspec.Meta(description="refuse peers with a different model/config hash (True)"),
    ] = None
    bidirectional: Annotated[
        bool | None,
        msgspec.Meta(description="let the prefill instance read KV back from decode (bidirectional_kv_xfer, False)"),
    ] = None
    decoder_blocks_ttl: Annotated[
        _Seconds | None,
        msgspec.Meta(
            description="seconds decode keeps blocks for a bidirectional readback (decoder_kv_blocks_ttl, 480)"
        ),
    ] = None
    engine_ttl: Annotated[
        Annotated[float, msgspec.Meta(ge=0)] | None,
        msgspec.Meta(description="seconds before an idle remote engine is forgotten; 0 never (engine_ttl, 3600)"),
    ] = None
    push_registration_timeout: Annotated[
        _Seconds | None,
        msgspec.Meta(description="push mode: seconds decode waits for the prefill WRITE (default decoder_blocks_ttl)"),
    ] = None
    engine_id: Annotated[
        _NonEmpty | None,
        msgspec.Meta(description="this child's NIXL engine id; unset: the engine's"),
    ] = None
    key_env: Annotated[
        Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None,
        msgspec.Meta(
            description="the environment variable that holds the deployment key (one or more, comma-separated: "
            "the first signs, all verify); the key itself never goes in the file"
        ),
    ] = None
    key_file: Annotated[
        _NonEmpty | None,
        msgspec.Meta(description="a file that holds the deployment key (one or more, one a line), instead of key_env"),
    ] = None
    accept_unsigned: Annotated[
        bool | None,
        msgspec.Meta(
            description="a decode with a key also takes params and agent metadata no key signed: prefill instances "
            "that cannot sign (vLLM's own NixlConnector); false"
        ),
    ] = None
    peers: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1)]] | None,
        msgspec.Meta(
            description="side channels a decode may connect to: addresses, networks or host names, each with an "
            "optional port or range (10.0.0.0/8, 10.1.2.3:5600, [fd00::1]:5600-5607); unset: those a valid "
            "signature names with a key, loopback without"
        ),
    ] = None
    insecure_side_channel: Annotated[
        bool | None,
        msgspec.Meta(
            description="without a key, let the side channel bind beyond loopback all the same: its NIXL agent "
            "metadata goes out in clear, and any host that reaches it can read this engine's KV (measurements on a "
            "network nothing else reaches); false: refused"
        ),
    ] = None


#: What a pull-mode consumer does about the prefill's lease (kvcompose_nixl.lease).
LEASE_CHECK = (
    "lease: a read that ends after the prefill's lease on its blocks is refused (recomputed, or failed under "
    "load_failure: fail)"
)
#: What it does with params no lease was stamped on: only where it takes unsigned params.
LEASE_UNSTAMPED = (
    "lease: params with no lease stamped (a prefill running vLLM's own NixlConnector, taken unsigned) are read "
    "without the lease check, as vLLM reads them"
)


def _lease_lines(o: NixlOptions) -> list[str]:
    """The lease facts of a pull-mode consumer; a keyed one refuses unstamped (unsigned) params."""
    unsigned_taken = _key_source(o) is None or bool(o.accept_unsigned)
    return [LEASE_CHECK, *([LEASE_UNSTAMPED] if unsigned_taken else [])]


#: What no option here protects (docs/security.md).
NOT_PROTECTED = (
    "not protected: NIXL's own traffic (the reads and notifications) is neither authenticated nor encrypted: "
    "keep it on a network only these engines reach (docs/security.md)"
)


def _key_source(o: NixlOptions) -> str | None:
    if o.key_env:
        return f"${o.key_env}"
    return o.key_file


def _trust_lines(o: NixlOptions, role: str | None) -> list[str]:
    """What this child authenticates and what it does not, one fact a line."""
    key = _key_source(o)
    lines = []
    if role != "producer" and o.mode == "pull":
        lines.append(
            "params: checked before vLLM reads them (types, ranges, blocks against the prompt); a malformed set is "
            "dropped and nothing read"
        )
        if key is None:
            lines.append(
                "params: not authenticated (no key): a client that reaches this engine's API chooses which blocks of "
                "a peer it reads"
            )
        elif o.accept_unsigned:
            lines.append(
                f"params: signed ones must verify with the key in {key}; unsigned ones are taken too "
                "(accept_unsigned), from the peers below"
            )
        else:
            lines.append(
                f"params: only those a prefill signed with the key in {key}, for this prompt, unexpired and "
                "unused; any other set is dropped and nothing read"
            )
        lines.append(
            "params refused: nothing connected to or read; the prompt is computed here (or the request fails under "
            "load_failure: fail)"
        )
        if o.peers is not None:
            lines.append("peers: connects only to side channels in " + ", ".join(o.peers))
        elif key is not None:
            lines.append(
                "peers: connects only to the side channel a valid signature names"
                + ("; unsigned params: loopback only" if o.accept_unsigned else "")
            )
        else:
            lines.append("peers: connects only to side channels on loopback (no key, no peers)")
    if role != "consumer" and key is not None:
        lines.append(f"signs: the P/D params it returns, with the key in {key}, bound to the prompt and the lease")
    if key is not None:
        lines.append(
            f"agent metadata: sealed with the key in {key} on the side channel; peers' metadata loaded only if it "
            "opens with it" + (" or is unsealed (accept_unsigned)" if o.accept_unsigned else "")
        )
    else:
        lines.append(
            "agent metadata: in clear on the side channel (no key): whoever reaches it can read this engine's KV"
        )
    lines.append(NOT_PROTECTED)
    return lines


def _lease_trade(o: NixlOptions, role: str | None) -> str:
    """What a lease other than vLLM's default buys and costs, for the side that holds blocks."""
    if o.lease_seconds is None or role == "consumer":
        return ""
    if o.lease_seconds >= DEFAULT_LEASE_SECONDS:
        return (
            f"; a decode instance that dies holds this instance's blocks for its requests up to {o.lease_seconds} s "
            "(docs/performance.md 5g: what that costs the other requests)"
        )
    return (
        f"; the {o.lease_seconds} s lease, shorter than vLLM's {DEFAULT_LEASE_SECONDS} s, frees a dead decode "
        "instance's blocks sooner, but a decode instance that has not read them within it (a first handshake, a "
        "stalled step, heartbeats further apart than 2/3 of it: a decode sends one every lease_seconds/6 of its "
        "own setting, so give the decode instances the same lease_seconds) finds them freed and recomputes the "
        "prompt, or fails it under kv_load_failure_policy: fail"
    )


def _transport(o: NixlOptions) -> str:
    errors = "" if o.ucx_error_handling is None else f"; UCX error handling {o.ucx_error_handling}"
    return "over NIXL (" + ", ".join(o.backends) + errors + ")"


def _into(o: NixlOptions) -> str:
    """Where received KV lands, in words (vLLM: base_worker.py use_host_buffer / memory type)."""
    if o.buffer_device is None:
        return "straight into its KV cache (GPUDirect into VRAM on GPUs, DRAM on the CPU platform)"
    if o.buffer_device in ("cuda", "xpu"):
        return "GPUDirect into VRAM"
    if o.buffer_device == "cpu":
        return (
            "into a host buffer, then host-to-device copies on a cuda/xpu/tpu platform "
            "(on the CPU platform the KV cache is that host memory)"
        )
    return "into a tpu buffer (only with a platform plugin that supports one)"


def _out_of(o: NixlOptions) -> str:
    """Where served KV is read from, in words."""
    if o.buffer_device == "cpu":
        return (
            ", staged by device-to-host copies into a host buffer on a cuda/xpu/tpu platform (none on the CPU platform)"
        )
    if o.buffer_device in ("cuda", "xpu"):
        return ", read GPUDirect from VRAM"
    return ""


def _side_channel(o: NixlOptions) -> str:
    host = o.side_channel_host or f"$VLLM_NIXL_SIDE_CHANNEL_HOST ({env_side_channel_host()})"
    port = o.side_channel_port or f"$VLLM_NIXL_SIDE_CHANNEL_PORT ({DEFAULT_SIDE_CHANNEL_PORT})"
    reach = reach_of(o.side_channel_host or env_side_channel_host())
    if o.side_channel_host is not None and reach != LOOPBACK:
        reach += ", as side_channel_host asks"
    return f"side channel: {host}:{port} + data-parallel index ({reach})"


def _side_channel_brief(o: NixlOptions) -> list[str]:
    """``check``'s side-channel lines: where it binds, and which of it the environment chose."""
    host = o.side_channel_host or env_side_channel_host()
    port = o.side_channel_port or env_side_channel_port()
    reach = LOOPBACK if reach_of(host) == LOOPBACK else "beyond loopback"
    lines = [f"side channel: {host}:{port} + data-parallel rank ({reach})"]
    if o.side_channel_host is None:
        both = " and _PORT" if o.side_channel_port is None else ""
        lines.append(f"side channel set by ${ENV_SIDE_CHANNEL_HOST}{both}")
    elif o.side_channel_port is None:
        lines.append(f"side channel port set by ${ENV_SIDE_CHANNEL_PORT}")
    return lines


def _trust_brief(o: NixlOptions, role: str | None) -> list[str]:
    """``check``'s trust lines: one short fact each; :func:`_trust_lines` says them in full."""
    key = _key_source(o)
    lines = []
    if role != "producer" and o.mode == "pull":
        if key is None:
            lines.append("params: not signed (no key): a client of this API picks which peer blocks it reads")
        elif o.accept_unsigned:
            lines.append(f"params: signed ones verified with {key}; unsigned ones taken too (accept_unsigned)")
        else:
            lines.append(f"params: only those signed with {key} for this prompt, unexpired and unused")
        lines.append("params malformed or refused: nothing read; the prompt is computed here")
        if o.peers is not None:
            lines.append("peers: only side channels in " + ", ".join(o.peers))
        elif key is not None:
            lines.append("peers: only the side channel a valid signature names")
        else:
            lines.append("peers: loopback only (no key, no peers)")
        lines.append("lease: a read that ends after the prefill's lease on its blocks is refused")
    if role != "consumer" and key is not None:
        lines.append(f"signs: its P/D params with {key}, bound to the prompt and the lease")
    if key is not None:
        unsealed = "; unsealed ones taken (accept_unsigned)" if o.accept_unsigned else ""
        lines.append(f"agent metadata: sealed with {key}{unsealed}")
    else:
        lines.append("agent metadata: in clear on the side channel (no key)")
    lines.append("not protected: NIXL's reads and notifications (docs/security.md)")
    return lines


LOOPBACK = "loopback only"
#: The environment variables vLLM's NIXL scheduler binds to when the composition names no host / port.
ENV_SIDE_CHANNEL_HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
ENV_SIDE_CHANNEL_PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
#: What check and the engine advise for a keyless side channel beyond loopback (docs/deploy.md's setup).
EXPOSED_ADVICE = (
    "across hosts: name the deployment key on every nixl child (key_env: KVCOMPOSE_PD_KEY, from a Secret), "
    "leave side_channel_host unset and set $VLLM_NIXL_SIDE_CHANNEL_HOST to the instance's own address, the pod "
    "IP (docs/deploy.md); on one host: side_channel_host: 127.0.0.1"
)


def env_side_channel_host() -> str:
    """What vLLM binds without ``side_channel_host``: the variable in this environment, else its default."""
    return os.environ.get(ENV_SIDE_CHANNEL_HOST) or DEFAULT_SIDE_CHANNEL_HOST


def env_side_channel_port() -> str:
    """The base port vLLM binds without ``side_channel_port``: the variable here, else its default."""
    return os.environ.get(ENV_SIDE_CHANNEL_PORT) or str(DEFAULT_SIDE_CHANNEL_PORT)


def exposure_refused(host: str | None, keyed: bool, insecure: bool) -> str | None:
    """Why a side channel bound to ``host`` (None: ``$VLLM_NIXL_SIDE_CHANNEL_HOST``'s) must not
    start, or None: beyond loopback without a key it hands out what reads this engine's KV.

    ``check`` calls it where it runs and the connector again in the engine's own environment.
    """
    bound = host or env_side_channel_host()
    reach = reach_of(bound)
    if keyed or insecure or reach == LOOPBACK:
        return None
    where = f"side_channel_host {bound}" if host else f"${ENV_SIDE_CHANNEL_HOST}={bound} (side_channel_host unset)"
    return (
        f"{where} binds the side channel to {reach}, and without a key it hands this engine's NIXL agent "
        "metadata (what reads its KV blocks) to any host that reaches it"
    )


def reach_of(host: str) -> str:
    """Who can reach a listener bound to ``host``, in words: loopback, every interface, or one."""
    name = host.strip("[]").lower()
    if name in ("", "*"):
        return "all interfaces"
    if name == "localhost" or name.endswith(".localhost"):
        return LOOPBACK
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return f"the interface the name {host} resolves to at engine start"
    if address.is_loopback:
        return LOOPBACK
    if address.is_unspecified:
        return "all interfaces"
    return f"the interface with address {host}"


class NixlType(ConnectorType):
    """vLLM's NixlConnector (pull) or NixlPushConnector (push) as a composition child."""

    name: ClassVar[str] = "nixl"
    summary: ClassVar[str] = "P/D disaggregation: KV moves between engines over NIXL (vLLM's NixlConnector)"
    options: ClassVar[type[Options]] = NixlOptions
    # The NIXL worker publishes agent metadata that the scheduler serves on its side channel.
    owns_handshake: ClassVar[bool] = True
    # vLLM hands the host<->device copy op to the NIXL worker (set_host_xfer_buffer_ops).
    owns_host_buffer_ops: ClassVar[bool] = True
    pd_transport: ClassVar[bool] = True
    # The connector loads only the blocks of its range (kvcompose_nixl.connector, range loads).
    range_loads: ClassVar[bool] = True
    # vLLM's NIXL classes (pull and push) move KV per request, not per layer: these are empty bodies.
    empty_calls: ClassVar[frozenset[str]] = frozenset(
        {
            "wait_for_layer_load",
            "save_kv_layer",
            "finish_forward",
            "reset_capture_state",
            "handle_preemptions",
            "get_mem_pool_context",
            "get_kv_connector_kv_cache_events",
            "build_connector_worker_meta",
            "bind_gpu_block_pool",
        }
    )
    param_keys: ClassVar[frozenset[str]] = PARAM_KEYS
    vllm_connector: ClassVar[str] = CONNECTOR_CLASS["pull"]
    vllm_module_path: ClassVar[str | None] = CONNECTOR_MODULE
    # ``backends`` defaults to vLLM's own ["UCX"], so like every unset option it is not rendered.
    extra_config_keys: ClassVar[Mapping[str, str]] = {
        "backends": "backends",
        "lease_seconds": "kv_lease_duration",
        "recompute_threshold": "kv_recompute_threshold",
        "num_threads": "num_threads",
        "enforce_handshake_compat": "enforce_handshake_compat",
        "bidirectional": "bidirectional_kv_xfer",
        "decoder_blocks_ttl": "decoder_kv_blocks_ttl",
        "engine_ttl": "engine_ttl",
        "push_registration_timeout": "push_registration_timeout",
        "side_channel_host": SIDE_CHANNEL_HOST_KEY,
        "side_channel_port": SIDE_CHANNEL_PORT_KEY,
        "progress_delay_us": PROGRESS_DELAY_KEY,
        "ucx_error_handling": UCX_ERROR_HANDLING_KEY,
        "handshake_tries": HANDSHAKE_TRIES_KEY,
        "key_env": KEY_ENV_KEY,
        "key_file": KEY_FILE_KEY,
        "accept_unsigned": ACCEPT_UNSIGNED_KEY,
        "peers": PEERS_KEY,
        "insecure_side_channel": INSECURE_SIDE_CHANNEL_KEY,
    }
    top_level_keys: ClassVar[Mapping[str, str]] = {"buffer_device": "kv_buffer_device", "engine_id": "engine_id"}

    def connector_name(self, child: Child) -> str:
        """``mode`` picks the class: pull is NixlConnector, push is NixlPushConnector."""
        return CONNECTOR_CLASS[child.options_as(NixlOptions).mode]

    def options_from_vllm(self, config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The options of a NIXL entry of a MultiConnector config; its class name gives ``mode``."""
        mode = MODE_OF_CLASS.get(config.get("kv_connector", ""))
        options = None if mode is None else self.options_from_keys(config)
        if options is not None and mode != "pull":
            options["mode"] = mode
        return options

    def describe(self, child: Child) -> str:
        """What the child does for its role, in one or two plain sentences."""
        o = child.options_as(NixlOptions)
        lease = o.lease_seconds or DEFAULT_LEASE_SECONDS
        if o.mode == "pull":
            consume = (
                f"pulls prompt KV from the prefill instance {_transport(o)}, {_into(o)}; "
                "a request that arrives with no remote blocks is computed locally\n" + "\n".join(_lease_lines(o))
            )
            produce = (
                f"serves its prompt KV to decode instances {_transport(o)}{_out_of(o)}; "
                "returns the P/D kv_transfer_params; holds blocks until read or the "
                f"{lease} s lease expires"
            )
        else:
            consume = (
                "registers its blocks with the prefill instance, which writes the prompt KV "
                f"into them {_transport(o)}, {_into(o)}"
            )
            produce = (
                f"writes its prompt KV into the decode instances' registered blocks {_transport(o)}"
                f"{_out_of(o)}; returns the P/D kv_transfer_params; holds blocks until written "
                f"or the {lease} s lease expires"
            )
        if child.role == "consumer":
            text = consume
        elif child.role == "producer":
            text = produce
        else:
            text = f"{produce}; and {consume} (vLLM deprecates kv_both for NIXL)"
        if o.bidirectional:
            text += "; the prefill instance may read KV back from decode (bidirectional)"
        text += _lease_trade(o, child.role)
        tries = ""
        if o.handshake_tries is not None:
            tries = f"; a peer's side channel is asked up to {o.handshake_tries} times, {HANDSHAKE_TRY_S} s each"
        return "\n".join([text, _side_channel(o) + tries, *_trust_lines(o, child.role)])

    def brief(self, child: Child) -> str:
        """What ``check`` prints: one short fact a line (:meth:`describe` has them in full)."""
        o = child.options_as(NixlOptions)
        transport = "over NIXL (" + ", ".join(o.backends) + ")"
        into = {None: "into its KV cache", "cuda": "into VRAM", "xpu": "into VRAM", "cpu": "through a host buffer"}
        if o.mode == "pull":
            consume = f"pulls prompt KV from the prefill {transport}, {into.get(o.buffer_device, 'into a tpu buffer')}"
            lease = o.lease_seconds or DEFAULT_LEASE_SECONDS
            produce = f"serves prompt KV to decodes {transport}; unread blocks held {lease} s"
        else:
            consume = f"registers its blocks; the prefill writes prompt KV into them {transport}"
            produce = f"writes prompt KV into the decodes' registered blocks {transport}"
        if child.role == "consumer":
            first = consume
        elif child.role == "producer":
            first = produce
        else:
            first = f"serves and pulls prompt KV {transport} (vLLM deprecates kv_both for NIXL)"
        lines = [first]
        if o.lease_seconds is not None and child.role != "consumer":
            lines.append(f"lease: {o.lease_seconds} s, not vLLM's {DEFAULT_LEASE_SECONDS} s: give decodes the same")
        if o.bidirectional:
            lines.append("bidirectional: the prefill may read KV back from the decode")
        if o.handshake_tries is not None:
            lines.append(f"handshake: up to {o.handshake_tries} tries of {HANDSHAKE_TRY_S} s each")
        return "\n".join([*lines, *_side_channel_brief(o), *_trust_brief(o, child.role)])

    def save_hooks_needed(self, child: Child) -> str | None:
        """A producer with a host buffer: NixlConnector copies the served KV there in ``wait_for_save``."""
        if child.options_as(NixlOptions).buffer_device != "cpu" or child.role == "consumer":
            return None
        return (
            "serves KV from a host buffer (buffer_device: cpu), which NixlConnector fills in its "
            "wait_for_save (save_kv_to_host); decode instances would read stale KV"
        )

    def check(self, child: Child, plan: Plan) -> Iterator[Problem]:
        """What vLLM would refuse, or silently ignore, in this child's options."""
        o = child.options_as(NixlOptions)
        at = ("connectors", child.index, "options")
        if o.mode == "push" and o.bidirectional:
            yield Problem(
                "push mode does not support bidirectional KV transfer "
                "(vLLM's NixlPushConnectorScheduler raises NotImplementedError)",
                at + ("bidirectional",),
                "drop `bidirectional` or use `mode: pull`",
            )
        if o.mode == "pull" and o.push_registration_timeout is not None:
            yield Problem(
                "push_registration_timeout only applies to `mode: push`",
                at + ("push_registration_timeout",),
                "remove it, or set `mode: push`",
            )
        seen: set[str] = set()
        for i, b in enumerate(o.backends):
            if b in seen:
                yield Problem(f"backend {b!r} is listed twice", at + ("backends", i))
            seen.add(b)
        if not seen & NETWORK_BACKENDS:
            yield Problem(
                "no backend here moves data between engines: " + ", ".join(o.backends) + " are storage plugins",
                at + ("backends",),
                "add a network backend, e.g. UCX: backends: [UCX, ...]",
            )
        if o.num_threads is not None and any(b != "UCX" for b in o.backends):
            # base_worker.py builds nixl_agent_config(num_threads=...) only for UCX-only agents.
            yield Problem(
                "num_threads only takes effect when backends is [UCX]; vLLM ignores it here",
                at + ("num_threads",),
                "remove num_threads, or use backends: [UCX]",
            )
        if o.ucx_error_handling is not None and "UCX" not in o.backends:
            yield Problem(
                "ucx_error_handling sets the UCX backend, and backends has no UCX",
                at + ("ucx_error_handling",),
                "remove ucx_error_handling, or add UCX to backends",
            )
        if o.handshake_tries is not None and o.handshake_tries * HANDSHAKE_TRY_S >= DEFAULT_LEASE_SECONDS:
            yield Problem(
                f"{o.handshake_tries} handshake tries of {HANDSHAKE_TRY_S} s outlast the {DEFAULT_LEASE_SECONDS} s a "
                "prefill instance with vLLM's default lease holds a request's blocks: a handshake answered "
                "after it reads blocks the prefill instance may already have freed and reused",
                at + ("handshake_tries",),
                f"use at most {(DEFAULT_LEASE_SECONDS - 1) // HANDSHAKE_TRY_S} tries, or make sure every prefill "
                "instance's lease_seconds is longer",
                warning=True,
            )
        yield from self._exposed(o, at)
        yield from self._trust(o, child.role, at)

    def _trust(self, o: NixlOptions, role: str | None, at: tuple[str | int, ...]) -> Iterator[Problem]:
        """A key named twice or that cannot be read here, a peer that does not parse, and
        unsigned params taken."""
        if o.key_env and o.key_file:
            yield Problem("key_env and key_file both name the key", at + ("key_file",), "keep one of them")
        for i, entry in enumerate(o.peers or ()):
            try:
                Peers.parse([entry])
            except TrustConfigError as exc:
                yield Problem(str(exc), at + ("peers", i))
        key = _key_source(o)
        if key is not None and not (o.key_env and o.key_file):
            try:
                Keyring.load(o.key_env, o.key_file)
            except TrustConfigError as exc:
                yield Problem(
                    f"{exc}: an engine started in this environment stops at start",
                    at + ("key_env" if o.key_env else "key_file",),
                    "give every engine of the deployment the same key (`openssl rand -hex 32`), e.g. from a "
                    "Kubernetes Secret",
                    warning=True,
                )
        if o.accept_unsigned and key is None:
            yield Problem(
                "accept_unsigned without a key changes nothing: without a key every set of params is unsigned",
                at + ("accept_unsigned",),
                "remove it, or name a key",
                warning=True,
            )
        elif o.accept_unsigned and role != "producer":
            yield Problem(
                "accept_unsigned: this decode also takes params no prefill signed, so a client that reaches its API "
                "chooses which blocks of a peer it reads ("
                + ("the peers listed" if o.peers else "loopback only")
                + ")",
                at + ("accept_unsigned",),
                "once every prefill instance signs (this nixl type with the key), remove it",
                warning=True,
            )

    def _exposed(self, o: NixlOptions, at: tuple[str | int, ...]) -> Iterator[Problem]:
        """A side channel reachable from other hosts without a key: refused, whether the file
        writes ``side_channel_host`` or leaves it to ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` (here; the
        engine checks its own environment again at start), unless ``insecure_side_channel``.

        With a key it is docs/deploy.md's setup (the host from the environment, the metadata
        sealed): nothing to say.
        """
        key = _key_source(o)
        host = o.side_channel_host or env_side_channel_host()
        if key is not None:
            if o.insecure_side_channel:
                yield Problem(
                    "insecure_side_channel changes nothing with a key: the agent metadata is sealed",
                    at + ("insecure_side_channel",),
                    "remove it",
                    warning=True,
                )
            return
        why = exposure_refused(o.side_channel_host, keyed=False, insecure=bool(o.insecure_side_channel))
        if why is not None:
            # An unset host is not in the file: located at the options.
            yield Problem(why, at + ("side_channel_host",), EXPOSED_ADVICE)
        elif o.insecure_side_channel and reach_of(host) != LOOPBACK:
            yield Problem(
                f"insecure_side_channel: the side channel on {host} is beyond loopback without a key; any host "
                "that reaches it can read this engine's KV",
                at + ("insecure_side_channel",),
                "only on a network nothing else reaches (a measurement); name a key for anything else",
                warning=True,
            )

    def listeners(self, child: Child) -> Iterator[Listener]:
        """The side channel's listener (vLLM binds base port + data-parallel index); kvcompose
        refuses a composition in which another child's listener takes the same port."""
        o = child.options_as(NixlOptions)
        env_port = os.environ.get(ENV_SIDE_CHANNEL_PORT)
        yield Listener(
            what="NIXL side channel",
            host=o.side_channel_host or env_side_channel_host(),
            port=o.side_channel_port or int(env_side_channel_port()),
            set_by="its side_channel_port"
            if o.side_channel_port
            else f"${ENV_SIDE_CHANNEL_PORT}" + ("" if env_port else "'s default"),
            path=("connectors", child.index, "options", "side_channel_port"),
        )

    def kv_layout(self, child: Child) -> str | None:
        """None: NIXL's layout depends on the model, which a composition does not know.

        vLLM's ``NixlConnector.get_required_kvcache_layout`` returns ``"LBHNC"`` for every model
        except MLA ones, where it returns None ("the layout should not matter"). Claiming
        ``LBHNC`` here would report a false conflict for an MLA model composed with a connector
        that needs another layout (HiSparse needs ``BLHNC``); the composed connector must ask
        the vLLM class with the real ``VllmConfig`` at engine start instead.
        """
        return None


@hookimpl
def kvcompose_connector_types() -> list[ConnectorType]:
    """Contribute the ``nixl`` connector type."""
    return [NixlType()]
