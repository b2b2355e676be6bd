"""A decode instance never computes from KV it finished reading after the prefill released it,
and never refuses a read whose blocks the prefill still held.

vLLM's prefill instance keeps a finished request's blocks for the decode instance's read until
a lease ends: ``kv_lease_duration`` (30 s) after the request finished, renewed by the decode's
heartbeats (sent every lease/6 while the request waits, each extending the lease to 2/3 of it
from the moment the prefill reads it). When the lease ends first, the prefill frees the blocks
(``Releasing expired KV blocks ...``) and may give them to another request; a read that ends
later (``Potentially invalid KV blocks ... were retrieved by a decode worker``) may have copied
that other request's KV, and vLLM's decode computes from it without a sign.

A heartbeat is a one-way NIXL notification: sent is not arrived. Across a cut link the beats
wait in the transport and reach the prefill after it released the blocks (UCX over tcp carries
notifications and reads on lanes of their own, whose connections recover at different times),
so the decode cannot extend the lease it checks by the beats it sent. It extends it by the
prefill's answers instead:

* the prefill's scheduler (:func:`stamp`) adds the lease's first end to the ``kv_transfer_params``
  it returns, as vLLM's own ``remote_blocks_expiry_time`` (vLLM fills that field only for a
  decode instance's blocks, for bidirectional transfers), and :data:`~kvcompose_nixl.LEASE_ANSWERS_KEY`: this prefill
  answers lease questions;
* the decode's worker (:class:`LeaseWatch`), right after vLLM sent its heartbeats to such a
  prefill, asks it (its own notification, :data:`ASK`) how long each of those requests' blocks
  are still held, the first time giving it the address to answer to (:data:`HELLO`);
* the prefill's worker (:class:`LeaseDesk`) answers (:data:`ANSWER`) once vLLM has applied the
  beats that came before the question: the seconds left on each lease it still holds;
* the decode takes a read as held until the later of the stamped end and ``asked at + seconds
  left`` (the answer was made after the question was sent, so the lease ran at least that long:
  no clocks compared). A read that ends after that counts as failed instead of done: vLLM marks
  the request's blocks invalid, the request recomputes them or fails under
  ``kv_load_failure_policy``, and vLLM's ``vllm:nixl_num_kv_expired_reqs`` counts it, as it counts
  a read vLLM itself declines as expired. The prefill instance is not notified (it released the
  blocks already).

A read that ends inside the stamped end costs nothing more; questions go out only with vLLM's
heartbeats, to waiting requests. Across a cut link no answer comes (or it comes late, and the
read was refused meanwhile): nothing released is used, as before. Questions go only to a prefill
that stamped :data:`~kvcompose_nixl.LEASE_ANSWERS_KEY` (vLLM's own NixlConnector would log each one as a read of an
unknown request); a prefill that stamps an end but does not answer (an older kvcompose) leaves
the stamped end, and a prefill with vLLM's own NixlConnector stamps nothing: its reads are taken
unchecked, as vLLM takes them (``kvcompose check`` says so for a consumer).

The protocol answers only what it can authenticate: with a deployment key
(:class:`kvcompose_nixl.trust.Keyring`) a hello carries sealed metadata (the prefill loads no
agent that cannot open it), and every question and answer carries a MAC. With or without a key
an answer counts only for the requests its question named, for at most the lease's seconds, and
a question names at most :data:`MAX_IDS` requests.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from kvcompose_nixl import LEASE_ANSWERS_KEY
from kvcompose_nixl.trust import MAX_ID_CHARS, Keyring, Refused, drop

log = logging.getLogger("kvcompose.nixl")
#: Under vLLM's logger, whose INFO lines reach the server's log.
vllm_log = logging.getLogger("vllm.kvcompose.nixl")

#: vLLM's ``kv_transfer_params`` key for the end of a lease on the sender's blocks
#: (``nixl/metadata.py``: read into ``RemoteMeta.blocks_expiry_time``).
LEASE_END_KEY = "remote_blocks_expiry_time"
#: How the decode's log starts the line of a read it refused (the soak matches it with the
#: prefill's ``Potentially invalid KV blocks`` line for the same request).
REFUSED = "NIXL read refused:"
#: How the decode's log starts the line of a read vLLM did not make but notified the prefill of
#: (an abort before the read, a full local hit): a late notification of it freed nothing read.
RELEASED = "NIXL release without a read:"

#: The attribute of vLLM's ``NixlConnectorMetadata`` that carries, from the decode's scheduler to
#: its workers, the prefill engines of this step's heartbeats that answer lease questions.
ANSWERING_ATTR = "kvcompose_lease_answering"
#: ... and the requests of this step's reads whose prefill answers each read (:data:`READS`).
READ_ANSWERS_ATTR = "kvcompose_read_answers"

#: The protocol's notifications, prefixed so that they are taken out before vLLM reads its own;
#: each kind is as long as :data:`HELLO`.
PREFIX = b"kvcompose:"
#: decode -> prefill, once per prefill agent: + the decode agent's connection metadata.
HELLO = PREFIX + b"hello:"
#: decode -> prefill: + msgpack ``[question number, [prefill request ids]]``.
ASK = PREFIX + b"lease?"
#: prefill -> decode: + msgpack ``[question number, {prefill request id: seconds left}]``.
ANSWER = PREFIX + b"lease="
#: prefill -> decode: + msgpack ``[[prefill request id, held], ...]``: whether each of the
#: decode agent's read notifications found the request's blocks still held for it.
READS = PREFIX + b"reads="
#: What a prefill stamps in :data:`~kvcompose_nixl.LEASE_ANSWERS_KEY`: 1, it answers lease
#: questions; 2, it also answers every read (:data:`READS`), and its decodes wait for that answer.
PROTOCOL = 2
#: The longest a decode waits for the prefill's answer to a finished read before it counts the
#: read failed (the prompt is then computed here): the prefill answers at its next worker step.
READ_ANSWER_WAIT_S = 10.0
#: A question unanswered this long is forgotten (a late answer is then ignored: the safe side).
FORGET_S = 300.0
#: The most request ids one question names, and questions a prefill keeps waiting for its step.
MAX_IDS = 4096
MAX_PENDING = 1024

#: The longest notification of vLLM's taken (a heartbeat names every request waiting on one
#: prefill: thousands of ids fit).
MAX_NOTIF = 1 << 20
_ID = f"[^,]{{1,{MAX_ID_CHARS}}}"
_VLLMS_NOTIF = re.compile(rf"HB:{_ID}(?:,{_ID})*|.{{1,{MAX_ID_CHARS}}}:[1-9][0-9]{{0,3}}", re.S)

_encode = msgspec.msgpack.Encoder().encode
_questions = msgspec.msgpack.Decoder(tuple[int, list[str]])
_answers = msgspec.msgpack.Decoder(tuple[int, dict[str, float]])
_read_answers = msgspec.msgpack.Decoder(list[tuple[str, bool]])


def vllms_own(msg: bytes) -> bool:
    """Whether ``msg`` is one of vLLM's own notifications as vLLM's worker parses them
    (``nixl/pull_worker.py`` ``_get_new_notifs``): a heartbeat, ``HB:`` and request ids joined
    by commas, or a finished read, a request id, ``:`` and how many readers to wait for. vLLM
    parses them unguarded: one that is not UTF-8, or has no colon or no count, raises in the
    worker's step and the engine dies."""
    if len(msg) > MAX_NOTIF:
        return False
    try:
        text = msg.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return _VLLMS_NOTIF.fullmatch(text) is not None


