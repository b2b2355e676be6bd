"""Issue 60's second hole with real engines (markers ``engine`` and ``long``): a prefill's params
are read once, by one decode, while the prefill holds their blocks (docs/security.md, "Read once,
by one decode, while the prefill holds the blocks"; the kit-level test, over the fake NIXL, is
plugins/nixl/tests/test_nixl_read_once.py).

One prefill and two decode servers on this host (loopback). A client sends prompt G to the
prefill, lets decode 1 read it with the params the prefill returned (the prefill frees G's blocks
on decode 1's read notification), sends :data:`OTHERS` prompts through the prefill, which give
every KV block of the prefill, G's among them, to other prompts, then sends G with G's params to
decode 2, well within the signature's expiry. Twice per stack, each time with a prompt of its own:
with the prefill idle when decode 2 reads (the issue's scenario), and with a long generation
running on the prefill meanwhile.

* The shipped examples (``pd-prefill.yaml``, ``pd-decode.yaml`` twice, the key in
  ``$KVCOMPOSE_PD_KEY``): decode 2's params pass every trust check (no refusal by reason), its
  read is made (NIXL's READ is one-sided) and refused (``NIXL read refused:``), nothing of it is
  taken, G is computed on decode 2, and the answer is G's own (the single engine's token ids and
  logprobs). With the prefill busy, the prefill answers the read "not held". Idle, it answered
  nothing in the runs so far: vLLM's worker reads NIXL notifications only in an engine step, and
  an idle engine takes none; the decode waits ``READ_ANSWER_WAIT_S`` (10 s) and refuses the read
  unanswered. Either reason passes there; the table says which.
* The control: decode 2 runs vLLM's own NixlConnector (``kv_load_failure_policy: recompute``). It
  cannot open a keyed prefill's sealed agent metadata, so this stack's prefill and decode 1 run the
  same examples without the key. vLLM's decode takes the read both times: G is answered from the
  KV of the prompts that reused its blocks, not G's own answer.

That the blocks were reused is checked on the prefill: G sent to it again afterwards hits none of
its device prefix cache (vLLM queues a request's full blocks for reuse last block first, so G's
first block is the last of them to be given away).

Each stack is three engines started together (120-175 s on this machine's two cores, the
session's baseline engine beside the first); the module took 331 s and 403 s, hence ``long``
(``make test-long``).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_nixl.lease import READ_ANSWER_WAIT_S, REFUSED
from kvcompose_nixl.plugin import DEFAULT_LEASE_SECONDS
from kvcompose_tools.e2e.attacks import refusals
from kvcompose_tools.e2e.flow import COMPUTED, EXTERNAL, Served, decode_request, delta, pd_request, token_prompt
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec

pytestmark = [pytest.mark.engine, pytest.mark.long]

MAX_TOKENS = 8
#: G of each round: 200 tokens, 7 blocks of the prefill.
ROUNDS = {"idle": token_prompt(60, 200), "busy": token_prompt(70, 200)}
#: A request through each decode first: its handshake with the prefill, its hello and its first
#: read are done before a round's clock (the signature's expiry) runs.
WARM = {"decode-1": token_prompt(61, 100), "decode-2": token_prompt(62, 100)}
#: Plain prompts through the prefill after decode 1 read G, each round its own (a prefix cache
#: hit would take no new block): 45 x 7 blocks, more than the prefill's 255 usable ones
#: (``EngineSpec.num_gpu_blocks``, 256, less vLLM's null block).
OTHERS = {r: [token_prompt(1000 * (i + 1) + k, 200) for k in range(45)] for i, r in enumerate(ROUNDS)}
#: The generation that keeps the prefill stepping while decode 2 reads (round ``busy``): about
#: 15 ms a token here, some 7 s in all, much longer than decode 2's request.
BUSY_PROMPT, BUSY_TOKENS = token_prompt(80, 100), 500
#: vLLM's own NixlConnector on decode 2 (the control), with the shipped decode's failure policy.
VLLMS_DECODE = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}
#: The refusal's reasons (:mod:`kvcompose_nixl.lease`).
NOT_HELD = "the prefill answered that its blocks were no longer held"
UNANSWERED = f"the prefill did not answer in {READ_ANSWER_WAIT_S:g} s"
#: vLLM's prefill counts each read notification of a request it no longer holds.
LATE_NOTIFICATIONS = "vllm:nixl_num_notifications_after_expiry"
DEVICE_HITS = "vllm:prefix_cache_hits"


class Stack(Nodes):
    """One prefill and two decodes: the shipped examples (``kvcompose``), or (``vllm``) the
    examples without the key and vLLM's own NixlConnector as decode 2."""

    def __init__(self, logs: Path, baseline: EngineNode, side: str) -> None:
        super().__init__()
        model = str(make_model(0))
        p_port, d1_port, d2_port = free_ports(3)
        prefill, decode = str(EXAMPLES / "pd-prefill.yaml"), str(EXAMPLES / "pd-decode.yaml")
        unkeyed: dict[str, Any] = {} if side == "kvcompose" else {"key_env": None}
        self.prefill = ServerNode(EngineSpec("prefill", model, prefill, p_port, unkeyed), logs)
        self.decode_1 = ServerNode(EngineSpec("decode-1", model, decode, d1_port, unkeyed), logs)
        if side == "kvcompose":
            self.decode_2 = ServerNode(EngineSpec("decode-2", model, decode, d2_port), logs)
        else:
            spec = EngineSpec("decode-2", model, kv_config=VLLMS_DECODE)
            self.decode_2 = ServerNode(spec, logs, extra_env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(d2_port)})
        self.nodes += [self.prefill, self.decode_1, self.decode_2]
        t0 = time.monotonic()
        prompts = {**ROUNDS, **WARM}
        self.expected = {k: baseline.generate([ids], MAX_TOKENS)[0] for k, ids in prompts.items()}
        wait_all_ready([self.prefill, self.decode_1, self.decode_2])
        self.start_s = time.monotonic() - t0
        for name, d in (("decode-1", self.decode_1), ("decode-2", self.decode_2)):
            w = pd_request(self.prefill, d, WARM[name], MAX_TOKENS, name)
            assert w.equals(self.expected[name]) and w.counters.get(EXTERNAL) == len(WARM[name]), (name, w.counters)

    def alive(self) -> bool:
        return all(n.proc.poll() is None for n in (self.prefill, self.decode_1, self.decode_2))


