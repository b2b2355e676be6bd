"""What a soak run does, drawn from one seed: its size, the requests, and the faults and when.

Everything random in a run comes from :func:`plan` (``random.Random(seed)``), so a run that found
a fault can be replayed with the same ``--seed``: the same prompts, the same requests hung up, the
same moments (counted in requests sent) at which the prefill and the decode are killed and
paused (and, with ``--hosts``, the link between them cut), and the same calls at which the
best-effort child raises.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvcompose.examples import HOST_TIERS, pd_pair
from kvcompose_tools.e2e.flow import token_prompt

#: vLLM's NIXL lease on a prefilled request's blocks when the composition sets none (the nixl
#: option ``lease_seconds``; vLLM's ``kv_lease_duration``).
VLLM_LEASE_S = 30.0

#: With ``--hosts``, the link between the prefill's and the decode's host stays cut this much longer
#: than the prefill's lease: the leases of the reads it stalls run out, and the reads end after.
CUT_BEYOND_LEASE_S = 10.0

#: A paused server (SIGSTOP on its process group, then SIGCONT) stays stopped this much longer than
#: the prefill's lease: the leases of the reads it holds up run out while it is stopped.
PAUSE_BEYOND_LEASE_S = 10.0
#: ``--quick``'s margin: a few seconds past the lease suffice (the pause still outlives every lease
#: it holds up), and each second is paid twice in CI's wall time.
QUICK_PAUSE_BEYOND_LEASE_S = 5.0

#: The kit's ``faulty`` child composed into the decode server: a best-effort tier that holds
#: nothing (``matched_tokens: 0``) and raises when its faults fire.
FLAKY = "flaky"


@dataclass(frozen=True)
class SoakOptions:
    """The size of a run (``kvcompose soak``'s options)."""

    requests: int = 1000
    concurrency: int = 32
    seed: int = 0
    #: Share of requests whose client hangs up before the answer (the request is aborted).
    hangups: float = 0.05
    #: Answered requests compared with a single-engine baseline afterwards.
    sample: int = 40
    max_tokens: int = 16
    #: Shared prefixes the prompts start with (a system prompt, a document): both children load.
    #: More than the decode's device cache keeps beside the requests in flight, so prefixes
    #: leave it and come back from the host tier.
    prefixes: int = 32
    #: Prefill and decode on hosts of their own (:mod:`kvcompose_tools.e2e.hosts`), joined by a link of
    #: rate ``link``; the plan then also cuts that link once and restores it.
    hosts: bool = False
    link: str | None = None
    #: How much longer than the prefill's lease each paused server stays stopped.
    pause_beyond_lease_s: float = PAUSE_BEYOND_LEASE_S
    #: The shipped pair the stack runs (a name of :data:`~kvcompose.examples.HOST_TIERS`):
    #: ``native`` puts vLLM's OffloadingConnector beside NIXL as the host tier.
    host_tier: str = "simple"

    def __post_init__(self) -> None:
        if (
            self.requests < 20
            or self.concurrency < 1
            or not 0 <= self.hangups < 1
            or self.sample < 1
            or self.pause_beyond_lease_s <= 0
            or self.host_tier not in HOST_TIERS
        ):
            raise ValueError(
                "--requests must be >= 20 (faults are placed between 5% and 88% of them), "
                "--concurrency >= 1, the hang-up share in [0, 1), the sample >= 1, "
                "the pauses' margin past the lease > 0, --host-tier one of " + ", ".join(HOST_TIERS)
            )


#: CI's short variant: every fault kind, once each, in a few minutes.
QUICK = SoakOptions(requests=160, concurrency=8, sample=16, pause_beyond_lease_s=QUICK_PAUSE_BEYOND_LEASE_S)

PREFIX_TOKENS = 256  # 8 blocks: a host-tier hit is worth a load
NEW_TOKENS = (40, 200)


#: The direct hang-up's moment: seconds after decode has the request (its NIXL pull takes
#: milliseconds here, so most land mid-pull or just before it).
DIRECT_HANG_UP_S = (0.0, 0.03)


#: How a client hangs up (:class:`HangUp`).
HANG_UP_PATHS = ("router", "direct")


@dataclass(frozen=True)
class HangUp:
    """When a request's client hangs up. ``router``: through the router, ``at`` times the answered
    requests' median latency so far (early: at prefill; later: at decode). ``direct``: the proxy
    flow by hand, ``at`` seconds after decode has the request (mid NIXL pull)."""

    path: str
    at: float


@dataclass(frozen=True)
class Request:
    """One request of the run: its prompt, and when its client hangs up (None: it waits)."""

    index: int
    prompt: list[int]
    hang_up: HangUp | None


@dataclass(frozen=True)
class FaultPlan:
    """The run's faults: request counts at which a server is killed, at which one is paused (for
    ``pause_s``) and, across hosts, the link between prefill and decode cut (for ``cut_s``), the
    flaky child's faults."""

    kill_prefill_at: int
    kill_decode_at: int
    flaky_faults: tuple[dict[str, Any], ...]
    cut_link_at: int | None = None
    cut_s: float = 0.0
    pause_prefill_at: int | None = None
    pause_decode_at: int | None = None
    pause_s: float = 0.0

    @property
    def pauses(self) -> list[tuple[int, str]]:
        """``(count, role)`` of each planned pause."""
        planned = [(self.pause_prefill_at, "prefill"), (self.pause_decode_at, "decode")]
        return [(at, role) for at, role in planned if at is not None]

    def describe(self) -> list[str]:
        out = [
            f"SIGKILL the prefill server once {self.kill_prefill_at} requests were sent, then restart it",
            f"SIGKILL the decode server once {self.kill_decode_at} requests were sent, then restart it",
        ]
        out += [
            f"SIGSTOP the {role} server's process group once {at} requests were sent, for {self.pause_s:g} s "
            "(longer than the prefill's lease: a VM pause, a stuck host), then SIGCONT"
            for at, role in sorted(self.pauses)
        ]
        if self.cut_link_at is not None:
            out.append(
                f"cut the link between the prefill and the decode host once {self.cut_link_at} requests were sent, "
                f"silently, for {self.cut_s:g} s (longer than the prefill's lease), then restore it"
            )
        out += [
            f"{FLAKY} raises in {f['call']} after {f['after']} calls, {f['times']} time(s) (each decode process)"
            for f in self.flaky_faults
        ]
        return out


def plan(options: SoakOptions) -> tuple[list[Request], FaultPlan]:
    """The requests and the faults of a run with ``options`` (deterministic in its seed)."""
    rng = random.Random(options.seed)
    n = options.requests
    prefixes = [token_prompt(70_000 + options.seed * 100 + i, PREFIX_TOKENS) for i in range(options.prefixes)]
    requests = []
    for i in range(n):
        prompt = prefixes[rng.randrange(len(prefixes))] + token_prompt(
            80_000 + options.seed * 100_000 + i, rng.randint(*NEW_TOKENS)
        )
        hang = None
        if rng.random() < options.hangups:
            if rng.random() < 0.5:
                hang = HangUp("direct", rng.uniform(*DIRECT_HANG_UP_S))
            else:
                hang = HangUp("router", rng.uniform(0.1, 1.2))
        requests.append(Request(i, prompt, hang))
    # Lookups on the decode: at least one per request it receives; its worker saves every step.
    faults = (
        {"call": "get_num_new_matched_tokens", "action": "raise", "after": rng.randint(n // 20, n // 5), "times": 2},
        {"call": "get_num_new_matched_tokens", "action": "raise", "after": rng.randint(n // 3, n // 2), "times": 3},
        {"call": "wait_for_save", "action": "raise", "after": rng.randint(n // 10, n // 3), "times": 1},
    )
    kill_prefill_at = rng.randint(int(n * 0.15), int(n * 0.35))
    kill_decode_at = rng.randint(int(n * 0.55), int(n * 0.75))
    # Drawn last, so a seed's other faults are the same with and without hosts.
    cut_link_at = rng.randint(int(n * 0.40), int(n * 0.50)) if options.hosts else None
    # After every draw above, so a seed's other faults are the ones it drew before pauses existed.
    # Apart from the kills' and the cut's windows, and before the last 12%: requests sent after the
    # resume are what shows the pair serving again.
    pause_prefill_at = rng.randint(int(n * 0.05), int(n * 0.12))
    pause_decode_at = rng.randint(int(n * 0.78), int(n * 0.88))
    return requests, FaultPlan(
        kill_prefill_at=kill_prefill_at,
        kill_decode_at=kill_decode_at,
        flaky_faults=faults,
        cut_link_at=cut_link_at,
        cut_s=prefill_lease_s(pd_pair(options.host_tier)[0]) + CUT_BEYOND_LEASE_S if options.hosts else 0.0,
        pause_prefill_at=pause_prefill_at,
        pause_decode_at=pause_decode_at,
        pause_s=prefill_lease_s(pd_pair(options.host_tier)[0]) + options.pause_beyond_lease_s,
    )


def prefill_lease_s(composition: Path | None = None) -> float:
    """How long the prefill composition's NIXL child (the shipped ``pd-prefill.yaml``'s unless
    given) holds a request's blocks for a decode to read: its ``lease_seconds``, else vLLM's
    :data:`VLLM_LEASE_S`."""
    data = yaml.safe_load((composition or pd_pair()[0]).read_text())
    nixl = [c for c in data["connectors"] if c.get("type") == "nixl"]
    lease = (nixl[0].get("options") or {}).get("lease_seconds") if nixl else None
    return float(lease or VLLM_LEASE_S)


def decode_composition(faults: FaultPlan, directory: Path, host_tier: str = "simple") -> Path:
    """The shipped decode file of ``host_tier`` (``pd-decode.yaml``, ``native-decode.yaml``) with the
    flaky child first (every lookup passes through it) and a breaker on it, written under ``directory``."""
    data = yaml.safe_load(pd_pair(host_tier)[1].read_text())
    flaky = {"name": FLAKY, "type": "faulty", "options": {"matched_tokens": 0, "faults": list(faults.flaky_faults)}}
    data["connectors"] = [flaky, *data["connectors"]]
    data["rules"]["faults"] = {"use": "breaker", "children": [FLAKY], "failures": 1, "cooldown_s": 3, "successes": 2}
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "soak-decode.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
