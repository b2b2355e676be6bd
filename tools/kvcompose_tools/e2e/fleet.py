"""xPyD: several prefill and decode servers of the shipped compositions behind vLLM's router.

:class:`Fleet` starts ``prefills`` servers of the prefill example and ``decodes`` of the decode
example (their host tier: :data:`kvcompose.examples.HOST_TIERS`), then vllm-router in P/D mode
under one of :data:`kvcompose.router.POLICIES` (its command line:
:func:`kvcompose.router.pd_router_args`). Under ``kv_aware`` every prefill publishes its KV
events (every composed tier's: device and host) on a Unix socket, and a
:class:`kvcompose.relay.Relay` per prefill re-publishes them on ``tcp://127.0.0.1`` in the
16-token blocks vllm-router 0.1.17's P/D index takes (the engines' blocks are 32 tokens: vLLM's
CPU attention takes no fewer). :meth:`Fleet.turn` sends one request through the router and says
which prefill computed it (and how many prompt tokens it computed) and which decode answered.

The router checks a worker's ``/health`` every second here (its default: every 60 s) and takes
it out after two failures, so that a killed prefill leaves the rotation within seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcompose.examples import pd_pair
from kvcompose.relay import ROUTER_BLOCK_SIZE, Relay
from kvcompose.router import POLICIES
from kvcompose_tools.e2e.events import kv_events_config
from kvcompose_tools.e2e.flow import Served, routed_request
from kvcompose_tools.e2e.node import wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

#: The router's health checks in a fleet: every second, out after two failures, back after one
#: success (its defaults: 60 s, 3, 2), and its circuit breaker open after two failed requests.
HEALTH_ARGS = (
    "--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--health-success-threshold", "1",
    "--health-check-timeout-secs", "2", "--cb-failure-threshold", "2",
)  # fmt: skip


class Fleet:
    """``prefills`` x ``decodes`` servers behind vllm-router under ``policy``; ``log_dir`` holds
    every log. Construct, then :meth:`start`; :meth:`close` stops every process it started (also
    after a failed start). ``spec``: more :class:`EngineSpec` fields for every server (a model's
    context length, its device blocks)."""

    def __init__(
        self,
        model: str | Path,
        log_dir: Path,
        policy: str = "kv_aware",
        prefills: int = 2,
        decodes: int = 2,
        host_tier: str = "simple",
        **spec: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fleet policy {policy!r}: one of {', '.join(POLICIES)}")
        self.model, self.log_dir, self.policy = str(model), log_dir, policy
        prefill_yaml, decode_yaml = pd_pair(host_tier)
        ports = free_ports(prefills + decodes + (prefills if policy == "kv_aware" else 0))
        events = policy == "kv_aware"
        self.prefills = [
            ServerNode(
                EngineSpec(f"prefill-{i + 1}", self.model, str(prefill_yaml), ports[i], **spec,
                           kv_events=kv_events_config(log_dir / f"prefill-{i + 1}.events") if events else None),
                log_dir,
            )
            for i in range(prefills)
        ]  # fmt: skip
        self.decodes = [
            ServerNode(EngineSpec(f"decode-{i + 1}", self.model, str(decode_yaml), port, **spec), log_dir)
            for i, port in enumerate(ports[prefills : prefills + decodes])
        ]
        self._relay_ports = ports[prefills + decodes :]
        self.relays: list[Relay] = []
        self.router: RouterNode | None = None
        #: The prefills not killed (:meth:`kill_prefill`).
        self.alive = list(self.prefills)

    def start(self) -> None:
        """Wait for every server, start the relays (``kv_aware``) and the router."""
        wait_all_ready([*self.prefills, *self.decodes])
        events: dict[str, str] = {}
        for p, port in zip(self.prefills, self._relay_ports):
            assert p.spec.kv_events is not None
            relay = Relay(p.spec.kv_events["endpoint"], f"tcp://127.0.0.1:{port}", BLOCK_SIZE, ROUTER_BLOCK_SIZE)
            self.relays.append(relay)
            events[p.url] = relay.target
        self.router = RouterNode(
            self.prefills, self.decodes, self.model, self.log_dir, policy=self.policy, args=HEALTH_ARGS,
            prefill_events=events or None,
        )  # fmt: skip
        self.router.wait_ready()

    def turn(self, prompt: list[int], max_tokens: int, session: str, label: str = "") -> Served:
        """One request through the router as ``session``; :attr:`Served.prefill` and
        :attr:`Served.decode` name the servers that computed and answered it."""
        assert self.router is not None, "start() first"
        return routed_request(
            self.router, self.decodes, prompt, max_tokens, label or session, session=session, prefills=self.alive
        )

    def kill_prefill(self, name: str) -> None:
        """Kill one prefill server's process group (SIGKILL: no goodbye to the router)."""
        (p,) = [p for p in self.alive if p.name == name]
        p.kill()
        self.alive.remove(p)

    def servers(self) -> Sequence[ServerNode]:
        return [*self.prefills, *self.decodes]

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        for relay in self.relays:
            relay.close()
        for node in reversed(self.servers()):
            node.close()
