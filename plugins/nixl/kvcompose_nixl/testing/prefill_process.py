"""A prefill instance in a process of its own: a worker harness behind a pipe, real NIXL underneath.

:class:`PrefillProcess` spawns a process that builds a :class:`~kvcompose.testing.worker.WorkerHarness`
for a composition (vLLM's scheduler and worker-role connector, engine-shaped KV) and publishes
its NIXL handshake as the engine core does: the scheduler's side-channel listener serves the
worker's agent metadata, so a decode-side harness in the test process reaches it through
vLLM's own ZMQ handshake and reads its KV with a real NIXL agent, as between two engines.
No engine, no model: the prefill forward is the harness's stand-in writer
(``engine_step(write_blocks=True)``), so every block the decode side receives can be checked
byte for byte against :meth:`WorkerHarness.expected_block <kvcompose.testing.worker.WorkerHarness.expected_block>`.

Example (the composition's ``nixl`` child is a producer with a side-channel port free here)::

    with PrefillProcess(PREFILL_YAML, block_size=32, num_blocks=32, host_buffer=True) as p:
        done = p.prefill(prompt, "A")      # params for the decode side, and what the prefill saw
        ...                                # the decode side reads A's blocks
        assert p.step().finished_sending == {"A"}
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcompose.testing.copy_op import Copy
    from kvcompose.testing.worker import WorkerHarness


@dataclass(frozen=True)
class Prefilled:
    """One prompt computed by the prefill instance."""

    request_id: str
    #: The ``kv_transfer_params`` its output carries: what a P/D proxy hands to the decode side.
    params: dict[str, Any]
    #: The request's blocks in the prefill instance's KV cache.
    block_ids: tuple[int, ...]
    #: Full blocks whose bytes are the stand-in forward's for their prefix, in the KV cache...
    device_ok: tuple[bool, ...]
    #: ...and in the NIXL worker's host buffer (``()`` without ``host_buffer``).
    host_buffer_ok: tuple[bool, ...]
    #: The host-buffer copies the step made (``()`` without ``host_buffer``).
    copies: tuple[Copy, ...]


@dataclass(frozen=True)
class Stepped:
    """One engine step of the prefill instance."""

    finished_sending: frozenset[str]
    #: Requests the scheduler still holds after the step.
    requests: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True)
class Started:
    """What the prefill instance's worker looks like once it is up."""

    #: With ``host_buffer``: the connectors the copy op was handed to.
    host_buffer_ops_to: tuple[str, ...] | None
    #: vLLM's NIXL worker's decisions: ``use_host_buffer``, its NIXL memory type, its engine id.
    use_host_buffer: bool
    nixl_memory_type: str
    engine_id: str


