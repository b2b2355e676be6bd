"""Push mode's prompt binding (:mod:`kvcompose_nixl.push`): the prefill WRITEs a request's KV into
a decode's blocks only when the decode registered the digest of the prompt the prefill computed.

The scheduler halves are vLLM's real ones (scheduler role, CPU, no NIXL agent); the worker half
is a stand-in with the attributes of vLLM's ``NixlPushConnectorWorker`` the guard touches, and
vLLM's own ``_pop_matching_registration`` bound to it. Each attack is pinned by its reason beside
a control that passes.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.v1.request import RequestStatus

from kvcompose.testing.harness import decode_request, make_request, prefill_request, scheduler_for, step
from kvcompose_nixl.patches import guard_pushes
from kvcompose_nixl.push import NOPUSH, PUSH_PROMPTS_ATTR, PushGuard, computed_digest
from kvcompose_nixl.testing.fake_nixl import FakeNixl
from kvcompose_nixl.trust import PROMPT_KEY, Keyring, Refused, check_push, prompt_digest

BLOCK_SIZE = 16
KEY = "k" * 64
OURS = "kvcompose_nixl.connector"

# ---------------------------------------------------------------------------- the decision

A = prompt_digest(list(range(40)))
B = prompt_digest(list(range(1, 41)))


@pytest.mark.parametrize(
    ("registered", "computed", "keyed", "reason"),
    [
        pytest.param(A, A, True, None, id="control: the same prompt, keyed"),
        pytest.param(A, A, False, None, id="control: the same prompt, keyless"),
        pytest.param(None, A, False, None, id="control: vLLM's own decode, no key: written as vLLM does"),
        pytest.param(B, A, True, "prompt", id="another prompt, keyed"),
        pytest.param(B, A, False, "prompt", id="another prompt, keyless"),
        pytest.param(None, A, True, "prompt", id="no digest from the decode under a key"),
        pytest.param(A, None, False, "prompt", id="no digest of what the prefill computed"),
        pytest.param(A[:-1], A, False, "malformed", id="a digest of 31 digits"),
        pytest.param(123, A, True, "malformed", id="a digest that is not text"),
    ],
)
def test_check_push(registered: Any, computed: str | None, keyed: bool, reason: str | None) -> None:
    if reason is None:
        check_push(registered, computed, keyed)
        return
    with pytest.raises(Refused) as refused:
        check_push(registered, computed, keyed)
    assert refused.value.reason == reason


# ---------------------------------------------------------------------------- the scheduler halves


def push_scheduler(role: str, module: str | None = OURS, **extra: Any) -> Any:
    ktc: dict[str, Any] = {"kv_connector": "NixlPushConnector", "kv_role": role, "kv_connector_extra_config": extra}
    if module is not None:
        ktc["kv_connector_module_path"] = module
    return scheduler_for(ktc, block_size=BLOCK_SIZE)


def registered(prompt: list[int], module: str | None = OURS, salt: str | None = None) -> dict[str, Any]:
    """What a push decode registers with the prefill for ``prompt`` (with a cache salt)."""
    scheduler = push_scheduler("kv_consumer", module)
    request = decode_request(len(prompt), block_size=BLOCK_SIZE, prompt=prompt, remote_block_ids=[])
    request.cache_salt = salt
    scheduler.add_request(request)
    out, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return dict(out.kv_connector_metadata.push_registrations[request.request_id])


def computed(prompt: list[int]) -> str:
    """The digest a push prefill hands its workers with the blocks of ``prompt``."""
    scheduler = push_scheduler("kv_producer")
    request = prefill_request(len(prompt), block_size=BLOCK_SIZE, prompt=prompt)
    scheduler.add_request(request)
    step(scheduler)
    assert request.is_finished()
    out, _ = step(scheduler)
    meta = out.kv_connector_metadata
    assert request.request_id in meta.push_finished_blocks
    digests = getattr(meta, PUSH_PROMPTS_ATTR)
    assert set(digests) == {request.request_id}
    return str(digests[request.request_id])


def test_the_decode_registers_its_prompts_digest_and_the_prefill_the_same_for_the_same_prompt() -> None:
    prompt = [3 + i % 500 for i in range(3 * BLOCK_SIZE + 5)]
    digest = registered(prompt)[PROMPT_KEY]
    assert digest == prompt_digest(prompt, (None, None, []))
    assert computed(prompt) == digest
    other = [*prompt[:-1], prompt[-1] + 1]  # one token changed, in the last partial block
    assert computed(other) != digest
    assert registered(prompt, salt="tenant-b")[PROMPT_KEY] != digest  # the salt is in the digest


def test_vllms_own_push_decode_registers_no_digest() -> None:
    """The control: vLLM's NixlPushConnector, whose registrations a keyless kvcompose prefill writes."""
    assert PROMPT_KEY not in registered([5] * (2 * BLOCK_SIZE), module=None)


