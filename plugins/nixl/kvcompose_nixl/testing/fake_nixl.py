"""A fake NIXL agent with the installed ``nixl_agent``'s call surface, moving real bytes on CPU.

vLLM's NIXL worker creates its agent through ``NixlWrapper`` in
``vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker`` (``PATCH_TARGET``);
:meth:`FakeNixl.install` swaps :class:`FakeNixlAgent` in there. Agents of one :class:`FakeNixl`
know each other by name, so two worker instances in one process can do a P/D READ: descriptors
are ``(address, length, device)`` tuples over real host memory and a transfer copies the bytes
(``ctypes.memmove``). The controller scripts what real hardware does on its own time:

- ``cycles_before_done``: how many ``check_xfer_state`` calls answer ``"PROC"`` before ``"DONE"``;
- ``fail_next(kind)``: the next transfer ends in ``"ERR"`` (``"err"``), raises from ``transfer``
  (``"raise"``), or completes without its notification (``"drop-notif"``);
- ``cut()`` / ``restore()``: a link cut between the agents, as TCP lives through one: while cut no
  transfer completes and every notification is held; ``restore`` delivers the held ones in order
  and transfers go on;
- ``agents``: every agent made, by name; each records its calls in ``calls``.

For a P/D test, :meth:`FakeNixl.pair` builds a producer and a consumer worker harness (vLLM's
``NixlConnector``, or compositions with a ``nixl`` child) and :meth:`FakeNixl.handshake` does
in process what vLLM's ZMQ side-channel handshake does, so the consumer's READs reach the
producer's KV.

The nixl plugin's tests (``test_nixl_kit_fake_agent.py``) pin the methods and signatures here to the real ``nixl_agent``
and to every ``nixl_wrapper`` call that vLLM's NIXL worker makes.
"""

from __future__ import annotations

import ctypes
import itertools
import pickle
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    from kvcompose.testing.worker import WorkerHarness

PATCH_TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker.NixlWrapper"
LOCAL = "NIXL_INIT_AGENT"

#: The default sides of :meth:`FakeNixl.pair`: vLLM's own NixlConnector, one engine each.
PRODUCER = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "prefill-engine"}
CONSUMER = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "decode-engine"}


class FakeNixlError(RuntimeError):
    """What the fake raises where the real agent raises a ``nixlBind`` error."""


@dataclass
class Telemetry:
    """The fields of ``nixlXferTelemetry`` that vLLM's NIXL stats read."""

    xferDuration: int = 1
    postDuration: int = 1
    totalBytes: int = 0
    descCount: int = 0


@dataclass
class _Xfer:
    op: str
    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]
    remote_agent: str
    notif: bytes
    cycles_left: int
    state: str = "INIT"
    fault: str | None = None


