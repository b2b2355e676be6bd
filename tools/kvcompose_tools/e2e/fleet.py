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

``pool`` (issue 62; :data:`POOLS`) adds a tier behind every server's native host tier, so that a
turn computed away from its history finds it: ``peers``, vLLM's p2p tier on each server, each
prefill's ``pool`` naming the other three servers (their p2p sockets and KV events, every server
publishing on a Unix socket of its own); ``shared``, vLLM's ``fs`` tier on one directory for all
four. The P/D legs stay NIXL's (the p2p tier beside a NIXL child carries none).

The router checks a worker's ``/health`` every second here (its default: every 60 s) and takes
it out after two failures, so that a killed prefill leaves the rotation within seconds.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompose.examples import pd_pair
from kvcompose.relay import ROUTER_BLOCK_SIZE, Relay
from kvcompose.router import POLICIES
from kvcompose.serving import HEALTH_ARGS
from kvcompose_tools.e2e.events import kv_events_config
from kvcompose_tools.e2e.flow import Served, routed_request
from kvcompose_tools.e2e.node import wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

#: Where a turn's history is found when another server holds it: nowhere, a peer's host tier
#: through the p2p tier's pool, or one ``fs`` directory for the fleet.
POOLS = ("off", "peers", "shared")
#: The peer pool's ``wait_ms`` here: a peer answers a lookup once per engine step, and four medium
#: engines on two cores stretch a step past the 1,000 ms default (docs/performance.md, 5k).
POOL_WAIT_MS = 3000


def fleet_compositions(
    prefills: list[str],
    decodes: list[str],
    host_tier: str,
    pool: str,
    work: Path,
    p2p_ports: dict[str, int] | None = None,
    events: dict[str, dict[str, Any]] | None = None,
    shared: Path | None = None,
) -> dict[str, Path]:
    """Each server's composition file: the shipped example of its role and ``host_tier``; with a
    ``pool`` (:data:`POOLS`), a tier behind its host memory, written to ``work``: ``peers``, a p2p
    tier on its ``p2p_ports`` port and, on a prefill, a pool of every other server (its p2p port,
    its ``events`` endpoint); ``shared``, an ``fs`` tier on ``shared``."""
    prefill_yaml, decode_yaml = pd_pair(host_tier)
    example = {**dict.fromkeys(prefills, prefill_yaml), **dict.fromkeys(decodes, decode_yaml)}
    if pool == "off":
        return example
    if pool == "shared":
        assert shared is not None
        tier = {"type": "fs", "root_dir": str(shared)}
        return {n: pooled_composition(path, tier, work / f"{n}.yaml") for n, path in example.items()}
    assert p2p_ports is not None and events is not None
    peers = {n: {"host": "127.0.0.1", "p2p_port": p2p_ports[n], "kv_events": events[n]["endpoint"]} for n in example}
    out = {}
    for name, path in example.items():
        # The examples' NIXL children sleep 100 µs between polls; so does the tier's agent.
        tier: dict[str, Any] = {"type": "p2p", "host": "127.0.0.1", "port": p2p_ports[name], "progress_delay_us": 100}
        if name in prefills:  # a decode leg's KV comes from its prefill: only the prefills look
            tier["pool"] = {"peers": [peers[n] for n in example if n != name], "wait_ms": POOL_WAIT_MS}
        out[name] = pooled_composition(path, tier, work / f"{name}.yaml")
    return out


def pooled_composition(example: Path, tier: dict[str, Any], out: Path) -> Path:
    """``example`` (a native P/D example) with ``tier`` behind its ``native-offload`` child's host
    memory, written to ``out``."""
    import yaml

    data = yaml.safe_load(example.read_text())
    (host,) = [c for c in data["connectors"] if c["type"] == "native-offload"]
    host["options"] = {**host.get("options", {}), "tiers": [tier]}
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