def stamp(scheduler: Any, request_id: str, params: dict[str, Any] | None) -> None:
    """On the prefill instance: add the lease's end of ``request_id``'s blocks, and that this
    instance answers lease questions, to the ``kv_transfer_params`` vLLM's ``request_finished``
    returned for a decode instance."""
    if not params or not params.get("do_remote_prefill") or params.get(LEASE_END_KEY) is not None:
        return
    expires = scheduler._reqs_need_send.get(request_id)
    if expires is not None:
        params[LEASE_END_KEY] = expires
        params[LEASE_ANSWERS_KEY] = PROTOCOL


def answering_engine(params: dict[str, Any]) -> str | None:
    """The prefill engine of a decode request's ``params`` when it answers lease questions."""
    engine = params.get("remote_engine_id")
    return str(engine) if engine is not None and params.get(LEASE_ANSWERS_KEY) else None


def answers_reads(params: dict[str, Any]) -> bool:
    """Whether the prefill of a decode request's ``params`` answers each read (:data:`READS`)."""
    version = params.get(LEASE_ANSWERS_KEY)
    return type(version) is int and version >= PROTOCOL


def _name(agent: str | bytes) -> str:
    """NIXL names an agent in bytes where it loads one and in str where it gives notifications."""
    return agent.decode() if isinstance(agent, bytes) else agent


