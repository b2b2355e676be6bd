"""Push mode's prompt binding: a prefill WRITEs a request's KV into a decode's blocks only when
the decode's prompt is the one it computed.

In push mode (vLLM's ``NixlPushConnector``) the decode registers the blocks it allocated for a
request with the prefill its params name (``push_scheduler.py`` ``update_state_after_alloc``:
``_push_pending_registrations``, sent as a ``PUSH_REG:`` NIXL notification by
``push_worker.py`` ``_send_registration_to_p``), and the prefill writes into them the KV of its
finished request with the same id, or the same id without vLLM's random suffix
(``push_worker.py`` ``_pop_matching_registration``, ``_do_start_push_kv``). Nothing compares
the two prompts: a client that sends prompt A to the prefill and prompt B to the decode under
one id has the decode answer B from A's KV. Here:

- the decode stamps the digest of the prompt tokens it counts as loaded, and of their context
  (:func:`kvcompose_nixl.trust.prompt_digest`, the inputs of pull mode's digest), into its
  registration (:func:`stamp_registration`, :data:`~kvcompose_nixl.trust.PROMPT_KEY`);
- the prefill's scheduler sends its workers, with each finished request's blocks, the digest of
  the tokens its blocks hold (:func:`computed_digest`, :data:`PUSH_PROMPTS_ATTR`);
- the prefill's worker (:class:`PushGuard`, installed by :func:`kvcompose_nixl.patches.guard_pushes`)
  checks the two before vLLM's ``_do_start_push_kv`` (:func:`kvcompose_nixl.trust.check_push`):
  it writes on a match; on a mismatch it writes nothing, tells each agent of the decode
  (:data:`NOPUSH`, after vLLM's own handshake to the decode, a MAC under a key) and keeps the
  blocks for a registration that matches, until vLLM's lease frees them;
- the decode's worker fails that request's load on the prefill's word (vLLM's
  ``_failed_recv_reqs``, as for a failed handshake): vLLM marks its blocks invalid and computes
  the prompt locally, or ends the request with an error under ``kv_load_failure_policy: fail``.
  A refusal counts only from an agent of the prefill engine the request registered with.

A decode without the binding (vLLM's own ``NixlPushConnector``) registers no digest: under a
deployment key, which only kvcompose decodes can use (sealed agent metadata), that is refused;
without one (or under ``accept_unsigned``) it is written as vLLM writes it. vLLM's own prefill
never checks: a kvcompose decode's digest is ignored by it (docs/security.md).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX

from kvcompose_nixl.lease import PREFIX, vllms_own
from kvcompose_nixl.trust import MAX_ID_CHARS, PROMPT_KEY, Keyring, Refused, check_push, drop, prompt_digest

log = logging.getLogger("kvcompose.nixl")

#: prefill -> decode: + msgpack ``[decode request id]`` (a MAC first under a key): the prefill
#: refused to write this request (as long as the lease protocol's kinds, ``kvcompose:hello:``).
NOPUSH = PREFIX + b"nopush"
#: The attribute of vLLM's ``NixlConnectorMetadata`` that carries, from the prefill's scheduler
#: to its workers, the digest of what each newly finished request's blocks hold (request -> digest).
PUSH_PROMPTS_ATTR = "kvcompose_push_prompts"

_encode = msgspec.msgpack.Encoder().encode
_nopush = msgspec.msgpack.Decoder(tuple[str])


def stamp_registration(
    registration: dict[str, Any], prompt: Sequence[int], loaded: int, context: Sequence[Any]
) -> None:
    """On the decode: add to its push ``registration`` the digest of the ``loaded`` prompt tokens
    it counts as the prefill's (vLLM's ``_get_remote_prefill_token_count``) and their context."""
    registration[PROMPT_KEY] = prompt_digest(list(prompt[:loaded]), context)


def computed_digest(tokens: Sequence[int], computed: int, context: Sequence[Any]) -> str:
    """On the prefill: the digest of the tokens its blocks hold for a finished request, its first
    ``computed`` tokens (``num_computed_tokens``, vLLM's ``remote_num_tokens`` in push mode),
    output tokens included if it computed any: the blocks it writes hold exactly those."""
    return prompt_digest(list(tokens[:computed]), context)


def _name(agent: str | bytes) -> str:
    """NIXL names an agent in bytes where it loads one and in str where it gives notifications."""
    return agent.decode() if isinstance(agent, bytes) else agent


class PushGuard:
    """Both halves for vLLM's push-mode NIXL worker (its class stays vLLM's; an instance may
    prefill and decode). Makes the wrappers that :func:`kvcompose_nixl.patches.guard_pushes`
    installs on the instance: ``start_load_kv`` (:meth:`taking_digests`: the step's digests,
    before vLLM hands the writer the finished blocks), ``get_transfer_results``
    (:meth:`forgetting`: digests of requests written or expired forgotten),
    ``_do_start_push_kv`` (:meth:`checked_write`: the check) and the agent's ``get_new_notifs``
    (:meth:`filtering`: refusals taken out before vLLM reads its own notifications)."""

    def __init__(self, worker: Any, keys: Keyring | None, keyed: bool) -> None:
        self._worker = worker
        self._keys = keys
        #: Whether a registration without a digest is refused (a key that peers must hold).
        self._keyed = keyed
        #: Prefill: request -> the digest of what its blocks hold, until written or expired.
        self.computed: dict[str, str] = {}
        #: Prefill: pushes refused, by reason (:data:`kvcompose_nixl.trust.REASONS`).
        self.refused: Counter[str] = Counter()
        #: Decode: loads failed because the prefill refused to write them.
        self.refusals_taken = 0
        #: vLLM's own ``_do_start_push_kv``, which :meth:`checked_write` calls on a match.
        self._write = worker._do_start_push_kv

    # ---- prefill

    def taking_digests(self, start_load_kv: Callable[[Any], None]) -> Callable[[Any], None]:
        """vLLM's worker's ``start_load_kv``, after the step's digests of what the prefill computed are kept."""

        def start_load_kv_with_digests(metadata: Any) -> None:
            digests = getattr(metadata, PUSH_PROMPTS_ATTR, None)
            if digests:  # before vLLM queues the blocks for the writer thread, which reads them
                self.computed.update(digests)
            start_load_kv(metadata)

        return start_load_kv_with_digests

    def forgetting(self, get_transfer_results: Callable[[], Any]) -> Callable[[], Any]:
        """vLLM's worker's ``get_transfer_results``, then the digests of requests written or expired forgotten."""

        def get_transfer_results_forgetting() -> Any:
            results = get_transfer_results()
            if self.computed:
                for req_id in results.finished_sending:  # written, or the lease ran out
                    self.computed.pop(req_id, None)
            return results

        return get_transfer_results_forgetting

    def checked_write(self, request_id: str, local_block_ids: Any, registration: dict[str, Any]) -> None:
        """vLLM's ``_do_start_push_kv`` (writer thread) when the decode's registered digest is the
        digest of what this prefill computed for ``request_id``; else :meth:`_refuse`."""
        registered = registration.get(PROMPT_KEY) if isinstance(registration, dict) else None
        try:
            check_push(registered, self.computed.get(request_id), self._keyed)
        except Refused as refused:
            self._refuse(request_id, local_block_ids, registration, refused)
            return
        self._write(request_id, local_block_ids, registration)

    def _refuse(self, request_id: str, blocks: Any, registration: dict[str, Any], refused: Refused) -> None:
        """Write nothing; tell the decode once vLLM's handshake to it is done (the one vLLM's
        write would make: re-driven through vLLM's ``_deferred_push_inbox``); keep the blocks for
        a registration that matches."""
        worker = self._worker
        try:
            engine = registration["decode_engine_id"]
            decode_request = registration["request_id"]
            fut: Future[Any] | None = worker._ensure_handshake(
                engine, registration["decode_host"], registration["decode_port"], registration["decode_tp_size"]
            )
        except (KeyError, TypeError) as exc:  # not a registration vLLM could write to either
            drop("push registration without the decode's address", f"for {request_id}: {exc!r}")
            fut, engine, decode_request = None, None, None
        if fut is not None:

            def told_later(
                f: Future[Any], entry: tuple[str, Any, dict[str, Any]] = (request_id, blocks, registration)
            ) -> None:
                if f.exception() is not None:  # as vLLM's own write after a failed handshake: logged only
                    log.warning(
                        "%s: push refused (%s); the decode cannot be told: no handshake", request_id, refused.reason
                    )
                    return
                worker._deferred_push_inbox.put(entry)
                worker._push_writer_wake.set()

            fut.add_done_callback(told_later)
            return
        first = self.refused[refused.reason] == 0
        self.refused[refused.reason] += 1
        (log.warning if first else log.debug)(
            "%s: push to decode request %s refused (%s), nothing written; the decode computes the prompt: %s",
            request_id,
            decode_request,
            refused.reason,
            refused.detail,
        )
        if engine is not None and isinstance(decode_request, str):
            self._tell(engine, decode_request)
        if request_id in self.computed:  # not yet written or expired: another registration may match
            worker._push_finished_blocks[request_id] = blocks
            other = worker._pop_matching_registration(request_id)
            if other is not None:
                self.checked_write(request_id, worker._push_finished_blocks.pop(request_id), other)

    def _tell(self, engine: str, decode_request: str) -> None:
        worker = self._worker
        body = _encode((decode_request,))
        msg = NOPUSH + (self._keys.tag(body) + body if self._keys is not None else body)
        with worker._handshake_lock:  # _remote_agents changes on the handshake threads
            agents = dict(worker._remote_agents.get(engine) or {})
        for agent in agents.values():
            try:
                worker.nixl_wrapper.send_notif(agent, notif_msg=msg)
            except Exception as exc:  # as vLLM's own notifications: a failed send is logged only
                log.debug("push refusal for %s to %s not sent: %s", decode_request, _name(agent), exc)

    # ---- decode

    def filtering(self, get_new_notifs: Callable[..., Mapping[Any, list[bytes]]]) -> Callable[..., Any]:
        """The agent's ``get_new_notifs`` with the prefill's refusals taken (:meth:`refusal`) and
        notifications vLLM cannot parse dropped, before vLLM reads its own."""

        def vllms_notifs(*args: Any, **kwargs: Any) -> Mapping[Any, list[bytes]]:
            notifs = get_new_notifs(*args, **kwargs)
            if not notifs:
                return notifs
            kept: dict[Any, list[bytes]] = {}
            for agent, msgs in notifs.items():
                for msg in msgs:
                    if msg.startswith(NOPUSH):
                        self.refusal(_name(agent), msg)
                    elif msg.startswith(PREFIX):
                        drop("NIXL notification of an unknown kvcompose kind", f"from {_name(agent)}: {msg[:40]!r}")
                    elif msg.startswith(PUSH_REG_NOTIF_PREFIX) or vllms_own(msg):
                        kept.setdefault(agent, []).append(msg)
                    else:  # vLLM's main thread would raise on it in its step
                        drop("NIXL notification vLLM cannot parse", f"from {_name(agent)}: {msg[:40]!r}")
            return kept

        return vllms_notifs

    def refusal(self, agent: str, msg: bytes) -> None:
        """A prefill's :data:`NOPUSH`: fail the named load, if this decode waits for it from an
        agent of that prefill engine (writer thread; vLLM's main thread reports it failed)."""
        body: bytes | None = msg[len(NOPUSH) :]
        if self._keys is not None:
            body = self._keys.untag(body)
        try:
            if body is None:
                raise ValueError
            (request_id,) = _nopush.decode(body)
            if len(request_id) > MAX_ID_CHARS:
                raise ValueError
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            drop("NIXL push refusal that is not authenticated or does not parse", f"from {agent}")
            return
        meta = self._worker._recving_metadata.get(request_id)
        if meta is None or meta.remote is None:
            log.debug("push refusal for %s, which this decode no longer waits for", request_id)
            return
        agents = self._worker._remote_agents.get(meta.remote.engine_id) or {}
        if agent not in {_name(a) for a in agents.values()}:
            drop("NIXL push refusal from an agent other than the request's prefill", f"from {agent}")
            return
        (log.warning if self.refusals_taken == 0 else log.debug)(
            "%s: the prefill refused to write this request's KV (its prompt is not the one the prefill "
            "computed); the load fails and the prompt is computed here (or the request fails)",
            request_id,
        )
        self.refusals_taken += 1
        self._worker._failed_recv_reqs.put(request_id)


__all__ = ["NOPUSH", "PUSH_PROMPTS_ATTR", "PushGuard", "computed_digest", "stamp_registration"]