class Fleet:
    """``prefills`` x ``decodes`` servers behind vllm-router under ``policy``; ``log_dir`` holds
    every log. Construct, then :meth:`start`; :meth:`close` stops every process it started (also
    after a failed start). ``router_args``: more router flags. ``spec``: more :class:`EngineSpec`
    fields for every server (a model's context length, its device blocks). ``standby``: more decode
    servers, started with the others and left out of the router until :meth:`join_decode` (the
    router then takes its servers by registration: :mod:`kvcompose.discovery`)."""

    def __init__(
        self,
        model: str | Path,
        log_dir: Path,
        policy: str = "kv_aware",
        prefills: int = 2,
        decodes: int = 2,
        host_tier: str = "simple",
        router_args: Sequence[str] = (),
        pool: str = "off",
        standby: int = 0,
        **spec: Any,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"fleet policy {policy!r}: one of {', '.join(POLICIES)}")
        if pool not in POOLS or (pool != "off" and host_tier != "native"):
            raise ValueError(f"fleet pool {pool!r}: one of {', '.join(POOLS)}; a pool needs host_tier 'native'")
        self.model, self.log_dir, self.policy, self.pool = str(model), log_dir, policy, pool
        log_dir.mkdir(parents=True, exist_ok=True)  # the pools' compositions are written there first
        self.router_args = [*HEALTH_ARGS, *router_args]
        names = [f"prefill-{i + 1}" for i in range(prefills)] + [f"decode-{i + 1}" for i in range(decodes + standby)]
        free = free_ports(2 * len(names) + prefills)  # one draw: the servers', their p2p tiers', the relays'
        ports = dict(zip(names, free, strict=False))
        # kv_aware: the router reads the prefills' events; the peer pool: the prefills read everyone's.
        publishers = names if pool == "peers" else names[:prefills] if policy.startswith("kv_aware") else []
        events = {name: kv_events_config(log_dir / f"{name}.events") for name in publishers}
        p2p_ports = dict(zip(names, free[len(names) : 2 * len(names)], strict=True))
        #: the shared directory (``shared``): fresh per fleet, removed by :meth:`close`
        self.shared = Path(tempfile.mkdtemp(prefix="kv-shared-", dir=log_dir)) if pool == "shared" else None
        compositions = fleet_compositions(names[:prefills], names[prefills:], host_tier, pool, log_dir,
                                          p2p_ports=p2p_ports, events=events, shared=self.shared)  # fmt: skip
        nodes = [
            ServerNode(EngineSpec(name, self.model, str(compositions[name]), ports[name], **spec,
                                  kv_events=events.get(name)), log_dir)
            for name in names
        ]  # fmt: skip
        #: every decode, those on standby too (a turn's answer is looked for on each)
        self.prefills, self.decodes = nodes[:prefills], nodes[prefills:]
        #: the decodes the router does not know yet (:meth:`join_decode`)
        self.standby = nodes[prefills + decodes :]
        self._relay_ports = free[2 * len(names) :] if policy.startswith("kv_aware") else []
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
            relay = Relay(p.spec.kv_events["endpoint"], f"tcp://127.0.0.1:{port}", p.spec.block_size, ROUTER_BLOCK_SIZE)
            self.relays.append(relay)
            events[p.url] = relay.target
        routed = [d for d in self.decodes if d not in self.standby]
        self.router = RouterNode(
            self.prefills, routed, self.model, self.log_dir, policy=self.policy, args=self.router_args,
            prefill_events=events or None, discovery=bool(self.standby),
        )  # fmt: skip
        self.router.wait_ready()

    def turn(self, prompt: list[int], max_tokens: int, session: str, label: str = "") -> Served:
        """One request through the router as ``session``; :attr:`Served.prefill` and
        :attr:`Served.decode` name the servers that computed and answered it."""
        assert self.router is not None, "start() first"
        return routed_request(
            self.router, self.decodes, prompt, max_tokens, label or session, session=session, prefills=self.alive
        )

    def join_decode(self) -> str:
        """Add the next standby decode to the running router; its name."""
        assert self.router is not None, "start() first"
        node = self.standby.pop(0)
        self.router.join("decode", node)
        return node.name

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
        if self.shared is not None:
            shutil.rmtree(self.shared, ignore_errors=True)


#: Tokens each turn adds after the answer (a user's next message).
TURN_TOKENS = 40