def connection_metadata(agent: Any) -> bytes:
    """``agent``'s connection info without its memory (NIXL's partial metadata): what a peer
    loads to send it notifications, a few hundred bytes where the whole metadata of a decode
    instance's KV is kilobytes."""
    import nixl._api as api
    import numpy as np

    no_memory = api.nixlBind.nixlRegDList(agent.nixl_mems["DRAM"], np.zeros((0, 3), dtype=np.uint64))
    return agent.get_partial_agent_metadata(no_memory, True, [])  # type: ignore[no-any-return]


class _Messages:
    """The protocol's notifications, each with a MAC when there is a deployment key."""

    def __init__(self, keys: Keyring | None) -> None:
        self.keys = keys

    def pack(self, kind: bytes, body: bytes) -> bytes:
        return kind + (self.keys.tag(body) + body if self.keys is not None else body)

    def unpack(self, msg: bytes) -> bytes | None:
        body = msg[len(HELLO) :]
        return body if self.keys is None else self.keys.untag(body)


def lease_halves(worker: Any, keys: Keyring | None = None, lease_s: float = 30.0) -> tuple[LeaseWatch, LeaseDesk]:
    """Both halves for vLLM's pull-mode NIXL worker (a worker may serve and read), sharing the
    protocol's messages; :func:`kvcompose_nixl.patches.watch_leases` installs their wrappers.
    ``keys``: the deployment key, if any; ``lease_s``: the most seconds an answer may grant."""
    messages = _Messages(keys)
    return LeaseWatch(worker, messages, lease_s), LeaseDesk(worker, messages)


def notification_filter(
    get_new_notifs: Callable[..., dict[str, list[bytes]]], watch: LeaseWatch, desk: LeaseDesk
) -> Callable[..., dict[str, list[bytes]]]:
    """The agent's ``get_new_notifs`` that hands the protocol's notifications to ``watch`` and
    ``desk``, and tells ``desk`` of vLLM's read notifications, before vLLM reads its own; a
    notification vLLM cannot parse is dropped."""
    handlers: dict[bytes, Callable[[str, bytes], None]] = {
        HELLO: desk.hello,
        ASK: desk.asked,
        ANSWER: watch.answered,
        READS: watch.reads_answered,
    }

    def vllms_notifs(*args: Any, **kwargs: Any) -> dict[str, list[bytes]]:
        notifs = get_new_notifs(*args, **kwargs)
        if not notifs:
            return notifs
        kept: dict[str, list[bytes]] = {}
        reads: list[tuple[str, str]] = []
        for agent, msgs in notifs.items():
            for msg in msgs:
                if msg.startswith(PREFIX):
                    handler = handlers.get(msg[: len(HELLO)])
                    if handler is None:
                        drop("NIXL notification of an unknown kvcompose kind", f"from {_name(agent)}: {msg[:40]!r}")
                    else:
                        handler(_name(agent), msg)
                elif vllms_own(msg):
                    kept.setdefault(agent, []).append(msg)
                    if not msg.startswith(b"HB:"):
                        reads.append((_name(agent), msg.decode()))
                else:
                    drop("NIXL notification vLLM cannot parse", f"from {_name(agent)}: {msg[:40]!r}")
        if reads:  # before vLLM counts them: which find their blocks held
            desk.reads(reads)
        return kept

    return vllms_notifs


@dataclass
class _Lease:
    engine_id: str
    remote_request_id: str
    #: the lease's first end in the prefill scheduler's clock (None: not stamped)
    expires: float | None
    #: whether the read waits for the prefill's answer that its blocks were held (:data:`READS`)
    answered: bool = False


