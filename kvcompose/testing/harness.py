"""A real vLLM ``Scheduler`` on CPU, built from a KV-transfer config, with no network and no weights.

The scheduler role of a connector needs neither NIXL nor model weights, so these builders give a
test the exact code path an engine runs: ``schedule()`` -> connector -> ``update_from_output()``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcompose.compose import load, loads
from kvcompose.plugins import Plugins

# Importable from here, where tests have always found it (it lives with the KV cache builders).
from kvcompose.testing.kv import TINY_MODEL as TINY_MODEL
from kvcompose.testing.kv import make_engine_kv
from kvcompose.testing.kv import make_vllm_config as make_vllm_config
from kvcompose.vllm.args import CHILDREN_KEY, CONNECTOR_NAME, MODULE, kv_transfer_config

EOS_TOKEN_ID = 2

_ids = itertools.count()
_hash_ready = False


def make_kv_cache_config(
    num_blocks: int = 100,
    *,
    block_size: int = 16,
    num_kv_heads: int = 1,
    head_size: int = 16,
    dtype: torch.dtype = torch.float16,
    sliding_window: int | None = None,
    num_layers: int = 2,
) -> KVCacheConfig:
    """A KV cache config of real shape, laid out by vLLM (no tensors allocated).

    A full-attention group of ``num_layers`` layers, plus an overlaid sliding-window group if
    asked; see :func:`kvcompose.testing.kv.make_engine_kv` for the tensors too.
    """
    return make_engine_kv(
        num_layers=num_layers,
        block_size=block_size,
        num_blocks=num_blocks,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        sliding_window=sliding_window,
        allocate=False,
    ).kv_cache_config


def make_scheduler(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None = None) -> Scheduler:
    """vLLM's own ``Scheduler`` (scheduler role connector only: no worker, no NIXL agent)."""
    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(block_size=vllm_config.cache_config.block_size)
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        log_stats=True,
    )