def test_computed_digest_covers_exactly_the_tokens_the_blocks_hold() -> None:
    tokens = [7, 8, 9, 10]
    assert computed_digest(tokens, 3, ()) == prompt_digest([7, 8, 9])
    assert computed_digest(tokens, 4, ()) != computed_digest(tokens, 3, ())


# ---------------------------------------------------------------------------- the worker halves


class Wrapper:
    """The NIXL agent calls the guard makes: notifications sent, and those to deliver."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.inbox: dict[str, list[bytes]] = {}

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        self.sent.append((agent, notif_msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        inbox, self.inbox = self.inbox, {}
        return inbox


class Worker(SimpleNamespace):
    """The attributes of vLLM's NixlPushConnectorWorker that :class:`PushGuard` touches."""

    def __init__(self) -> None:
        super().__init__(
            nixl_wrapper=Wrapper(),
            written=[],
            handshake=None,
            _handshake_lock=threading.Lock(),
            _remote_agents={},
            _deferred_push_inbox=queue.Queue(),
            _push_writer_wake=threading.Event(),
            _push_finished_blocks={},
            _pending_d_registrations={},
            _recving_metadata={},
            _failed_recv_reqs=queue.Queue(),
            results=SimpleNamespace(finished_sending=set()),
        )
        self._pop_matching_registration = NixlPushConnectorWorker._pop_matching_registration.__get__(self)

    def _do_start_push_kv(self, request_id: str, blocks: Any, registration: dict[str, Any]) -> None:
        self.written.append((request_id, registration["request_id"]))

    def _ensure_handshake(self, engine: str, host: str, port: int, tp_size: int) -> Future[Any] | None:
        return self.handshake

    def start_load_kv(self, metadata: Any) -> None:
        pass

    def get_transfer_results(self) -> Any:
        return self.results

    def failed(self) -> list[str]:
        out = []
        while not self._failed_recv_reqs.empty():
            out.append(self._failed_recv_reqs.get_nowait())
        return out


def registration(digest: Any, request_id: str = "cmpl-x-bbbbbbbb", engine: str = "decode-engine") -> dict[str, Any]:
    reg = {
        "request_id": request_id,
        "decode_engine_id": engine,
        "decode_host": "127.0.0.1",
        "decode_port": 5602,
        "decode_tp_size": 1,
        "local_block_ids": ([4, 5],),
    }
    if digest is not None:
        reg[PROMPT_KEY] = digest
    return reg


def prefill(keys: Keyring | None = None, accept_unsigned: bool = False) -> tuple[Worker, PushGuard]:
    """A prefill worker that computed prompt A for request ``cmpl-x-aaaaaaaa``, and knows the decode's agent."""
    worker = Worker()
    guard = guard_pushes(worker, keys, accept_unsigned)
    worker.start_load_kv(SimpleNamespace(**{PUSH_PROMPTS_ATTR: {"cmpl-x-aaaaaaaa": A}}))
    worker._remote_agents["decode-engine"] = {(0, 0): "decode-agent"}
    return worker, guard


def test_the_prefill_writes_a_matching_registration() -> None:
    worker, guard = prefill()
    worker._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(A))
    assert worker.written == [("cmpl-x-aaaaaaaa", "cmpl-x-bbbbbbbb")]
    assert not worker.nixl_wrapper.sent and not guard.refused