class LeaseDesk:
    """The prefill's half: loads the address of each decode agent that says hello, and answers
    its lease questions after vLLM's ``_get_new_notifs`` applied the heartbeats before them
    (:meth:`answering`, which :func:`kvcompose_nixl.patches.watch_leases` installs)."""

    def __init__(self, worker: Any, messages: _Messages) -> None:
        self._worker = worker
        self._messages = messages
        #: decode agents loaded to answer to
        self._peers: set[str] = set()
        self._questions: list[tuple[str, int, list[str]]] = []
        #: decode agent -> (since when, [(prefill request id, held)]): read answers to send
        self._reads: dict[str, tuple[float, list[tuple[str, bool]]]] = {}

    def hello(self, agent: str, msg: bytes) -> None:
        if agent in self._peers:
            return
        try:  # sealed with a deployment key: the agent wrapper opens it, or refuses it
            self._worker.nixl_wrapper.add_remote_agent(msg[len(HELLO) :])
        except Refused as exc:  # not sealed with this deployment's key
            drop("NIXL lease hello that the deployment key does not open (it gets no answers)", f"from {agent}: {exc}")
            return
        except Exception as exc:  # its reads then stay checked against the stamped end only
            drop("NIXL lease hello whose agent does not load (it gets no answers)", f"from {agent}: {exc}")
            return
        self._peers.add(agent)
        log.debug("NIXL lease answers: decode agent %s loaded", agent)

    def asked(self, agent: str, msg: bytes) -> None:
        if agent not in self._peers:
            drop("NIXL lease question from an agent that said no hello", f"from {agent}")
            return
        body = self._messages.unpack(msg)
        if body is None:
            drop("NIXL lease question that the deployment key does not authenticate", f"from {agent}")
            return
        try:
            if len(self._questions) >= MAX_PENDING:
                raise ValueError
            number, request_ids = _questions.decode(body)
            if len(request_ids) > MAX_IDS:
                raise ValueError
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            drop("NIXL lease question that does not parse or is too long", f"from {agent}")
            return
        self._questions.append((agent, number, request_ids))

    def reads(self, notifs: list[tuple[str, str]]) -> None:
        """vLLM's read notifications (``request id:readers``) of one poll, in order, before
        vLLM's ``_get_new_notifs`` counts them: each is held if its request's blocks are still
        held when it arrives, as vLLM counts it (the last of a request's readers frees them; a
        notification after that, or after the lease freed them, read blocks that may be reused)."""
        worker = self._worker
        counts = worker.consumer_notification_counts_by_req
        seen: dict[str, int] = {}
        freed: set[str] = set()
        now = time.perf_counter()
        for agent, msg in notifs:
            request_id, _, readers = msg.rpartition(":")
            held = request_id not in freed and (
                request_id in worker._reqs_to_send or request_id in worker._reqs_to_process
            )
            if held:
                seen[request_id] = seen.get(request_id, 0) + 1
                if counts.get(request_id, 0) + seen[request_id] >= int(readers):
                    freed.add(request_id)
            since, answers = self._reads.setdefault(agent, (now, []))
            if len(answers) < MAX_IDS and (agent in self._peers or len(self._reads) <= MAX_PENDING):
                answers.append((request_id, held))
            elif not answers:
                del self._reads[agent]

    def answering(self, get_new_notifs: Callable[[], set[str]]) -> Callable[[], set[str]]:
        """vLLM's worker's ``_get_new_notifs``, then the answers to the questions and reads it applied."""

        def get_new_notifs_then_answer() -> set[str]:
            done = get_new_notifs()
            if self._questions:
                self._answer()
            if self._reads:
                self._answer_reads()
            return done

        return get_new_notifs_then_answer

    def _answer_reads(self) -> None:
        """Tell each loaded decode agent whether its reads found their blocks held; keep the
        answers of an agent whose hello has not come yet, for :data:`FORGET_S`."""
        now = time.perf_counter()
        for agent in list(self._reads):
            since, answers = self._reads[agent]
            if agent in self._peers:
                del self._reads[agent]
                try:
                    self._worker.nixl_wrapper.send_notif(agent, self._messages.pack(READS, _encode(answers)))
                except Exception as exc:  # a decode gone away: its reads count failed when it waits no more
                    log.debug("NIXL read answers to %s not sent: %s", agent, exc)
            elif now - since > FORGET_S:
                del self._reads[agent]

    def _answer(self) -> None:
        now = time.perf_counter()
        held: dict[str, float] = self._worker._reqs_to_send
        for agent, number, request_ids in self._questions:
            left = {r: held[r] - now for r in request_ids if held.get(r, now) > now}
            if agent not in self._peers:
                continue  # its hello did not load: nothing to answer to
            try:
                self._worker.nixl_wrapper.send_notif(agent, self._messages.pack(ANSWER, _encode((number, left))))
            except Exception as exc:  # a decode gone away: its reads, if any, stay checked
                log.debug("NIXL lease answer to %s not sent: %s", agent, exc)
        self._questions.clear()