class PrefillProcess:
    """A prefill-side worker harness in a spawned process (see the module docstring).

    ``source`` is a composition (YAML text) with a ``nixl`` producer child; ``harness_kw`` go to
    the harness (``block_size=32`` for NIXL's worker), and ``host_buffer=True`` puts it on the
    host-buffer path (:func:`~kvcompose_nixl.testing.host_buffer.host_buffer_setting`). Raises
    ``RuntimeError`` with the child's traceback when the process fails a command.
    """

    def __init__(self, source: str, *, timeout_s: float = 180.0, **harness_kw: Any) -> None:
        ctx = mp.get_context("spawn")  # never fork a process with NIXL/UCX or torch threads in it
        self._conn, there = ctx.Pipe()
        self._timeout_s = timeout_s
        self._proc = ctx.Process(target=_serve, args=(there, source, harness_kw), daemon=True)
        self._proc.start()
        there.close()
        #: The worker as it started.
        self.started: Started = self._answer("start")

    def prefill(self, prompt: list[int], request_id: str) -> Prefilled:
        """One engine step computing ``prompt`` as a P/D prefill request (``do_remote_decode``)."""
        return self._call("prefill", prompt, request_id)  # type: ignore[no-any-return]

    def step(self) -> Stepped:
        """One engine step (the decode side's read notification frees the prompt's blocks)."""
        return self._call("step")  # type: ignore[no-any-return]

    def close(self) -> None:
        """Shut the harness down and end the process."""
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", ()))
                self._proc.join(30)
            except (BrokenPipeError, OSError):
                pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()

    def __enter__(self) -> PrefillProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, command: str, *args: Any) -> Any:
        self._conn.send((command, args))
        return self._answer(command)

    def _answer(self, command: str) -> Any:
        if not self._conn.poll(self._timeout_s):
            raise RuntimeError(f"prefill process: no answer to {command!r} within {self._timeout_s:g} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"prefill process: exited (code {self._proc.exitcode}) during {command!r}") from None
        if status == "error":
            raise RuntimeError(f"prefill process: {command!r} failed:\n{value}")
        return value


# ---------------------------------------------------------------------- in the spawned process


def _copies_since(h: WorkerHarness, seen: int) -> tuple[Copy, ...]:
    from kvcompose.testing.copy_op import CopyLog

    return tuple(h.copy_op.copies[seen:]) if isinstance(h.copy_op, CopyLog) else ()


def _copies_so_far(h: WorkerHarness) -> int:
    return len(_copies_since(h, 0))


def _started(h: WorkerHarness) -> Started:
    from kvcompose_nixl.testing.fake_nixl import nixl_worker

    w = nixl_worker(h)
    ops_to = None if h.host_buffer_ops_to is None else tuple(h.host_buffer_ops_to)
    return Started(ops_to, w.use_host_buffer, w.nixl_memory_type, w.engine_id)


def _prefill(h: WorkerHarness, prompt: list[int], request_id: str) -> Prefilled:
    from kvcompose.testing.harness import prefill_request
    from kvcompose_nixl.testing.fake_nixl import nixl_worker

    block = h.vllm_config.cache_config.block_size
    seen = _copies_so_far(h)
    req = prefill_request(len(prompt), block_size=block, prompt=prompt, request_id=request_id)
    h.scheduler.add_request(req)
    _, eco = h.engine_step(write_blocks=True)
    (out,) = [o for outs in eco.values() for o in outs.outputs if o.request_id == request_id]
    (ids,) = h.scheduler.kv_cache_manager.get_block_ids(request_id)
    full = [(b, prompt[: (k + 1) * block]) for k, b in enumerate(ids) if (k + 1) * block <= len(prompt)]
    hosted = bool(nixl_worker(h).host_xfer_buffers)
    return Prefilled(
        request_id,
        dict(out.kv_transfer_params or {}),
        tuple(ids),
        tuple(h.holds_prefix(b, prefix) for b, prefix in full),
        tuple(h.holds_prefix(b, prefix, host_buffer=True) for b, prefix in full) if hosted else (),
        _copies_since(h, seen),
    )


def _step(h: WorkerHarness) -> Stepped:
    seen = _copies_so_far(h)
    h.engine_step()
    out = h.last_output
    assert out is not None
    return Stepped(frozenset(out.finished_sending or ()), len(h.scheduler.requests), _copies_since(h, seen))


_COMMANDS = {"prefill": _prefill, "step": _step}


def _serve(conn: Connection, source: str, harness_kw: dict[str, Any]) -> None:
    """The spawned process: build, publish the handshake, answer commands until ``stop``."""
    h = None
    try:
        from kvcompose.testing.worker import WorkerHarness
        from kvcompose_nixl.testing.host_buffer import host_buffer_setting

        if harness_kw.pop("host_buffer", False):  # built here: the platform and the copy log do not pickle
            harness_kw.update(host_buffer_setting())
        h = WorkerHarness.from_yaml(source, **harness_kw)
        h.publish_handshake()
        conn.send(("ok", _started(h)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            command, args = conn.recv()
            if command == "stop":
                break
            try:
                conn.send(("ok", _COMMANDS[command](h, *args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except EOFError:  # the test process went away
        pass
    finally:
        h.shutdown()