@dataclass
class FakeNixl:
    """The agents of one test, and the knobs that script their transfers."""

    cycles_before_done: int = 0
    agents: dict[str, FakeNixlAgent] = field(default_factory=dict)
    _faults: list[str] = field(default_factory=list)
    _harnesses: list[WorkerHarness] = field(default_factory=list)
    #: notifications sent while the link is cut: (receiving agent, sender, message)
    _held: list[tuple[FakeNixlAgent, str, bytes]] | None = None

    @property
    def is_cut(self) -> bool:
        return self._held is not None

    def cut(self) -> None:
        """Cut the link: transfers answer PROC and notifications wait until :meth:`restore`."""
        if self._held is None:
            self._held = []

    def restore(self) -> None:
        """Restore the link: held notifications arrive, in the order they were sent."""
        held, self._held = self._held or [], None
        for peer, sender, msg in held:
            peer.notifs[sender].append(msg)

    def deliver(self, peer: FakeNixlAgent, sender: str, msg: bytes) -> None:
        """A notification from ``sender`` to ``peer``: at once, or held while the link is cut."""
        if self._held is not None:
            self._held.append((peer, sender, msg))
        else:
            peer.notifs[sender].append(msg)

    def fail_next(self, kind: str) -> None:
        """The next transfer: ``"err"`` (state ERR), ``"raise"`` (transfer raises), ``"drop-notif"``."""
        if kind not in ("err", "raise", "drop-notif"):
            raise ValueError(f"fail_next: unknown kind {kind!r}; expected err, raise or drop-notif")
        self._faults.append(kind)

    def agent_class(self) -> type[FakeNixlAgent]:
        """A ``nixl_agent``-compatible class whose instances belong to this controller."""
        controller = self

        class BoundFakeNixlAgent(FakeNixlAgent):
            def __init__(self, agent_name: str, nixl_conf: Any = None, instantiate_all: bool = False) -> None:
                super().__init__(agent_name, nixl_conf, instantiate_all, _controller=controller)

        return BoundFakeNixlAgent

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Make vLLM's NIXL worker create fake agents (undone with the monkeypatch)."""
        monkeypatch.setattr(PATCH_TARGET, self.agent_class())

    def pair(
        self,
        producer: str | Path | dict[str, Any] = PRODUCER,
        consumer: str | Path | dict[str, Any] = CONSUMER,
        *,
        block_size: int = 32,
        host_buffer: bool = False,
        **kw: Any,
    ) -> tuple[WorkerHarness, WorkerHarness]:
        """A prefill-side and a decode-side worker harness, handshaken (consumer knows producer).

        Each side is a ``kv_transfer_config`` dict or a composition (YAML text or file) with a
        ``nixl`` child; ``kw`` goes to both :class:`WorkerHarness` constructors. Install the fake
        first (the ``fake_nixl`` fixture does); :meth:`close` (the fixture's teardown) shuts the
        harnesses down. ``block_size`` defaults to 32, the CPU attention kernel's block size that
        NIXL's worker checks; ``host_buffer`` puts both on vLLM's host-buffer path
        (:func:`~kvcompose_nixl.testing.host_buffer.host_buffer_setting`).
        """
        p = self._build(producer, block_size=block_size, host_buffer=host_buffer, **kw)
        return p, self.consumer(consumer, p, block_size=block_size, host_buffer=host_buffer, **kw)

    def consumer(
        self,
        source: str | Path | dict[str, Any],
        producer: WorkerHarness,
        *,
        block_size: int = 32,
        host_buffer: bool = False,
        **kw: Any,
    ) -> WorkerHarness:
        """Another decode-side worker harness, handshaken with ``producer`` (one prefill, several
        decodes); the arguments as :meth:`pair`'s."""
        d = self._build(source, block_size=block_size, host_buffer=host_buffer, **kw)
        self.handshake(d, producer)
        return d

    def _build(self, source: str | Path | dict[str, Any], *, block_size: int, host_buffer: bool, **kw: Any) -> Any:
        from kvcompose.testing.worker import WorkerHarness
        from kvcompose_nixl.testing.host_buffer import host_buffer_setting

        both = {"block_size": block_size, **kw, **(host_buffer_setting() if host_buffer else {})}
        h = WorkerHarness(source, **both) if isinstance(source, dict) else WorkerHarness.from_yaml(source, **both)
        self._harnesses.append(h)
        return h

    def handshake(self, consumer: Any, producer: Any) -> str:
        """Give ``consumer``'s NIXL worker the producer's agent, as vLLM's handshake does.

        vLLM's ``_nixl_handshake`` fetches the producer's ``NixlHandshakePayload`` over a ZMQ
        side channel from a background thread; everything after the fetch is done here, in the
        same order: the payload goes through msgpack as on the wire, the compatibility hash is
        checked, ``NixlAgentMetadata`` is decoded and validated, the worker's
        ``add_remote_agent`` registers the remote agent and its block descriptors, and the
        bookkeeping of ``_ensure_handshake``'s done callback is recorded. Both sides are worker
        harnesses or worker-role connectors; returns the remote agent's name.
        """
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
            NixlHandshakePayload,
        )

        local, remote = nixl_worker(consumer), nixl_worker(producer)
        if remote.xfer_handshake_metadata is None:
            raise RuntimeError("handshake: the producer's NIXL worker has not registered its KV caches yet")
        wire = msgspec.msgpack.encode(remote.xfer_handshake_metadata)
        payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(wire)
        if local.enforce_compat_hash and payload.compatibility_hash != local.compat_hash:
            raise RuntimeError(
                f"NIXL compatibility hash mismatch. Local: {local.compat_hash}, Remote: {payload.compatibility_hash}."
            )
        meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
        local._validate_remote_parallel_config(meta)
        name = local.add_remote_agent(meta, 0, remote.world_size, meta.dcp_size)
        with local._handshake_lock:
            local._remote_agents[meta.engine_id] = {(0, 0): name}
            # One process, one clock: the offset vLLM estimates from the round trip is 0.
            local._engine_clock_offset[meta.engine_id] = 0.0
            local._engine_last_active[meta.engine_id] = time.perf_counter()
            address = _side_channel(producer)
            if address is not None:  # else vLLM takes the peer for replaced and drops it when idle
                local._track_remote_engine_replacement(meta.engine_id, *address)
        return name

    def close(self) -> None:
        """Shut down the harnesses :meth:`pair` made."""
        while self._harnesses:
            self._harnesses.pop().shutdown()


