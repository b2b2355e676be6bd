"""What one engine runs (:class:`EngineSpec`): the model, the engine settings and the connector
composition, rendered the way ``kvcompose vllm-args`` renders it."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcompose_tools.e2e.affinity import OMP_BIND_ENV

if TYPE_CHECKING:
    from kvcompose.catalog import Plan
    from kvcompose_tools.e2e.hosts import Host

#: vLLM block size the nodes use; the tiny model's KV block is 32 KiB at this size.
BLOCK_SIZE = 32
MAX_MODEL_LEN = 1024
#: Environment every engine gets: a 1 GiB KV budget; one reserved core so the worker's OMP
#: thread count, and thus float rounding, does not change with the connector; and no
#: torch.compile, whose lazy logprobs compile would land in the first request
#: (docs/e2e.md, "Settings that matter on CPU-only hosts").
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "TORCHDYNAMO_DISABLE": "1"}


#: The variable the shipped examples' nixl children read their deployment key from (``key_env``).
PD_KEY_ENV = "KVCOMPOSE_PD_KEY"


def deployment_key() -> str:
    """The deployment key of the engines this process starts: ``$KVCOMPOSE_PD_KEY``, or else a
    fresh one, set there so that every engine (and connector) of this process shares it."""
    key = os.environ.get(PD_KEY_ENV)
    if not key:
        key = os.environ[PD_KEY_ENV] = secrets.token_hex(32)
    return key


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for an engine process: :data:`ENGINE_ENV` on top, the
    deployment key (:func:`deployment_key`), and no inherited NIXL side-channel variables (each
    engine gets its port from its composition)."""
    deployment_key()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NIXL_SIDE_CHANNEL")}
    env.update(ENGINE_ENV)
    env.update(extra or {})
    return env


@dataclass
class EngineSpec:
    """What one engine process runs.

    ``composition`` is a kvcompose YAML file (``None``: no connector, a baseline engine).
    ``side_channel_port`` and ``nixl_options`` override the ``nixl`` children's options, so that
    a shipped example can run with a free port or with the handshake check off. ``kv_config`` is a
    ``KVTransferConfig`` as is, instead of a composition (a benchmark's bare-connector baseline).
    """

    name: str
    model: str
    composition: str | None = None
    side_channel_port: int | None = None
    nixl_options: dict[str, Any] = field(default_factory=dict)
    #: vLLM's ``kv_load_failure_policy``: "fail" (vLLM's default) or "recompute".
    kv_load_failure_policy: str | None = None
    num_gpu_blocks: int = 256
    seed: int = 0
    kv_config: dict[str, Any] | None = None
    #: vLLM's ``KVEventsConfig`` as a dict (:func:`kvcompose_tools.e2e.events.kv_events_config`): the
    #: engine publishes its KV cache events, the connector's included.
    kv_events: dict[str, Any] | None = None
    #: Tensor-parallel workers (one process each). On vLLM's CPU platform TP > 1 also needs each
    #: worker's OpenMP threads bound to cores of its own: :meth:`env`.
    tensor_parallel_size: int = 1
    #: The context vLLM gives the model (the tiny model's tests are sized for 1,024 tokens).
    max_model_len: int = MAX_MODEL_LEN
    #: Tokens per KV block (vllm-router 0.1.17's P/D ``kv_aware`` indexes 16-token blocks only).
    block_size: int = BLOCK_SIZE
    #: The server maps a router's ``x-kv-cache-source-host-port`` onto ``remote_kv_source``
    #: (:func:`kvcompose.serving.server_args`).
    source_header: bool = False

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The ``KVTransferConfig`` kwargs: ``kv_config``, or the composition's with this spec's
        overrides."""
        if self.kv_config is not None:
            return dict(self.kv_config)
        if self.composition is None:
            return None
        return composed_kv_transfer_config(
            Path(self.composition), self.side_channel_port, self.nixl_options, self.kv_load_failure_policy
        )

    def llm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments (the same engine settings the HTTP servers get)."""
        return {
            # With the model's tokenizer: text prompts and chat work, and token-id prompts as before
            # (EOS is config.json's id either way).
            "model": self.model,
            "load_format": "safetensors",
            "dtype": "float32",
            "max_model_len": self.max_model_len,
            "enforce_eager": True,
            "block_size": self.block_size,
            "seed": self.seed,
            "num_gpu_blocks_override": self.num_gpu_blocks,
            "disable_log_stats": False,  # the Prometheus counters the checks read
            **({"kv_events_config": self.kv_events} if self.kv_events is not None else {}),
            **({"tensor_parallel_size": self.tensor_parallel_size} if self.tensor_parallel_size > 1 else {}),
        }

    def env(self) -> dict[str, str]:
        """Environment this engine needs beyond :data:`ENGINE_ENV`: with TP > 1, one core per
        worker (``VLLM_CPU_OMP_THREADS_BIND`` ``0|1|...``; vLLM's CPU default binds by NUMA node
        and leaves a 2-core host's second worker nothing)."""
        if self.tensor_parallel_size <= 1:
            return {}
        return {OMP_BIND_ENV: "|".join(str(i) for i in range(self.tensor_parallel_size))}


def placed(spec: EngineSpec, host: Host | None) -> EngineSpec:
    """``spec`` as it runs in ``host`` (:mod:`kvcompose_tools.e2e.hosts`): its ``nixl`` children's
    ``side_channel_host`` unset, unless the spec names one, so that the engine binds the host's
    address from ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` (:data:`~kvcompose_tools.e2e.hosts.NETWORK_ENV`), as
    a pod of ``deploy/kubernetes/`` binds its pod IP; as it is without a host."""
    if host is None:
        return spec
    # The shipped examples write 127.0.0.1: across hosts the address comes from the environment.
    return replace(spec, nixl_options={"side_channel_host": None, **spec.nixl_options})


def composed_kv_transfer_config(
    composition: Path,
    side_channel_port: int | None = None,
    nixl_options: dict[str, Any] | None = None,
    kv_load_failure_policy: str | None = None,
) -> dict[str, Any]:
    """What ``kvcompose vllm-args`` renders for ``composition``, with nixl option overrides."""
    from kvcompose.vllm.args import kv_transfer_config

    return kv_transfer_config(composed_plan(composition, side_channel_port, nixl_options, kv_load_failure_policy))


def composed_plan(
    composition: Path,
    side_channel_port: int | None = None,
    nixl_options: dict[str, Any] | None = None,
    load_failure: str | None = None,
) -> Plan:
    """The composition's :class:`~kvcompose.compose.Plan`, its ``nixl`` children's options
    overridden (a free side-channel port, the handshake check off, ...) and, when given, its
    ``load_failure`` (vLLM's ``kv_load_failure_policy``)."""
    from kvcompose.compose import build, load
    from kvcompose.config import from_builtins, to_builtins

    plan = load(composition)
    overrides = dict(nixl_options or {})
    if side_channel_port is not None:
        overrides["side_channel_port"] = side_channel_port
    if overrides or load_failure is not None:
        data = to_builtins(plan.composition)
        for child in data["connectors"]:
            if child["type"] == "nixl":
                child["options"] = {**child.get("options", {}), **overrides}
        if load_failure is not None:
            data["load_failure"] = load_failure
        plan = build(from_builtins(data, str(composition)))
    return plan