class LeaseWatch:
    """The decode's half. Makes the wrappers of three methods of vLLM's pull-mode NIXL worker,
    which :func:`kvcompose_nixl.patches.watch_leases` installs on the instance:
    ``start_load_kv`` records each read's lease (and logs a release made without a read) and
    greets the prefill agents it reads from (:meth:`recording`), ``_send_heartbeats`` asks the
    prefill how long the beaten leases now run (:meth:`asking`), ``_pop_done_transfers`` holds a
    finished read until the prefill answered that its notification found the blocks held
    (:data:`READS`), and fails a read that ended after its lease, was not held, or was not
    answered in :data:`READ_ANSWER_WAIT_S` (:meth:`checking`)."""

    def __init__(self, worker: Any, messages: _Messages, lease_s: float) -> None:
        self._worker = worker
        self._messages = messages
        self._lease_s = lease_s
        self._leases: dict[str, _Lease] = {}
        #: prefill request id -> prefill agent -> until when (our clock) its answer holds the blocks
        self._held: dict[str, dict[str, float]] = {}
        #: question number -> (prefill agent, when asked, the request ids asked about)
        self._asked: dict[int, tuple[str, float, frozenset[str]]] = {}
        self._numbers = itertools.count(1)
        self._greeted: set[str] = set()
        #: prefill engines of reads that wait for answers, whose agents are not all greeted yet
        self._to_greet: set[str] = set()
        #: prefill request id -> prefill agent -> whether its answer says the read found the blocks held
        self._read_answers: dict[str, dict[str, bool]] = {}
        #: finished reads waiting for the prefill's answer, since when (our clock)
        self._awaiting: dict[str, float] = {}
        #: Reads reported failed because they ended after their lease.
        self.late_reads = 0
        #: Reads reported failed because the prefill did not hold their blocks for them (another
        #: reader, or the lease, freed them first) or did not say so in time.
        self.unheld_reads = 0

    def deadline(self, request_id: str) -> float | None:
        """Until when, in this process's ``perf_counter``, the prefill holds ``request_id``'s
        blocks as far as this decode knows: the stamped end, or a later one its answers gave.
        ``None`` when the prefill did not stamp it or no handshake measured the offset."""
        lease = self._leases.get(request_id)
        if lease is None or lease.expires is None:
            return None
        offset = self._worker._engine_clock_offset.get(lease.engine_id)
        if offset is None:
            return None
        first = lease.expires - offset
        answered = self._answered_until(lease)
        return first if answered is None else max(first, answered)

    def _answered_until(self, lease: _Lease) -> float | None:
        """The earliest end that every agent of the prefill engine answered for the lease."""
        per_agent = self._held.get(lease.remote_request_id)
        agents = self._worker._remote_agents.get(lease.engine_id)
        if not per_agent or not agents:
            return None
        ends = [per_agent.get(_name(a)) for a in agents.values()]
        return None if None in ends else min(ends)  # type: ignore[type-var]

    def answered(self, agent: str, msg: bytes) -> None:
        body = self._messages.unpack(msg)
        try:
            if body is None:
                raise ValueError
            number, left = _answers.decode(body)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            drop("NIXL lease answer that is not authenticated or does not parse", f"from {agent}")
            return
        asked = self._asked.get(number)
        if asked is None or asked[0] != agent:
            return  # forgotten, or not asked of this agent
        del self._asked[number]
        _, asked_at, question = asked
        for request_id, seconds in left.items():
            if request_id not in question or not math.isfinite(seconds) or seconds <= 0:
                continue  # not asked about, or not held: nothing to extend
            per_agent = self._held.setdefault(request_id, {})
            # An answer grants at most one lease from the question: no more than a prefill can hold.
            per_agent[agent] = max(per_agent.get(agent, asked_at), asked_at + min(seconds, self._lease_s))

    def reads_answered(self, agent: str, msg: bytes) -> None:
        """The prefill agent's answers to this decode's reads: whether each found its blocks held."""
        body = self._messages.unpack(msg)
        try:
            if body is None:
                raise ValueError
            answers = _read_answers.decode(body)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            drop("NIXL read answer that is not authenticated or does not parse", f"from {agent}")
            return
        for request_id, held in answers:
            per_agent = self._read_answers.get(request_id)
            if per_agent is not None:  # a read of ours that waits: a "not held" is never undone
                per_agent[agent] = held and per_agent.get(agent, True)

    def recording(self, start_load_kv: Callable[[Any], None]) -> Callable[[Any], None]:
        """vLLM's worker's ``start_load_kv``, after each read's lease is recorded and the prefill's
        agents are greeted."""

        def start_load_kv_recorded(metadata: Any) -> None:
            answering = getattr(metadata, READ_ANSWERS_ATTR, None) or ()
            for req_id, meta in metadata.reqs_to_recv.items():
                remote = meta.remote
                if remote is None:
                    continue
                if not any(meta.local_block_ids):  # only notifies the prefill: nothing read, nothing computed
                    vllm_log.info("%s %s (prefill request %s)", RELEASED, req_id, remote.request_id)
                elif remote.blocks_expiry_time is not None or req_id in answering:
                    answered = req_id in answering
                    self._leases[req_id] = _Lease(
                        remote.engine_id, remote.request_id, remote.blocks_expiry_time, answered
                    )
                    if answered:
                        self._read_answers.setdefault(remote.request_id, {})
                        self._to_greet.add(remote.engine_id)
            # Before vLLM's reads (a handshake may complete between steps): the prefill loads this
            # decode's agent to answer them. Only engines not greeted yet: most steps, none.
            if self._to_greet:
                self._to_greet = {engine for engine in self._to_greet if not self._greet(engine)}
            start_load_kv(metadata)

        return start_load_kv_recorded

    def _greet(self, engine: str) -> bool:
        """Send each agent of the prefill ``engine`` this decode's connection metadata (:data:`HELLO`,
        sealed with a key), once: it answers to loaded agents only. Whether every agent is greeted."""
        agents = self._worker._remote_agents.get(engine)
        if not agents:
            return False  # the handshake is still pending
        wrapper = self._worker.nixl_wrapper
        greeted = True
        for agent in map(_name, agents.values()):
            if agent in self._greeted:
                continue
            hello = connection_metadata(wrapper)
            keys = self._messages.keys
            try:
                wrapper.send_notif(agent, HELLO + (keys.seal(hello) if keys is not None else hello))
            except Exception as exc:  # asked again at the next read or beat
                log.debug("NIXL hello to %s not sent: %s", agent, exc)
                greeted = False
                continue
            self._greeted.add(agent)
        return greeted

    def _held_for_us(self, lease: _Lease) -> bool | None:
        """Whether every agent of the lease's prefill answered that the read found the blocks held:
        True, False (one said not), or None (not every one answered yet)."""
        answers = self._read_answers.get(lease.remote_request_id, {})
        agents = self._worker._remote_agents.get(lease.engine_id)
        if not agents:
            return None
        told = [answers.get(_name(a)) for a in agents.values()]  # another agent's answer counts for nothing
        if False in told:
            return False
        return None if None in told else True

    def asking(self, send_heartbeats: Callable[[Any], None]) -> Callable[[Any], None]:
        """vLLM's worker's ``_send_heartbeats``, then the questions about the beaten leases."""

        def send_heartbeats_then_ask(metadata: Any) -> None:
            send_heartbeats(metadata)
            engines = getattr(metadata, ANSWERING_ATTR, None)
            if engines:
                self._ask(metadata.heartbeat_by_engine, engines)

        return send_heartbeats_then_ask

    def _ask(self, beats: dict[str, Any], engines: set[str]) -> None:
        """After vLLM's heartbeats to ``engines``: ask each of their agents about the beaten requests."""
        wrapper = self._worker.nixl_wrapper
        now = time.perf_counter()
        for engine in engines:
            info = beats.get(engine)
            agents = self._worker._remote_agents.get(engine)
            if info is None or not agents:
                continue  # no beat, or the handshake is still pending (vLLM sent none either)
            question = sorted(info.req_ids)
            self._greet(engine)
            for agent in map(_name, agents.values()):
                number = next(self._numbers)
                try:
                    if agent not in self._greeted:
                        continue  # its hello was not sent: it could not answer
                    wrapper.send_notif(agent, self._messages.pack(ASK, _encode((number, question))))
                except Exception as exc:  # as vLLM's beats: the read stays checked against what is known
                    log.debug("NIXL lease question to %s not sent: %s", agent, exc)
                    continue
                self._asked[number] = (agent, now, frozenset(question))
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop answers that no longer extend anything and questions too old to trust."""
        for request_id in [r for r, ends in self._held.items() if max(ends.values()) < now]:
            del self._held[request_id]
        for number in [n for n, (_, at, _ids) in self._asked.items() if now - at > FORGET_S]:
            del self._asked[number]

    def checking(
        self, pop_done: Callable[[dict[str, list[int]]], tuple[set[str], set[str]]]
    ) -> Callable[[dict[str, list[int]]], tuple[set[str], set[str]]]:
        """vLLM's worker's ``_pop_done_transfers``, with late, unheld and unanswered reads failed
        and reads that wait for the prefill's answer held back."""

        def pop_done_checked(transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
            done, failed = pop_done(transfers)
            if not self._leases:
                return done, failed
            now = time.perf_counter()
            for req_id in list(done):
                end = self.deadline(req_id)
                if end is not None and now > end:
                    done.discard(req_id)
                    failed.add(req_id)
                    self.late_reads += 1
                    self._worker.xfer_stats.record_kv_expired_req()
                    lease = self._leases[req_id]
                    log.warning(
                        "%s %s (prefill request %s) ended %.1f s after the prefill instance's lease on its "
                        "blocks, as far as its answers tell; the blocks may hold another request's KV: the "
                        "load counts as failed",
                        REFUSED,
                        req_id,
                        lease.remote_request_id,
                        now - end,
                    )
            if self._read_answers:  # after the lease's check: a late read fails at once
                self._hold_until_answered(done, failed, now)
            for req_id in done | failed:
                self._forget_read(req_id)
            if len(self._leases) > len(self._worker._recving_metadata):  # reads vLLM dropped (aborts)
                for req_id in [r for r in self._leases if r not in self._worker._recving_metadata]:
                    self._forget_read(req_id)
            return done, failed

        return pop_done_checked

    def _forget_read(self, req_id: str) -> None:
        lease = self._leases.pop(req_id, None)
        self._awaiting.pop(req_id, None)
        if lease is not None:
            self._held.pop(lease.remote_request_id, None)
            self._read_answers.pop(lease.remote_request_id, None)

    def _hold_until_answered(self, done: set[str], failed: set[str], now: float) -> None:
        """Take out of ``done`` each finished read that waits for the prefill's answer; put back
        those answered held, and into ``failed`` those answered not held or not answered in
        :data:`READ_ANSWER_WAIT_S` (vLLM marks their blocks invalid: the prompt is computed here)."""
        for req_id in done - failed:
            lease = self._leases.get(req_id)
            if lease is not None and lease.answered:
                done.discard(req_id)
                self._awaiting[req_id] = now
                self._worker._send_pending_recv_notifs(req_id)  # split reads notify only when done
                self._greet(lease.engine_id)
        for req_id, since in list(self._awaiting.items()):
            lease = self._leases[req_id]
            held = self._held_for_us(lease)
            if held is None and now - since <= READ_ANSWER_WAIT_S:
                continue
            del self._awaiting[req_id]
            if held:
                done.add(req_id)
                continue
            failed.add(req_id)
            self.unheld_reads += 1
            log.warning(
                "%s %s (prefill request %s): %s; the blocks may hold another request's KV: the load counts as failed",
                REFUSED,
                req_id,
                lease.remote_request_id,
                "the prefill answered that its blocks were no longer held for this read (another reader or the "
                "lease freed them first)"
                if held is False
                else f"the prefill did not answer in {READ_ANSWER_WAIT_S:g} s whether its blocks were held",
            )