@dataclass
class Round:
    """One round's G through decode 1, then decode 2, and what the prefill saw."""

    name: str
    params: dict[str, Any]
    d1: Served
    d2: Served
    d2_s: float
    #: seconds from the prefill's answer for G to decode 2's answer
    window_s: float
    #: late read notifications the prefill counted while decode 2's request ran, and at the probe
    late_during: int
    late_at_probe: int
    #: G again through the prefill afterwards: its device prefix cache hits
    probe_hits: int
    #: decode 2's refusal lines for this G (its prefill request id), and decode 1's
    refused_2: list[str]
    refused_1: list[str]
    #: whether the busy generation ran on past decode 2's answer (round ``busy``)
    busy_throughout: bool | None = None


def refused_lines(node: ServerNode, prefill_request: str) -> list[str]:
    pattern = re.compile(re.escape(REFUSED) + r" \S+ \(prefill request " + re.escape(prefill_request) + r"\)(.*)")
    text = node.log_path.read_text(errors="replace")
    return [m.group(1) for m in pattern.finditer(text)]


def play(stack: Stack, name: str) -> Round:
    g = ROUNDS[name]
    t0 = time.monotonic()
    (p,) = stack.prefill.generate([g], 1, [{"do_remote_decode": True}])
    params = dict(p["kv_transfer_params"])
    d1 = decode_request(stack.decode_1, g, MAX_TOKENS, dict(params), "decode 1")
    for ids in OTHERS[name]:
        stack.prefill.generate([ids], 1)
    busy: threading.Thread | None = None
    if name == "busy":
        busy = threading.Thread(
            target=stack.prefill.complete, args=(BUSY_PROMPT, BUSY_TOKENS), kwargs={"ignore_eos": True}, daemon=True
        )
        busy.start()
        deadline = time.monotonic() + 30
        while stack.prefill.metrics().get("vllm:num_requests_running", 0) < 1:
            assert time.monotonic() < deadline and busy.is_alive(), "the busy generation did not start"
            time.sleep(0.05)
    before = stack.prefill.metrics()
    t1 = time.monotonic()
    d2 = decode_request(stack.decode_2, g, MAX_TOKENS, dict(params), "decode 2")
    d2_s = time.monotonic() - t1
    window = time.monotonic() - t0
    busy_throughout = None
    if busy is not None:
        busy_throughout = busy.is_alive()
        busy.join(timeout=120)
        assert not busy.is_alive(), "the busy generation did not end"
    during = delta(before, stack.prefill.metrics())
    stack.prefill.generate([g], 1)  # the probe
    probe = delta(before, stack.prefill.metrics())
    request = str(params["remote_request_id"])
    return Round(
        name,
        params,
        d1,
        d2,
        d2_s,
        window,
        int(during.get(LATE_NOTIFICATIONS, 0)),
        int(probe.get(LATE_NOTIFICATIONS, 0) - during.get(LATE_NOTIFICATIONS, 0)),
        int(probe.get(DEVICE_HITS, 0) - during.get(DEVICE_HITS, 0)),
        refused_lines(stack.decode_2, request),
        refused_lines(stack.decode_1, request),
        busy_throughout,
    )