@pytest.mark.parametrize("keys", [None, Keyring.parse(KEY, "test")], ids=["keyless", "keyed"])
def test_the_prefill_writes_nothing_for_another_prompt_and_tells_the_decode(keys: Keyring | None) -> None:
    worker, guard = prefill(keys)
    worker._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(B))
    assert worker.written == []
    assert guard.refused == {"prompt": 1}
    ((agent, msg),) = worker.nixl_wrapper.sent
    assert agent == "decode-agent" and msg.startswith(NOPUSH)
    body = msg[len(NOPUSH) :] if keys is None else keys.untag(msg[len(NOPUSH) :])
    assert body is not None and msgspec.msgpack.decode(body) == ["cmpl-x-bbbbbbbb"]
    # The blocks are kept: the decode that registered the prompt computed is still written.
    assert worker._push_finished_blocks == {"cmpl-x-aaaaaaaa": ([1, 2],)}


def test_a_refused_registration_does_not_take_the_blocks_from_one_that_matches() -> None:
    """A mismatching registration and a matching one for the same request (the same id without
    vLLM's random suffix): the first is refused, the second written."""
    worker, guard = prefill()
    worker._pending_d_registrations["cmpl-x-cccccccc"] = registration(A, "cmpl-x-cccccccc")
    worker._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(B))
    assert worker.written == [("cmpl-x-aaaaaaaa", "cmpl-x-cccccccc")]
    assert guard.refused == {"prompt": 1} and not worker._push_finished_blocks


@pytest.mark.parametrize(
    ("keyed", "accept_unsigned", "written"),
    [(False, False, True), (True, True, True), (True, False, False)],
    ids=["no key: vLLM's own decode is written", "accept_unsigned: written", "a key: refused"],
)
def test_a_registration_without_a_digest(keyed: bool, accept_unsigned: bool, written: bool) -> None:
    worker, guard = prefill(Keyring.parse(KEY, "test") if keyed else None, accept_unsigned)
    worker._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(None))
    assert bool(worker.written) == written
    assert guard.refused == ({} if written else {"prompt": 1})


def test_a_request_written_or_expired_is_forgotten_and_then_refused() -> None:
    """Once vLLM reports the request's sending done, its digest is gone: a late registration is
    refused (its blocks may be another request's by then), not written."""
    worker, guard = prefill()
    worker.results.finished_sending = {"cmpl-x-aaaaaaaa"}
    worker.get_transfer_results()
    assert guard.computed == {}
    worker._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(A))
    assert worker.written == [] and guard.refused == {"prompt": 1}
    assert not worker._push_finished_blocks  # not kept: vLLM evicted them


def test_the_refusal_waits_for_the_handshake_to_the_decode() -> None:
    worker, guard = prefill()
    del worker._remote_agents["decode-engine"]
    worker.handshake = Future()
    worker._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(B))
    assert not worker.nixl_wrapper.sent and worker._deferred_push_inbox.empty() and not guard.refused
    worker._remote_agents["decode-engine"] = {(0, 0): "decode-agent"}
    worker.handshake.set_result(({(0, 0): "decode-agent"}, 0.0))
    assert worker._push_writer_wake.is_set()
    rid, blocks, reg = worker._deferred_push_inbox.get_nowait()
    worker.handshake = None  # vLLM's writer re-drives the entry once the handshake is done
    worker._do_start_push_kv(rid, blocks, reg)
    assert [a for a, _ in worker.nixl_wrapper.sent] == ["decode-agent"] and guard.refused == {"prompt": 1}
    assert worker.written == []


def decode(keys: Keyring | None = None) -> tuple[Worker, PushGuard]:
    """A decode worker waiting for prefill-engine's push of ``cmpl-x-bbbbbbbb``."""
    worker = Worker()
    guard = guard_pushes(worker, keys, False)
    worker._remote_agents["prefill-engine"] = {(0, 0): "prefill-agent"}
    worker._recving_metadata["cmpl-x-bbbbbbbb"] = SimpleNamespace(remote=SimpleNamespace(engine_id="prefill-engine"))
    return worker, guard


