"""The worker role of a connector over real CPU KV tensors, driven step by step without a model.

A :class:`WorkerHarness` builds the worker-role connector that vLLM's model runner would build —
the kvcompose composition from YAML, or any ``kv_transfer_config`` vLLM accepts (its own
``MultiConnector`` included) — registers engine-shaped KV caches with it (laid out by vLLM's
code, :mod:`kvcompose.testing.kv`) and replays the calls of one model-runner step in the order
vLLM 0.32 makes them (``KVConnectorModelRunnerMixin._get_kv_connector_output`` and the
per-layer ``maybe_transfer_kv_layer`` wrapper; ``handle_preemptions`` from ``execute_model``)::

    handle_preemptions(meta)            # every step, a preemption or not
    bind_connector_metadata(meta)
    start_load_kv(ctx)                  # here when the step has synchronous loads...
    for layer: wait_for_layer_load(layer); <attention writes KV>; save_kv_layer(layer, kv, attn)
    start_load_kv(ctx)                  # ...else here, after the forward
    wait_for_save()
    get_transfer_results(finished_req_ids), get_block_ids_with_load_errors(),
    get_kv_connector_stats(), get_kv_connector_kv_cache_events(), build_connector_worker_meta()
    clear_connector_metadata()

Example::

    from kvcompose.testing.worker import WorkerHarness

    h = WorkerHarness.from_yaml('''
    version: 1
    connectors:
      - {name: host, type: cpu-offload, options: {cpu_bytes: 16MiB}}
    ''', num_layers=32)
    meta = h.idle_metadata()          # what the scheduler sends on a step with nothing to move
    out = h.step(meta)                # one step's lifecycle; returns vLLM's KVConnectorOutput
    h.shutdown()

    # vLLM's own MultiConnector, driven the same way:
    h = WorkerHarness({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"connectors": [...]}}, num_layers=32)

With requests, pair the worker with the scheduler of the same configuration:
``h.scheduler.add_request(req)`` then ``h.engine_step()`` runs ``schedule()``, the worker step and
``update_from_output()``, as one engine step does. With ``write_blocks=True`` a stand-in forward
writes, into every block the step completes, bytes that depend on the block's token prefix, so a
block that comes back from another tier can be checked byte for byte::

    h.scheduler.add_request(make_request(prompt=tokens, block_size=16))
    h.engine_step(write_blocks=True)
    h.drain(write_blocks=True)           # until the connector has no store/push pending
    ...                                  # later, after a load into block ``b``:
    assert h.holds_prefix(b, tokens[:16])
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvcompose.testing import inspector
from kvcompose.testing.copy_op import CopyLog, record_receivers
from kvcompose.testing.kv import CPU_LAYOUT, EngineKV, make_engine_kv, pattern_for

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        CopyBlocksOp,
        KVConnectorBase_V1,
        KVConnectorMetadata,
    )
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput

    from kvcompose.plugins import Plugins

#: Called between ``wait_for_layer_load`` and ``save_kv_layer`` with the layer's name and KV
#: tensor: the place where a model's attention would write the step's new KV.
LayerWrite = Callable[[str, torch.Tensor], None]


def ensure_single_rank_distributed(vllm_config: VllmConfig) -> None:
    """A one-process tensor/pipeline-parallel world (gloo), as a single-GPU worker has.

    Workers of P/D connectors (NIXL) ask vLLM for their TP rank; outside an engine nobody has
    set that world up. Done once per process; a world set up by someone else is kept.
    """
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    with socket.socket() as sock:  # a free port for the one-member rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        ensure_model_parallel_initialized(1, 1)


def _vllm_copy_op() -> CopyBlocksOp:
    """The copy op vLLM's model runner hands to the connector (``copy_kv_blocks``)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks

    return copy_kv_blocks