#: The table's rows, printed when the module ends.
ROWS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    print("\n\nissue 60, second hole: G's params read by decode 1, G's blocks reused, then G to decode 2")
    print(
        f"{'decode 2 side':14} {'prefill':8} {'decode':9} {'answer':12} {'pulled':>6} {'computed':>8} "
        f"{'read bytes':>10} {'wall s':>7}  refused"
    )
    for row in ROWS:
        print(row)


def record(side: str, stack: Stack, r: Round) -> None:
    for label, s, lines, wall in (("decode 1", r.d1, r.refused_1, None), ("decode 2", r.d2, r.refused_2, r.d2_s)):
        own = "own" if s.equals(stack.expected[r.name]) else "NOT own"
        reason = "-"
        if lines:
            reason = "not held" if NOT_HELD in lines[0] else "unanswered" if UNANSWERED in lines[0] else lines[0]
        ROWS.append(
            f"{side:14} {r.name:8} {label:9} {own:12} {int(s.counters.get(EXTERNAL, 0)):6d} "
            f"{int(s.counters.get(COMPUTED, 0)):8d} {s.nixl_bytes:10d} "
            f"{'' if wall is None else f'{wall:.2f}':>7}  {reason}"
        )
    ROWS.append(
        f"{'':14} {r.name:8} window {r.window_s:.1f} s; prefill: late read notifications during decode 2 "
        f"{r.late_during}, at the probe {r.late_at_probe}; G's device prefix hits at the probe {r.probe_hits}"
        + ("" if r.busy_throughout is None else f"; busy throughout: {r.busy_throughout}")
    )
    if not r.d2.equals(stack.expected[r.name]):
        ROWS.append(f"{'':14} {'':8} decode 2 tokens {r.d2.token_ids}, G's own {stack.expected[r.name]['token_ids']}")


def check_premises(stack: Stack, r: Round) -> None:
    """Decode 1 pulled G whole, its own answer; decode 2's request came within the lease (and so
    the signature's expiry); the probe found none of G's blocks in the prefill's device cache."""
    g = ROUNDS[r.name]
    assert r.d1.equals(stack.expected[r.name]), r.d1.token_ids
    assert r.d1.counters.get(EXTERNAL) == len(g) and r.refused_1 == [], (r.d1.counters, r.refused_1)
    assert r.window_s < DEFAULT_LEASE_SECONDS, r.window_s
    assert r.probe_hits == 0, "G's blocks were not all given to other prompts"
    assert r.late_during + r.late_at_probe >= 1, "the prefill never saw decode 2's read"
    if r.busy_throughout is not None:
        assert r.busy_throughout, "the prefill's generation ended before decode 2 answered"


@pytest.fixture
def kvcompose_stack(baseline: EngineNode) -> Iterator[Stack]:
    yield from module_stack(Stack, "kvcompose-e2e-read-once-", baseline, "kvcompose")


@pytest.fixture
def vllm_stack(baseline: EngineNode) -> Iterator[Stack]:
    yield from module_stack(Stack, "kvcompose-e2e-read-once-vllm-", baseline, "vllm")


def test_kvcompose_decode_2_refuses_the_read_of_reused_blocks_and_computes_g_itself(kvcompose_stack: Stack) -> None:
    stack = kvcompose_stack
    for name in ROUNDS:
        r = play(stack, name)
        record("kvcompose", stack, r)
        check_premises(stack, r)
        s = r.d2
        assert s.equals(stack.expected[name]), (name, s.token_ids, stack.expected[name]["token_ids"])
        assert refusals(s.counters) == {}, (name, s.counters)  # the params passed every trust check
        assert s.nixl_bytes > 0, name  # the read was made (NIXL's READ is one-sided) ...
        assert len(r.refused_2) == 1, (name, r.refused_2)  # ... and refused
        assert s.counters.get(EXTERNAL, 0) == 0 and s.computed_tokens == len(ROUNDS[name]), (name, s.counters)
        if name == "busy":  # the prefill answered the read at its next step
            assert NOT_HELD in r.refused_2[0] and r.late_during >= 1, (r.refused_2, r.late_during)
        else:
            assert NOT_HELD in r.refused_2[0] or UNANSWERED in r.refused_2[0], r.refused_2
        assert stack.alive()


def test_vllms_own_decode_2_answers_g_from_the_reused_blocks(vllm_stack: Stack) -> None:
    stack = vllm_stack
    for name in ROUNDS:
        r = play(stack, name)
        record("vLLM's own", stack, r)
        check_premises(stack, r)
        s = r.d2
        assert s.counters.get(EXTERNAL) == len(ROUNDS[name]) and s.computed_tokens == 0, (name, s.counters)
        assert r.refused_2 == [] and s.finish_reason == "length", (name, r.refused_2, s.finish_reason)
        assert not s.equals(stack.expected[name]), f"{name}: vLLM's decode 2 answered G's own answer"
        assert stack.alive()