def nopush(request_id: str, keys: Keyring | None = None) -> bytes:
    body = msgspec.msgpack.encode((request_id,))
    return NOPUSH + (keys.tag(body) + body if keys is not None else body)


@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
def test_the_decode_fails_the_load_the_prefill_refused(keyed: bool) -> None:
    """The round trip: the prefill's refusal, delivered to the decode's agent, fails its load."""
    keys = Keyring.parse(KEY, "test") if keyed else None
    p, _ = prefill(keys)
    d, guard = decode(keys)
    p._do_start_push_kv("cmpl-x-aaaaaaaa", ([1, 2],), registration(B))
    ((_, msg),) = p.nixl_wrapper.sent
    d.nixl_wrapper.inbox = {"prefill-agent": [msg, b"cmpl-x-0-d7:1", PUSH_REG_NOTIF_PREFIX + b"\x80"]}
    kept = d.nixl_wrapper.get_new_notifs()
    assert kept == {"prefill-agent": [b"cmpl-x-0-d7:1", PUSH_REG_NOTIF_PREFIX + b"\x80"]}  # vLLM's own, untouched
    assert d.failed() == ["cmpl-x-bbbbbbbb"] and guard.refusals_taken == 1


@pytest.mark.parametrize(
    ("agent", "msg"),
    [
        pytest.param("other-agent", nopush("cmpl-x-bbbbbbbb"), id="from an agent of another engine"),
        pytest.param("prefill-agent", nopush("cmpl-x-0-d9"), id="for a request this decode does not wait for"),
        pytest.param("prefill-agent", NOPUSH + b"\xc1", id="a body that does not parse"),
        pytest.param("prefill-agent", nopush("x" * 300), id="an id longer than any"),
    ],
)
def test_a_refusal_counts_only_from_the_requests_prefill(agent: str, msg: bytes) -> None:
    d, guard = decode()
    d.nixl_wrapper.inbox = {agent: [msg]}
    assert d.nixl_wrapper.get_new_notifs() == {}
    assert d.failed() == [] and guard.refusals_taken == 0


def test_under_a_key_a_refusal_needs_its_mac() -> None:
    keys = Keyring.parse(KEY, "test")
    d, guard = decode(keys)
    d.nixl_wrapper.inbox = {"prefill-agent": [nopush("cmpl-x-bbbbbbbb")]}  # no MAC
    d.nixl_wrapper.get_new_notifs()
    assert d.failed() == []
    d.nixl_wrapper.inbox = {"prefill-agent": [nopush("cmpl-x-bbbbbbbb", Keyring.parse("o" * 64, "other"))]}
    d.nixl_wrapper.get_new_notifs()
    assert d.failed() == []
    d.nixl_wrapper.inbox = {"prefill-agent": [nopush("cmpl-x-bbbbbbbb", keys)]}  # the control
    d.nixl_wrapper.get_new_notifs()
    assert d.failed() == ["cmpl-x-bbbbbbbb"] and guard.refusals_taken == 1


def test_notifications_vllm_cannot_parse_are_dropped_before_its_main_thread() -> None:
    """vLLM's push worker splits every notification but PUSH_REG on its main thread
    (``rsplit(":", 1)``): one without a count would raise in the engine's step."""
    d, _ = decode()
    d.nixl_wrapper.inbox = {"x": [b"no-count", b"\xff\xfe", b"kvcompose:what?", b"HB:cmpl-x-aaaaaaaa", b"r:1"]}
    assert d.nixl_wrapper.get_new_notifs() == {"x": [b"HB:cmpl-x-aaaaaaaa", b"r:1"]}


# ---------------------------------------------------------------------------- P/D over the fake agent

BLOCK = 32  # the CPU attention kernel's block size, which NIXL's worker checks


def push_composition(role: str, port: int) -> str:
    return f"""version: 1
load_failure: recompute
connectors:
  - name: pd
    type: nixl
    role: {role}
    options: {{mode: push, side_channel_host: 127.0.0.1, side_channel_port: {port}}}
"""