def first_prompt(seed: int) -> list[int]:
    """A conversation's first prompt: nine blocks and a part (token ids under the tiny vocabulary)."""
    return [5 + (seed * 7919 + i * 31) % 500 for i in range(9 * BLOCK_SIZE + 12)]


@dataclass
class Turn:
    """One turn of a conversation through the fleet: its prompt, what served it (None when the
    router failed it), and when it was sent relative to the scenario's change (None before it)."""

    session: str
    prompt: list[int]
    served: Served | None
    after_s: float | None = None
    error: str = ""


@dataclass
class Scenario:
    """What :func:`kill_scenario` or :func:`join_scenario` saw: every turn in order, and the
    prefill it killed or the decode it added."""

    turns: list[Turn] = field(default_factory=list)
    killed: str = ""
    joined: str = ""

    def of(self, session: str) -> list[Turn]:
        return [t for t in self.turns if t.session == session]


def kill_scenario(
    fleet: Fleet, first: dict[str, list[int]], max_tokens: int, before: int = 3, after: int = 2, deadline_s: float = 60
) -> Scenario:
    """Each conversation (session -> its first prompt) ``before`` turns, interleaved; then the
    prefill that served the first conversation's last turn is killed and each conversation goes on
    until ``after`` more turns were served (a turn the router fails is tried again, as a client
    would, half a second later; ``deadline_s`` bounds the time without a served turn)."""

    def kill(scenario: Scenario) -> None:
        victim = scenario.of(next(iter(first)))[-1].served
        assert victim is not None and victim.prefill is not None
        scenario.killed = victim.prefill
        fleet.kill_prefill(scenario.killed)

    return changed_scenario(fleet, first, max_tokens, kill, before, after, deadline_s)


def join_scenario(
    fleet: Fleet, first: dict[str, list[int]], max_tokens: int, before: int = 3, after: int = 2, deadline_s: float = 60
) -> Scenario:
    """As :func:`kill_scenario`, but the change is a standby decode joining the router
    (:meth:`Fleet.join_decode`)."""

    def join(scenario: Scenario) -> None:
        scenario.joined = fleet.join_decode()

    return changed_scenario(fleet, first, max_tokens, join, before, after, deadline_s)


def changed_scenario(
    fleet: Fleet,
    first: dict[str, list[int]],
    max_tokens: int,
    change: Callable[[Scenario], None],
    before: int,
    after: int,
    deadline_s: float,
) -> Scenario:
    """Each conversation ``before`` turns, interleaved; ``change`` (which records itself on the
    scenario); each conversation until ``after`` more turns were served (a failed turn tried again
    half a second later; a :class:`NodeError` once ``deadline_s`` pass without a served turn: on a
    slow host the turns themselves may take longer than that)."""
    prompts = dict(first)
    scenario = Scenario()
    changed_at: float | None = None

    def turn(session: str) -> bool:
        prompt = prompts[session]
        since = None if changed_at is None else time.monotonic() - changed_at
        try:
            s = fleet.turn(prompt, max_tokens, session)
        except NodeError as exc:
            scenario.turns.append(Turn(session, prompt, None, since, str(exc)[:300]))
            return False
        scenario.turns.append(Turn(session, prompt, s, since))
        prompts[session] = prompt + s.token_ids + [7 + len(scenario.of(session))] * TURN_TOKENS
        return True

    for _ in range(before):
        for session in first:
            if not turn(session):
                raise NodeError(f"{session}: failed before the fleet changed: {scenario.turns[-1].error}")
    change(scenario)
    changed_at = progress_at = time.monotonic()
    done = dict.fromkeys(first, 0)
    while min(done.values()) < after:
        if time.monotonic() - progress_at > deadline_s:
            what = f"{scenario.killed} was killed" if scenario.killed else f"{scenario.joined} joined"
            raise NodeError(f"no turn was served for {deadline_s:.0f} s after {what}")
        for session in first:
            if done[session] < after:
                if turn(session):
                    done[session] += 1
                    progress_at = time.monotonic()
                else:
                    time.sleep(0.5)
    return scenario