def _side_channel(producer: Any) -> tuple[str, int] | None:
    """The producer's handshake address, from its harness's scheduler (vLLM's done callback
    records the address it handshook with, per peer)."""
    try:
        conn = producer.scheduler.connector
    except AttributeError:
        return None
    for c in [conn, *getattr(conn, "_connectors", [])]:
        sched = getattr(c, "connector_scheduler", None)
        if sched is not None and hasattr(sched, "side_channel_port"):
            return str(sched.side_channel_host), int(sched.side_channel_port)
    return None


def nixl_worker(target: Any) -> NixlBaseConnectorWorker:
    """vLLM's NIXL worker inside a worker harness or a worker-role connector.

    ``target`` is vLLM's NixlConnector (or a subclass, as the ``nixl`` type's), or a composed
    connector / vLLM ``MultiConnector`` with exactly one NIXL child.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    conn = getattr(target, "connector", target)  # a WorkerHarness holds its connector
    worker = getattr(conn, "connector_worker", None)
    if isinstance(worker, NixlBaseConnectorWorker):
        return worker
    found = [
        c.connector_worker
        for c in getattr(conn, "_connectors", [])
        if isinstance(getattr(c, "connector_worker", None), NixlBaseConnectorWorker)
    ]
    if len(found) != 1:
        raise ValueError(f"nixl_worker: {type(conn).__name__} has {len(found)} NIXL workers, expected one")
    return found[0]


class FakeNixlAgent:
    """The ``nixl_agent`` surface vLLM uses, over host memory."""

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Any = None,
        instantiate_all: bool = False,
        *,
        _controller: FakeNixl | None = None,
    ) -> None:
        self.name = agent_name
        self.conf = nixl_conf
        self.controller = _controller or FakeNixl()
        self.controller.agents[agent_name] = self
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.backends: dict[str, dict[str, str]] = {}
        for backend in getattr(nixl_conf, "backends", None) or ["UCX"]:
            self.create_backend(backend)
        self.registered: list[list[tuple[int, int, int]]] = []
        self.remote_agents: set[str] = set()
        self.notifs: dict[str, list[bytes]] = defaultdict(list)
        self._dlists: dict[int, tuple[str, list[tuple[int, int, int]]]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)

    def _rec(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))

    def called(self, method: str) -> list[tuple[Any, ...]]:
        return [a for m, a in self.calls if m == method]

    @staticmethod
    def _descs(descs: Any) -> list[tuple[int, int, int]]:
        """``(address, length, device)`` from NIXL's accepted forms: tuples (registration ones
        carry a fourth, metadata string), an N x 3 array, a tensor (one region), or a prior result."""
        if hasattr(descs, "data_ptr"):
            return [(descs.data_ptr(), descs.numel() * descs.element_size(), 0)]
        rows = descs.tolist() if hasattr(descs, "tolist") else list(descs)
        return [(int(r[0]), int(r[1]), int(r[2])) for r in rows]

    # ------------------------------------------------------------------ backends, memory

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:  # noqa: B006 (real default)
        self._rec("create_backend", backend)
        self.backends[backend] = dict(initParams)

    def get_reg_descs(self, descs: Any, mem_type: str | None = None) -> list[tuple[int, int, int]]:
        return self._descs(descs)

    def register_memory(
        self,
        reg_list: Any,
        mem_type: str | None = None,
        backends: list[str] = [],  # noqa: B006
    ) -> list[tuple[int, int, int]]:
        self._rec("register_memory", mem_type)
        regs = self._descs(reg_list)
        self.registered.append(regs)
        return regs

    def deregister_memory(self, dereg_list: Any, backends: list[str] = []) -> None:  # noqa: B006
        self._rec("deregister_memory")
        regs = self._descs(dereg_list)
        if regs not in self.registered:
            raise FakeNixlError(f"agent {self.name}: deregister_memory of memory that is not registered")
        self.registered.remove(regs)

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> list[tuple[int, int, int]]:
        return self._descs(descs)

    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: list[str] = [],  # noqa: B006
    ) -> int:
        self._rec("prep_xfer_dlist", agent_name, mem_type)
        if agent_name != LOCAL and agent_name not in self.remote_agents:
            raise FakeNixlError(f"agent {self.name}: prep_xfer_dlist for unknown remote agent {agent_name!r}")
        handle = next(self._ids)
        self._dlists[handle] = (agent_name, self._strided(xfer_list) or self._descs(xfer_list))
        return handle

    @staticmethod
    def _strided(xfer_list: Any) -> list[tuple[int, int, int]] | None:
        """NIXL 1.5's compressed form (vLLM 0.33 prepares its lists so): an N x 5 array of
        ``(address, length, device, stride, count)``, ``count`` descriptors ``stride`` bytes
        apart, indexed one by one afterwards; None for any other form."""
        shape = getattr(xfer_list, "shape", None)
        if shape is None or len(shape) != 2 or shape[1] != 5:
            return None
        return [
            (int(addr) + k * int(stride), int(length), int(dev))
            for addr, length, dev, stride, count in xfer_list.tolist()
            for k in range(int(count))
        ]

    def release_dlist_handle(self, handle: int) -> None:
        self._rec("release_dlist_handle", handle)
        self._dlists.pop(handle, None)

    @property
    def nixl_mems(self) -> dict[str, Any]:
        """The real agent's memory types by name, NIXL's own (the installed NIXL's, read when
        asked): what a caller builds a descriptor list of its own with."""
        from nixl._api import nixlBind

        return {
            "DRAM": nixlBind.DRAM_SEG,
            "VRAM": nixlBind.VRAM_SEG,
            "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG,
            "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG,
            "cuda": nixlBind.VRAM_SEG,
        }

    # ------------------------------------------------------------------ peers

    def get_agent_metadata(self) -> bytes:
        return pickle.dumps({"fake_nixl_agent": self.name})

    def get_partial_agent_metadata(
        self,
        descs: Any,
        inc_conn_info: bool = False,
        backends: list[str] = [],  # noqa: B006
    ) -> bytes:
        self._rec("get_partial_agent_metadata", inc_conn_info)
        # The class's own metadata, as NIXL's: not what a wrapper put on the instance (sealing).
        return FakeNixlAgent.get_agent_metadata(self)

    def add_remote_agent(self, metadata: bytes) -> str:
        self._rec("add_remote_agent")
        name = pickle.loads(metadata)["fake_nixl_agent"]
        if name not in self.controller.agents:
            raise FakeNixlError(f"agent {self.name}: metadata names agent {name!r}, which does not exist")
        self.remote_agents.add(name)
        return name

    def remove_remote_agent(self, agent: str) -> None:
        self._rec("remove_remote_agent", agent)
        self.remote_agents.discard(agent)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        return agent in self.remote_agents

    # ------------------------------------------------------------------ transfers

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: int,
        local_indices: Any,
        remote_xfer_side: int,
        remote_indices: Any,
        notif_msg: bytes = b"",
        backends: list[str] = [],  # noqa: B006
        skip_desc_merge: bool = False,
    ) -> int:
        self._rec("make_prepped_xfer", operation)
        if operation not in ("READ", "WRITE"):
            raise FakeNixlError(f"agent {self.name}: operation must be READ or WRITE, got {operation!r}")
        local_agent, local = self._dlists[local_xfer_side]
        remote_agent, remote = self._dlists[remote_xfer_side]
        li, ri = [int(i) for i in local_indices], [int(i) for i in remote_indices]
        if len(li) != len(ri):
            raise FakeNixlError(f"agent {self.name}: {len(li)} local and {len(ri)} remote descriptors")
        handle = next(self._ids)
        self._xfers[handle] = _Xfer(
            operation,
            [local[i] for i in li],
            [remote[i] for i in ri],
            remote_agent,
            bytes(notif_msg),
            self.controller.cycles_before_done,
        )
        return handle

    def transfer(self, handle: int, notif_msg: bytes = b"") -> str:
        self._rec("transfer", handle)
        x = self._xfers[handle]
        fault = self.controller._faults.pop(0) if self.controller._faults else None
        if fault == "raise":
            raise FakeNixlError(f"agent {self.name}: transfer failed (injected)")
        for (l_addr, l_len, _), (r_addr, r_len, _) in zip(x.local, x.remote):
            if l_len != r_len:
                raise FakeNixlError(f"agent {self.name}: descriptor lengths differ ({l_len} vs {r_len})")
            if fault != "err":
                src, dst = (r_addr, l_addr) if x.op == "READ" else (l_addr, r_addr)
                ctypes.memmove(dst, src, l_len)
        x.fault, x.notif = fault, notif_msg or x.notif
        x.state = "PROC"
        if x.cycles_left > 0 or self.controller.is_cut:
            return "PROC"
        return self._advance(x)

    def _advance(self, x: _Xfer) -> str:
        """PROC for ``cycles_before_done`` checks after ``transfer``, then DONE (or ERR)."""
        if x.state != "PROC" or self.controller.is_cut:
            return x.state
        if x.cycles_left > 0:
            x.cycles_left -= 1
            return "PROC"
        x.state = "ERR" if x.fault == "err" else "DONE"
        peer = self.controller.agents.get(x.remote_agent)
        if x.state == "DONE" and x.notif and x.fault != "drop-notif" and peer is not None:
            self.controller.deliver(peer, self.name, x.notif)
        return x.state

    def check_xfer_state(self, handle: int) -> str:
        return self._advance(self._xfers[handle])

    def get_xfer_telemetry(self, handle: int) -> Telemetry:
        x = self._xfers[handle]
        return Telemetry(totalBytes=sum(d[1] for d in x.local), descCount=len(x.local))

    def release_xfer_handle(self, handle: int) -> None:
        self._rec("release_xfer_handle", handle)
        if self._xfers.get(handle) is not None and self._xfers[handle].state == "PROC":
            raise FakeNixlError(f"agent {self.name}: release of a transfer still in progress")
        self._xfers.pop(handle, None)

    # ------------------------------------------------------------------ notifications

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: str | None = None) -> None:
        self._rec("send_notif", remote_agent_name, notif_msg)
        name = remote_agent_name.decode() if isinstance(remote_agent_name, bytes) else remote_agent_name
        peer = self.controller.agents.get(name)
        if peer is None or name not in self.remote_agents:  # the real agent sends only to loaded agents
            raise FakeNixlError(f"agent {self.name}: send_notif to unknown agent {remote_agent_name!r}")
        self.controller.deliver(peer, self.name, bytes(notif_msg))

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        out, self.notifs = dict(self.notifs), defaultdict(list)
        return out