#: vLLM's own NixlPushConnector on a decode (the control), with kv_load_failure_policy recompute.
VLLMS_PUSH_DECODE = {
    "kv_connector": "NixlPushConnector",
    "kv_role": "kv_consumer",
    "engine_id": "vllm-decode",
    "kv_load_failure_policy": "recompute",
}
#: ... and on a prefill (the other control: it ignores the digest a kvcompose decode registers).
VLLMS_PUSH_PREFILL = {"kv_connector": "NixlPushConnector", "kv_role": "kv_producer", "engine_id": "vllm-prefill"}


def prompt_of(seed: int, blocks: int = 3) -> list[int]:
    return [3 + (i * 37 + seed * 101) % 490 for i in range(blocks * BLOCK)]


@pytest.mark.parametrize(
    ("prefill_side", "decode_side", "sent", "outcome"),
    [
        pytest.param("kvcompose", "kvcompose", "a", "written", id="control: the prompt the prefill computed"),
        pytest.param("kvcompose", "kvcompose", "b", "refused", id="another prompt of equal length"),
        pytest.param("kvcompose", "kvcompose", "a changed", "refused", id="one token changed in the last block"),
        pytest.param("kvcompose", "vllm", "b", "taken", id="vLLM's own decode: A's KV taken for B"),
        pytest.param("vllm", "kvcompose", "b", "taken", id="vLLM's own prefill: A's KV written for B"),
    ],
)
def test_a_push_writes_only_the_prompt_the_decode_holds(
    fake_nixl: FakeNixl, prefill_side: str, decode_side: str, sent: str, outcome: str
) -> None:
    """vLLM's real push workers and schedulers over the fake agent: the prefill computes A for a
    request id, the decode registers that id for ``sent``. kvcompose's prefill writes A only into a
    decode that registered A; otherwise its decode's load fails and it computes its own prompt."""
    p, d = fake_nixl.pair(
        push_composition("producer", 5941) if prefill_side == "kvcompose" else VLLMS_PUSH_PREFILL,
        push_composition("consumer", 5942) if decode_side == "kvcompose" else VLLMS_PUSH_DECODE,
    )
    fake_nixl.handshake(p, d)  # the prefill's handshake to the decode, which it makes to write
    a = prompt_of(1)
    prompt = {"a": a, "b": prompt_of(2), "a changed": [*a[:-1], a[-1] + 1]}[sent]
    preq = prefill_request(len(a), block_size=BLOCK, prompt=a, request_id="cmpl-r-aaaaaaaa")
    p.scheduler.add_request(preq)
    _, eco = p.engine_step(write_blocks=True)
    (params,) = [o.kv_transfer_params for e in eco.values() for o in e.outputs if o.kv_transfer_params]
    dreq = make_request(
        len(prompt),
        block_size=BLOCK,
        prompt=prompt,
        request_id="cmpl-r-bbbbbbbb",  # the same request without vLLM's random suffix
        max_tokens=2,
        kv_transfer_params=dict(params),
    )
    d.scheduler.add_request(dreq)
    seen: dict[str, bool] = {}

    def reported(_o: object) -> bool:
        p.engine_step(write_blocks=True)
        out = d.last_output
        if out is not None:
            seen["failed"] = seen.get("failed", False) or dreq.request_id in (out.failed_recving or ())
            seen["done"] = seen.get("done", False) or dreq.request_id in (out.finished_recving or ())
        return seen.get("done", False)

    d.step_until(reported, "the decode's load was never reported", max_steps=40)
    (ids,) = d.scheduler.kv_cache_manager.get_block_ids(dreq.request_id)
    holds_a = all(d.holds_prefix(b, a[: (k + 1) * BLOCK]) for k, b in enumerate(ids))
    if outcome == "refused":
        assert seen["failed"] and not holds_a
        assert p.child("pd").push_guard.refused == {"prompt": 1}
        assert d.child("pd").push_guard.refusals_taken == 1
        d.step_until(lambda _o: dreq.num_computed_tokens >= len(prompt), "the prompt was not computed", eos=True)
    else:
        assert not seen["failed"] and holds_a  # written: A's KV, for A (the control) or for B (vLLM's own side)
