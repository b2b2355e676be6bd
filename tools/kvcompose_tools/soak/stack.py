"""The soak's serving stack: a prefill and a decode server behind vLLM's router, each server
replaceable by a fresh process on the same ports (what a supervisor such as systemd or a
Kubernetes pod restart does), and a sampler of every engine's gauges through the run. With
hosts (:mod:`kvcompose_tools.e2e.hosts`), the prefill and the decode each run in a host of their own,
the router in the root namespace, and the link between the two hosts can be cut."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvcompose.testing.types import install_entry_point
from kvcompose_tools.e2e.node import EngineSpec, NodeError, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import signal_group
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import HOST, ServerNode

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Hosts

#: Decode's device blocks per client: a prompt of up to 456 tokens and its answer take 15, so
#: the requests in flight fit and the prefixes (32 of 8 blocks) do not all stay beside them.
BLOCKS_PER_CLIENT = 16
#: The router checks its workers every 2 s (default 60 s) and retries a tripped worker after 5 s
#: (default 60 s), so a restarted server is back in rotation seconds after it is healthy.
ROUTER_ARGS = ("--health-check-interval-secs", "2", "--cb-timeout-duration-secs", "5")
#: Restart deadline for one server (a CPU engine starts in 30-50 s, more while the other serves).
RESTART_TIMEOUT_S = 240.0
#: The servers of the stack (besides the router), as a request meets them.
ROLES = ("prefill", "decode")
#: The gauges that must be back to 0 on every engine once the load is over, by what they show.
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "host_pinned_blocks": "vllm:simple_kv_offload_used_blocks",  # less the pool's null block: read()
    "host_pending_store_blocks": "vllm:simple_kv_offload_pending_store_blocks",
}
#: Counters read with them (per server process: a restarted server counts from 0).
COUNTERS = {
    "finished": "vllm:request_success{finished_reason=length}",
    "stopped": "vllm:request_success{finished_reason=stop}",
    # vLLM counts no client abort in request_success; the composite counts those mid-load.
    "aborted_mid_load": "vllm:kvcompose_aborted_loads",
    "host_loads": "vllm:kvcompose_loads{child=host}",
    "pd_loads": "vllm:kvcompose_loads{child=pd}",
    "withheld_reports": "vllm:kvcompose_withheld_reports",
}


@dataclass
class Sample:
    t: float  # seconds since the run started
    role: str
    process: str  # the server's name: ``decode``, then ``decode-2`` after a restart, ...
    values: dict[str, float]  # GAUGES and COUNTERS


class Stack:
    """Prefill (``prefill_yaml``), decode (``decode_yaml``, the kit's types importable) and the
    router; :meth:`kill` and :meth:`restart` replace a server, keeping its HTTP and NIXL ports.
    ``hosts``: a ``prefill`` and a ``decode`` host the servers run in."""

    def __init__(
        self,
        model: str,
        prefill_yaml: Path,
        decode_yaml: Path,
        logs: Path,
        concurrency: int,
        hosts: Hosts | None = None,
    ) -> None:
        self.model = model
        self.logs = logs
        self.hosts = hosts
        self._env = {"decode": install_entry_point(logs.parent / "site"), "prefill": {}}
        p_side, d_side = free_ports(2)
        blocks = BLOCKS_PER_CLIENT * concurrency + 32
        specs = {  # in ROLES order
            "prefill": EngineSpec("prefill", model, str(prefill_yaml), p_side),
            "decode": EngineSpec("decode", model, str(decode_yaml), d_side, num_gpu_blocks=blocks),
        }
        self.servers: dict[str, ServerNode] = {}
        #: Every server process started, killed ones included, with whether the soak killed it.
        self.processes: list[tuple[ServerNode, bool]] = []
        try:
            for role, spec in specs.items():
                self._start(role, spec)
            wait_all_ready(list(self.servers.values()))
            self.router = RouterNode([self.servers["prefill"]], [self.servers["decode"]], model, logs, args=ROUTER_ARGS)
        except BaseException:
            self._close_servers()
            raise
        try:
            self.router.wait_ready()
        except BaseException:
            self.close()
            raise

    def _start(self, role: str, spec: EngineSpec, port: int | None = None) -> ServerNode:
        node = ServerNode(spec, self.logs, port, self._env[role], self.hosts[role] if self.hosts else None)
        self.servers[role] = node
        self.processes.append((node, False))
        return node

    def address(self, role: str) -> tuple[str, int]:
        """The HTTP address of ``router``, ``prefill`` or ``decode`` (a restart keeps it)."""
        if role == "router":
            return HOST, self.router.port
        host = self.hosts[role].address if self.hosts else HOST
        return host, self.servers[role].port

    def cut_link(self) -> None:
        """Cut the path between the prefill's and the decode's host, both ways and silently
        (:meth:`~kvcompose_tools.e2e.hosts.Host.cut`); the router still reaches both."""
        if self.hosts is None:
            raise NodeError("the link can be cut only when prefill and decode run on hosts of their own (--hosts)")
        self.hosts["prefill"].cut(self.hosts["decode"])

    def restore_link(self) -> None:
        """Put back the path :meth:`cut_link` cut."""
        if self.hosts is not None:
            self.hosts["prefill"].restore(self.hosts["decode"])

    def pause(self, role: str) -> None:
        """SIGSTOP ``role``'s server's process group (API server and engine core): every process of
        it stops at once, as in a VM pause, and its sockets stay open."""
        signal_group(self.servers[role].proc, signal.SIGSTOP)

    def resume(self, role: str) -> None:
        """SIGCONT the process group :meth:`pause` stopped."""
        signal_group(self.servers[role].proc, signal.SIGCONT)

    def kill(self, role: str) -> None:
        """SIGKILL ``role``'s server, engine core and all."""
        node = self.servers[role]
        node.kill()
        self.processes = [(n, k or n is node) for n, k in self.processes]

    def restart(self, role: str) -> None:
        """A fresh server for ``role`` on the killed one's ports (its log: ``<role>-<n>.log``, ``n``
        the server processes started before it); returns once it answers ``/health``."""
        old = self.servers[role]
        node = self._start(role, replace(old.spec, name=f"{role}-{len(self.processes)}"), old.port)
        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while not node.poll_ready(1.0):
            if time.monotonic() > deadline:
                raise NodeError(f"{node.name}: not healthy {RESTART_TIMEOUT_S:.0f} s after the restart")

    def read(self, t: float) -> list[Sample]:
        """:data:`GAUGES` and :data:`COUNTERS` of every server that answers now."""
        out = []
        for role, node in list(self.servers.items()):
            try:
                metrics = node.metrics()
            except NodeError:  # down or restarting
                continue
            values = {k: metrics.get(name, 0.0) for k, name in (GAUGES | COUNTERS).items()}
            # vLLM's host pool is a BlockPool: its first block is the null block, never free.
            values["host_pinned_blocks"] = max(0.0, values["host_pinned_blocks"] - 1)
            out.append(Sample(t, role, node.name, values))
        return out

    def probe(self) -> None:
        """A request shorter than a block to every live server: it stores and loads nothing, and
        its steps publish fresh gauges (vLLM publishes them only in steps that run)."""
        for node in self.servers.values():
            try:
                node.complete(list(range(1, 6)), 1)
            except NodeError:
                continue

    def close(self) -> None:
        self.router.close()
        self._close_servers()

    def _close_servers(self) -> None:
        for node, _ in self.processes:
            node.close()


class Sampler:
    """Reads every server's gauges once a second in the background, into :attr:`samples`."""

    def __init__(self, stack: Stack, t0: float) -> None:
        self.samples: list[Sample] = []
        self._stack = stack
        self._t0 = t0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples += self._stack.read(time.monotonic() - self._t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
