"""Copy threads: a store and a load thread per backend, the CPU tier's counterpart of vLLM's
CUDA side streams, and the events that report their transfers."""

from __future__ import annotations

import queue
import threading
from typing import Any, ClassVar

#: The longest the engine's thread waits for one copy thread's transfer (vLLM's preemption
#: flush): a copy moves gigabytes per second, so a transfer not done by then never will be.
SYNC_TIMEOUT_S = 60.0


class ThreadEvent:
    """A transfer event completed by a copy thread; a copy error is re-raised to the caller.

    Re-raising matters: reporting a failed store as complete would let the scheduler serve a
    block that was never written, and never reporting it would hold its GPU block forever.
    """

    __slots__ = ("_done", "_error", "_what")

    def __init__(self, what: str) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._what = what

    def set_done(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"KV offload {self._what} failed: {self._error}") from self._error

    def query(self) -> bool:
        if not self._done.is_set():
            return False
        self._raise_if_failed()
        return True

    def synchronize(self) -> None:
        # vLLM waits on the engine's thread (its preemption flush): a bound, and a clear error past it.
        if not self._done.wait(SYNC_TIMEOUT_S):
            raise TimeoutError(
                f"KV offload {self._what} still running after {SYNC_TIMEOUT_S:g} s; the copy thread is stuck "
                "or starved of CPU"
            )
        self._raise_if_failed()


class CopyThreads:
    """A store thread and a load thread, each fed by a FIFO queue: the side streams of the CPU tier.

    Implements vLLM's ``launch_copy`` contract for a backend that defines ``store(src, dst)`` and
    ``load(src, dst)`` (synchronous copies of paired block lists). ``launch_copy`` puts the
    transfer's event on the worker's list *before* the copy runs, so the worker's completion
    polling (``get_finished``) reports it only once its bytes are in place, and its preemption
    flush (``handle_preemptions``) waits for every copy in flight. Loads never queue behind
    stores, as with vLLM's two CUDA streams. The scheduler keeps a block referenced until the
    transfer that reads or writes it is reported, so no block is reused under a copy.
    """

    _what: ClassVar[str] = "copy"
    #: The copy loops the transfers used since :meth:`take_copy_loops` last ran (set in ``init``).
    _copy_loops: set[str]
    _store_queue: queue.SimpleQueue[Any]
    _load_queue: queue.SimpleQueue[Any]
    _store_thread: threading.Thread | None
    _load_thread: threading.Thread | None

    def store(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        raise NotImplementedError

    def load(self, src_blocks: list[int], dst_blocks: list[int]) -> None:
        raise NotImplementedError

    def take_copy_loops(self) -> set[str]:
        """The copy loops (:func:`~kvcompose_cpu_offload.block_copy.copy_loop`'s names) the
        transfers used since the last call."""
        loops, self._copy_loops = self._copy_loops, set()
        return loops

    def _start_threads(self) -> None:
        name = self._what.replace(" ", "-")
        self._store_thread = threading.Thread(
            target=self._io_loop, args=(self._store_queue, True), name=f"kv-offload-{name}-store", daemon=True
        )
        self._load_thread = threading.Thread(
            target=self._io_loop, args=(self._load_queue, False), name=f"kv-offload-{name}-load", daemon=True
        )
        self._store_thread.start()
        self._load_thread.start()

    def launch_copy(
        self,
        src_blocks: list[int],
        dst_blocks: list[int],
        is_store: bool,
        event_idx: int,
        events_list: list[tuple[int, Any]],
        wait_event: Any = None,
        *,
        step_has_forward: bool = True,
    ) -> None:
        """Queue the transfer for the store or load thread (or copy it now, see
        :meth:`copies_in_place`) and register its event now.

        ``wait_event`` (vLLM's compute-done CUDA event) has no counterpart: on the CPU platform
        the forward pass has finished writing the KV when the worker issues its stores.
        ``step_has_forward``: whether the engine step issuing the transfer runs a forward pass
        (a step without one produces no token).
        """
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destinations")
        event = ThreadEvent(f"{self._what} {'store' if is_store else 'load'}")
        events_list.append((event_idx, event))
        if self.copies_in_place(len(src_blocks), is_store, step_has_forward):
            self._run(src_blocks, dst_blocks, is_store, event)
        else:
            (self._store_queue if is_store else self._load_queue).put((list(src_blocks), list(dst_blocks), event))

    def copies_in_place(self, num_blocks: int, is_store: bool, step_has_forward: bool) -> bool:
        """Whether a transfer of ``num_blocks`` blocks is copied now, in the caller's (engine)
        thread, instead of on a copy thread (its event then complete when ``launch_copy``
        returns). Never, here."""
        return False

    def _run(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool, event: ThreadEvent) -> None:
        try:
            (self.store if is_store else self.load)(src_blocks, dst_blocks)
        except BaseException as exc:  # reported through the event, on the engine's thread
            event.set_done(exc)
        else:
            event.set_done()

    def _io_loop(self, q: queue.SimpleQueue[Any], is_store: bool) -> None:
        while True:
            item = q.get()
            if item is None:  # the shutdown sentinel, queued behind every transfer: a drain
                return
            self._run(item[0], item[1], is_store, item[2])