def yaml_kv_transfer_config(source: str | Path, plugins: Plugins | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` that ``kvcompose vllm-args`` renders for a composition.

    ``source`` is YAML text, or a path to a YAML file (a ``Path``, or a one-line string naming
    an existing ``.yaml``/``.yml`` file).
    """
    if isinstance(source, Path) or ("\n" not in source and source.endswith((".yaml", ".yml"))):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"composition file {path} does not exist")
        return kv_transfer_config(load(path, plugins))
    return kv_transfer_config(loads(source, plugins))


def scheduler_for(
    kv_transfer_config: dict[str, Any] | KVTransferConfig | None,
    *,
    num_blocks: int = 100,
    block_size: int = 16,
    sliding_window: int | None = None,
    **cfg: Any,
) -> Scheduler:
    """vLLM's ``Scheduler`` around the connector of any ``kv_transfer_config`` vLLM accepts.

    A plain connector (vLLM's ``NixlConnector``, a plugin's class through
    ``kv_connector_module_path``) or a rendered composition; ``cfg`` goes to
    :func:`make_vllm_config` (``data_parallel_index``, ``max_num_seqs``, ...). The KV cache has
    ``num_blocks`` blocks, plus an overlaid sliding-window group with ``sliding_window``.
    """
    vllm_config = make_vllm_config(kv_transfer_config, block_size=block_size, **cfg)
    return make_scheduler(
        vllm_config, make_kv_cache_config(num_blocks, block_size=block_size, sliding_window=sliding_window)
    )


def multiconnector_config(*entries: dict[str, Any], kv_role: str = "kv_both") -> dict[str, Any]:
    """vLLM's MultiConnector config over ``entries`` (see :func:`connector_entry`), loaded as kvcompose's
    composite: what a drop-in deployment passes (``docs/migrating.md``), no ``kvcompose`` entry."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": {CHILDREN_KEY: list(entries)},
    }


def connector_entry(kv_connector: str, kv_role: str = "kv_both", /, **extra_config: Any) -> dict[str, Any]:
    """One child of a MultiConnector config, its ``kv_connector_extra_config`` from the keywords."""
    entry: dict[str, Any] = {"kv_connector": kv_connector, "kv_role": kv_role}
    if extra_config:
        entry["kv_connector_extra_config"] = extra_config
    return entry


def scheduler_from_yaml(
    source: str | Path,
    *,
    plugins: Plugins | None = None,
    **kw: Any,
) -> Scheduler:
    """vLLM's ``Scheduler`` around the composed connector of a composition (YAML text or file).

    ``kw`` as :func:`scheduler_for` (``num_blocks=100``, ``block_size=16``,
    ``sliding_window=None``, and :func:`make_vllm_config`'s keywords); the composed connector is
    ``scheduler.connector``.
    """
    return scheduler_for(yaml_kv_transfer_config(source, plugins), **kw)


def make_request(
    num_tokens: int = 64,
    *,
    block_size: int = 16,
    request_id: str | None = None,
    prompt: Sequence[int] | None = None,
    max_tokens: int = 16,
    kv_transfer_params: dict[str, Any] | None = None,
) -> Request:
    """A token-id request with prefix hashing, as the engine front end builds it."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    request_id = request_id or f"req-{next(_ids)}"
    tokens = list(prompt) if prompt is not None else [3 + (i * 7) % 500 for i in range(num_tokens)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    # The front end reads EOS from the tokenizer; there is none here (skip_tokenizer_init).
    params._eos_token_id = EOS_TOKEN_ID
    if kv_transfer_params is not None:
        params.extra_args = {"kv_transfer_params": kv_transfer_params}
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def prefill_request(num_tokens: int = 64, **kw: Any) -> Request:
    """A request sent to the prefill instance by a P/D proxy (``do_remote_decode``, 1 token)."""
    return make_request(
        num_tokens,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
        **kw,
    )


def decode_request(
    num_tokens: int = 64,
    *,
    block_size: int = 16,
    remote_block_ids: list[int] | None = None,
    remote_engine_id: str = "prefill-engine",
    remote_host: str = "127.0.0.1",
    remote_port: int = 5600,
    **kw: Any,
) -> Request:
    """A request sent to the decode instance with the params a prefill instance returned (vLLM's
    ``request_finished``: ``remote_num_tokens`` counts the tokens its blocks hold)."""
    if remote_block_ids is None:
        remote_block_ids = list(range(-(-num_tokens // block_size)))
    rid = kw.pop("request_id", None) or f"req-{next(_ids)}"
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": remote_engine_id,
        "remote_request_id": f"prefill-{rid}",
        "remote_block_ids": remote_block_ids,
        "remote_host": remote_host,
        "remote_port": remote_port,
        "tp_size": 1,
        "remote_num_tokens": num_tokens if remote_block_ids else 0,
    }
    return make_request(num_tokens, block_size=block_size, request_id=rid, kv_transfer_params=params, **kw)


def model_runner_output(
    requests: Iterable[Request],
    *,
    token_id: int = 100,
    eos: bool = False,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    worker_meta: Any = None,
    kv_cache_events: Any = None,
    stats: Any = None,
) -> ModelRunnerOutput:
    """What a worker returns for one step: one sampled token per running request, plus KV results."""
    reqs = list(requests)
    sampled = [[EOS_TOKEN_ID if eos else token_id] for _ in reqs]
    kv_out = None
    if any(
        x is not None
        for x in (
            finished_sending,
            finished_recving,
            failed_recving,
            invalid_block_ids,
            worker_meta,
            kv_cache_events,
            stats,
        )
    ):
        kv_out = KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            failed_recving=failed_recving or set(),
            invalid_block_ids=invalid_block_ids or set(),
            kv_connector_worker_meta=worker_meta,
            kv_cache_events=kv_cache_events,
            kv_connector_stats=stats,
        )
    return ModelRunnerOutput(
        req_ids=[r.request_id for r in reqs],
        req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv_out,
    )


def step(scheduler: Scheduler, *, eos: bool = False, **kv: Any) -> tuple[Any, Any]:
    """One engine step: ``schedule()``, then the worker's output for what was scheduled."""
    out = scheduler.schedule()
    running = [scheduler.requests[r] for r in out.num_scheduled_tokens]
    eco = scheduler.update_from_output(out, model_runner_output(running, eos=eos, **kv))
    return out, eco


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request, no held block, no connector state left: what a finished test must leave."""
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert not scheduler.waiting and not scheduler.running
    assert not scheduler.finished_recving_kv_req_ids
    pool = scheduler.kv_cache_manager.block_pool
    # Every block but the null block is free again (cached blocks count as free).
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, (
        f"leaked blocks: {pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()}"
    )
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        assert not manager.req_to_blocks, f"blocks still owned: {list(manager.req_to_blocks)}"