class WorkerHarness:
    """A worker-role connector over engine-shaped CPU KV caches, and one step at a time.

    ``kv_transfer_config`` is what vLLM's ``--kv-transfer-config`` takes (dict or
    ``KVTransferConfig``); :meth:`from_yaml` renders it from a composition. The KV cache has
    ``num_layers`` full-attention layers of ``num_blocks`` blocks (block 0 is vLLM's null
    block), shaped for the kit's tiny model by default. With ``register`` (the default) the
    caches are registered and the host-buffer copy op is set, as the model runner does at start.
    Workers that check the attention kernel's block size (NIXL's) need ``block_size=32`` (a
    multiple of 32: vLLM's CPU attention backend); build requests with the same block size.

    ``platform`` is entered before the connector is built and left at :meth:`shutdown` (a
    stand-in for vLLM's platform, as the nixl plugin's ``host_buffer_setting()`` gives for vLLM's
    NIXL host-buffer path). ``copy_op`` is what :meth:`register` hands over (default vLLM's
    ``copy_kv_blocks``); with a :class:`~kvcompose.testing.copy_op.CopyLog`,
    :attr:`host_buffer_ops_to` names the connectors it was handed to. ``kv_events_config``: the
    engine publishes KV events (:func:`~kvcompose.testing.kv.make_vllm_config`).
    """

    def __init__(
        self,
        kv_transfer_config: dict[str, Any] | KVTransferConfig,
        *,
        num_layers: int = 2,
        num_blocks: int = 64,
        block_size: int = 16,
        num_kv_heads: int = 2,
        head_size: int = 32,
        dtype: torch.dtype = torch.float32,
        layout: str = CPU_LAYOUT,
        sliding_window: int | None = None,
        register: bool = True,
        platform: AbstractContextManager[Any] | None = None,
        copy_op: CopyBlocksOp | None = None,
        kv_events_config: dict[str, Any] | None = None,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvcompose.testing.harness import make_vllm_config

        vllm_config = make_vllm_config(kv_transfer_config, block_size=block_size, kv_events_config=kv_events_config)
        assert vllm_config.kv_transfer_config is not None
        #: The engine-shaped KV caches, their config and the ``VllmConfig`` they were made for.
        self.kv: EngineKV = make_engine_kv(
            num_layers=num_layers,
            block_size=block_size,
            num_blocks=num_blocks,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            layout=layout,
            sliding_window=sliding_window,
            vllm_config=vllm_config,
        )
        ensure_single_rank_distributed(vllm_config)
        # Open for the connectors' whole life: they read the platform again when they copy.
        self._platform = ExitStack()
        if platform is not None:
            self._platform.enter_context(platform)
        #: The copy op :meth:`register` hands over: vLLM's ``copy_kv_blocks`` unless given.
        self.copy_op: CopyBlocksOp = _vllm_copy_op() if copy_op is None else copy_op
        #: With a :class:`CopyLog`: the connectors (children, by name) the copy op was handed to.
        self.host_buffer_ops_to: list[str] | None = None
        cls = KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config)
        #: The worker-role connector under test.
        self.connector: KVConnectorBase_V1 = cls(vllm_config, KVConnectorRole.WORKER, self.kv.kv_cache_config)
        self._scheduler: Scheduler | None = None
        self._idle: KVConnectorMetadata | None = None
        #: The worker's ``KVConnectorOutput`` of the last :meth:`engine_step`.
        self.last_output: KVConnectorOutput | None = None
        if register:
            self.register()

    @classmethod
    def from_yaml(cls, source: str | Path, *, plugins: Plugins | None = None, **kw: Any) -> WorkerHarness:
        """The composed connector for a composition (YAML text or file); ``kw`` as the constructor."""
        from kvcompose.testing.harness import yaml_kv_transfer_config

        return cls(yaml_kv_transfer_config(source, plugins), **kw)

    # ------------------------------------------------------------------ accessors

    @property
    def vllm_config(self) -> VllmConfig:
        return self.kv.vllm_config

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return self.kv.kv_caches

    @property
    def layer_names(self) -> list[str]:
        return self.kv.layer_names

    def child(self, name: str) -> KVConnectorBase_V1:
        """A child connector: by composition name (kvcompose), or by class name (vLLM's MultiConnector)."""
        from kvcompose.vllm.connector import KVComposeConnector

        if isinstance(self.connector, KVComposeConnector):
            return inspector.child(self.connector, name)
        children = getattr(self.connector, "_connectors", [])
        found = [c for c in children if type(c).__name__ == name]
        if len(found) != 1:
            raise KeyError(f"no single child named {name!r}; children: {[type(c).__name__ for c in children]}")
        return found[0]

    @property
    def scheduler(self) -> Scheduler:
        """vLLM's ``Scheduler`` (scheduler-role connector) on this harness's configs, built on first use."""
        if self._scheduler is None:
            from kvcompose.testing.harness import make_scheduler

            self._scheduler = make_scheduler(self.vllm_config, self.kv.kv_cache_config)
        return self._scheduler

    # ------------------------------------------------------------------ lifecycle

    def register(self) -> None:
        """What the model runner does once the caches exist: register them, set the copy op."""
        if isinstance(self.copy_op, CopyLog):
            self.host_buffer_ops_to = record_receivers(self._children())
        self.connector.register_kv_caches(self.kv.kv_caches)
        self.connector.set_host_xfer_buffer_ops(self.copy_op)

    def publish_handshake(self) -> None:
        """What the engine core does once its workers registered their KV caches: hand the
        worker's handshake metadata (NIXL's agent metadata) to the scheduler's connector, whose
        side-channel listener then serves it to peers (vLLM's ZMQ handshake, in a thread)."""
        meta = self.connector.get_handshake_metadata()
        conn = self.scheduler.connector
        if meta is not None and conn is not None:
            conn.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})

    def _children(self) -> dict[str, KVConnectorBase_V1]:
        """The connectors that receive engine calls: the children by name, or the connector itself."""
        from kvcompose.vllm.connector import KVComposeConnector

        if isinstance(self.connector, KVComposeConnector):
            return dict(zip(self.connector.names, self.connector.sub_connectors, strict=True))
        children = getattr(self.connector, "_connectors", None)
        if children is not None:
            return {type(c).__name__: c for c in children}
        return {type(self.connector).__name__: self.connector}

    def idle_metadata(self) -> KVConnectorMetadata:
        """The metadata the scheduler-role connector builds for a step with no request.

        Built once by an engine step of :attr:`scheduler` (so it is only valid while that
        scheduler holds no request) and reused; a benchmark binds it every step.
        """
        if self._idle is None:
            if self.scheduler.requests:
                raise RuntimeError("idle_metadata: the harness scheduler holds requests; use engine_step()")
            out, _ = self._schedule_and_update(lambda so: self.step(so))
            assert out.kv_connector_metadata is not None
            self._idle = out.kv_connector_metadata
        return self._idle

    def step(
        self,
        work: SchedulerOutput | KVConnectorMetadata,
        *,
        finished_req_ids: Iterable[str] = (),
        sync_loads: bool | None = None,
        write: LayerWrite | None = None,
        attn_metadata: Any = None,
        layers: bool = True,
    ) -> KVConnectorOutput:
        """One model-runner step's connector calls; returns the step's ``KVConnectorOutput``.

        ``work`` is a ``SchedulerOutput`` (its metadata, ``finished_req_ids`` and
        ``has_sync_kv_loads`` are used) or a bare connector metadata (then the keyword
        arguments give those). ``layers=False`` skips the per-layer calls, as vLLM does when
        no token runs in the step.
        """
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
        from vllm.forward_context import get_forward_context, set_forward_context
        from vllm.v1.outputs import KVConnectorOutput

        if isinstance(work, KVConnectorMetadata):
            meta, finished, sync = work, set(finished_req_ids), bool(sync_loads)
        else:
            if work.kv_connector_metadata is None:
                raise ValueError(
                    "step: the SchedulerOutput carries no kv_connector_metadata "
                    "(was its scheduler built without a kv_transfer_config?)"
                )
            meta = work.kv_connector_metadata
            finished = set(work.finished_req_ids) | set(finished_req_ids)
            sync = work.has_sync_kv_loads if sync_loads is None else sync_loads
        conn = self.connector
        # As vLLM's model runner (execute_model): every step's metadata to handle_preemptions, then bind.
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        with set_forward_context(attn_metadata, self.vllm_config):
            ctx = get_forward_context()
            if sync:
                conn.start_load_kv(ctx)
            if layers:
                for name in self.kv.layer_names:
                    kv_layer = self.kv.kv_caches[name]
                    conn.wait_for_layer_load(name)
                    if write is not None:
                        write(name, kv_layer)
                    conn.save_kv_layer(name, kv_layer, attn_metadata)
            if not sync:
                conn.start_load_kv(ctx)
        conn.wait_for_save()
        results = conn.get_transfer_results(finished)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_stats=conn.get_kv_connector_stats(),
            kv_cache_events=conn.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        return output

    def engine_step(
        self, *, eos: bool = False, write_blocks: bool = False, **step_kw: Any
    ) -> tuple[SchedulerOutput, Any]:
        """One engine step: :attr:`scheduler` schedules, this worker runs its connector step,
        the scheduler takes the worker's output (one sampled token per running request).

        With ``write_blocks`` the step's forward writes, per layer, every block a scheduled
        request completes in this step with :meth:`expected_block` of the block's token prefix
        (after ``wait_for_layer_load``, before ``save_kv_layer``, as attention writes KV; a
        ``write`` hook in ``step_kw`` runs after it). A step that schedules no token runs no
        forward pass and so makes no per-layer call, as vLLM's ``kv_connector_no_forward``
        (``layers`` in ``step_kw`` overrides). Returns ``(scheduler_output,
        engine_core_outputs)``; the worker's ``KVConnectorOutput`` is ``last_output``.
        """
        user_write: LayerWrite | None = step_kw.pop("write", None)

        def run(so: SchedulerOutput) -> KVConnectorOutput:
            write = self._forward_writer(so, user_write) if write_blocks else user_write
            kw = {"layers": so.total_num_scheduled_tokens > 0, **step_kw}
            return self.step(so, write=write, **kw)

        return self._schedule_and_update(run, eos=eos)

    def drain(self, *, max_steps: int = 5, timeout_s: float = 30.0, **engine_step_kw: Any) -> list[SchedulerOutput]:
        """Engine steps until the scheduler's connector has no push work pending.

        Push work is what keeps vLLM's engine loop stepping with no request left
        (``Scheduler.has_requests``): stores not yet acknowledged by the worker (the
        CPU-offload tier holds the stored blocks until then), P-side writes in flight. Returns
        the scheduler outputs of the steps it ran (none if nothing was pending); the bounds
        and ``engine_step_kw`` as :meth:`step_until`.
        """

        def settled(_outs: list[SchedulerOutput]) -> bool:
            conn = self.scheduler.connector
            return conn is None or not conn.has_pending_push_work()

        return self.step_until(
            settled, "push work still pending", max_steps=max_steps, timeout_s=timeout_s, **engine_step_kw
        )

    def step_until(
        self,
        done: Callable[[list[SchedulerOutput]], bool],
        what: str = "condition not met",
        *,
        max_steps: int = 5,
        timeout_s: float = 30.0,
        **engine_step_kw: Any,
    ) -> list[SchedulerOutput]:
        """Engine steps until ``done(outputs so far)`` holds (checked before each step); the outputs.

        A worker that copies on its own threads (as vLLM's do on CUDA streams) reports a
        transfer in some later step than the one that issued it, and vLLM's engine loop simply
        steps on. So after ``max_steps`` steps this goes on, with a millisecond's pause between
        steps to let those threads run, until ``timeout_s`` has passed; then it raises
        ``AssertionError`` naming ``what``. ``engine_step_kw`` as :meth:`engine_step`.
        """
        outs: list[SchedulerOutput] = []
        deadline = time.monotonic() + timeout_s
        while not done(outs):
            if len(outs) >= max_steps:
                if time.monotonic() >= deadline:
                    raise AssertionError(f"{what} after {len(outs)} engine steps and {timeout_s:g} s")
                time.sleep(0.001)
            outs.append(self.engine_step(**engine_step_kw)[0])
        return outs

    # ------------------------------------------------------------------ block contents

    def expected_block(self, prefix: list[int] | tuple[int, ...], layer: str) -> torch.Tensor:
        """The bytes (int8, flat) ``engine_step(write_blocks=True)`` writes into ``layer``'s
        block whose tokens end ``prefix`` (the block's tokens and every token before them).

        The layer's position is part of the seed, so a block copied to the wrong layer is caught.
        """
        view = self.kv.kv_caches[layer][0]
        index = self.kv.layer_names.index(layer)
        return pattern_for([*prefix, -1 - index], view.numel() * view.element_size())

    def block_bytes(self, layer: str, block_id: int, *, host_buffer: bool = False) -> torch.Tensor:
        """A copy of one layer's block as flat bytes (int8): compares exactly, NaN patterns included.

        ``host_buffer``: the block in the NIXL worker's host transfer buffer instead of the KV cache.
        """
        caches = self._host_buffers() if host_buffer else self.kv.kv_caches
        return caches[layer][block_id].contiguous().view(torch.int8).reshape(-1).clone()

    def holds_prefix(
        self,
        block_id: int,
        prefix: list[int] | tuple[int, ...],
        layers: Iterable[str] | None = None,
        *,
        host_buffer: bool = False,
    ) -> bool:
        """Whether ``block_id`` holds, in every layer (or ``layers``), the bytes the stand-in
        forward writes for ``prefix`` (``host_buffer``: in the NIXL worker's host buffer)."""
        names = self.kv.layer_names if layers is None else list(layers)
        return all(
            torch.equal(self.block_bytes(n, block_id, host_buffer=host_buffer), self.expected_block(prefix, n))
            for n in names
        )

    def _host_buffers(self) -> dict[str, torch.Tensor]:
        """The host transfer buffers of the (NIXL) worker that has them."""
        for child in self._children().values():
            buffers = getattr(getattr(child, "connector_worker", None), "host_xfer_buffers", None)
            if buffers:
                return dict(buffers)
        raise ValueError(
            "no worker here has a host transfer buffer (build the harness with the nixl plugin's host_buffer_setting())"
        )

    def _forward_writer(self, out: SchedulerOutput, then: LayerWrite | None) -> LayerWrite:
        """The per-layer write of :meth:`engine_step`'s ``write_blocks`` for one scheduler output.

        The blocks are fixed before the forward: ``schedule()`` has already advanced each
        request's ``num_computed_tokens`` past the step's tokens and allocated their blocks.
        """
        sched = self.scheduler
        block_size = self.vllm_config.cache_config.block_size
        groups = self.kv.kv_cache_config.kv_cache_groups
        group_of = {n: g for g, group in enumerate(groups) for n in group.layer_names}
        # (group, block id, prefix) of every block completed in this step.
        done: list[tuple[int, int, list[int]]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            req = sched.requests[req_id]
            end = req.num_computed_tokens
            block_ids = sched.kv_cache_manager.get_block_ids(req_id)
            tokens = req.all_token_ids
            for b in range((end - n) // block_size, end // block_size):
                for g in range(len(groups)):
                    # A sliding-window group frees blocks behind its window (the null block 0).
                    if b < len(block_ids[g]) and block_ids[g][b] != 0:
                        done.append((g, block_ids[g][b], list(tokens[: (b + 1) * block_size])))

        def write(name: str, kv_layer: torch.Tensor) -> None:
            for g, block_id, prefix in done:
                if g == group_of[name]:
                    dst = kv_layer[block_id]
                    dst.copy_(self.expected_block(prefix, name).view(dst.dtype).view(dst.shape))
            if then is not None:
                then(name, kv_layer)

        return write

    def _schedule_and_update(
        self, run: Callable[[SchedulerOutput], KVConnectorOutput], eos: bool = False
    ) -> tuple[SchedulerOutput, Any]:
        from kvcompose.testing.harness import model_runner_output

        sched = self.scheduler
        out = sched.schedule()
        running = [sched.requests[r] for r in out.num_scheduled_tokens]
        self.last_output = run(out)
        mro = model_runner_output(running, eos=eos)
        mro.kv_connector_output = self.last_output
        return out, sched.update_from_output(out, mro)

    def shutdown(self) -> None:
        """Shut the worker connector (and the scheduler's connector, if one was built) down."""
        try:
            self.connector.shutdown()
            if self._scheduler is not None and self._scheduler.connector is not None:
                self._scheduler.connector.shutdown()
        finally:
            self._platform.close()

    def __enter__(self) -> WorkerHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
