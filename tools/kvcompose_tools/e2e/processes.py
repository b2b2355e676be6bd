"""Process nodes: the engines, API servers and routers the kit starts, each a process group.

:func:`start_group` starts a process as the leader of a group of its own, :func:`stop_group`
stops the whole group (vLLM's engine core is a child that can outlive its parent), and
:func:`stopped_on_interrupt` stops every group still running on Ctrl-C. :class:`ProcessNode` is
what an engine, a server and a router share: a group started here, its output in a log file,
``kill`` and ``close``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from kvcompose_tools.e2e.hosts import Host

#: How long the kit waits for one call to a node (a generation, a metrics scrape) to answer.
CALL_TIMEOUT_S = 120.0


class NodeError(RuntimeError):
    """A node failed to start, died, or did not answer in time; carries its log tail."""


def log_tail(path: Path, lines: int = 40, skip: re.Pattern[str] | None = None) -> str:
    """The last ``lines`` lines of an engine's log ('' while there is none), without the lines
    ``skip`` matches."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kept = text if skip is None else [line for line in text if not skip.search(line)]
    return "\n".join(kept[-lines:])


#: The process groups :func:`start_group` started and :func:`stop_group` has not stopped yet, by
#: leader pid, with a name for messages: what an interrupted command stops
#: (:func:`stopped_on_interrupt`).
_RUNNING: dict[int, tuple[str, subprocess.Popen[Any]]] = {}


def start_group(name: str, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` as the leader of a process group of its own (vLLM's engine core and API
    server children join it), so that :func:`stop_group` reaches all of them and a terminal's
    Ctrl-C reaches only this process, which then stops them (:func:`stopped_on_interrupt`).

    The group stays in this process's session: Linux schedules each session as a group of its
    own (autogroup), and an idle vLLM worker's ``sched_yield`` busy-wait then yields only inside
    its own engine's group, keeping the core vLLM binds every engine's worker to from the other
    engine's worker (docs/e2e.md, stalls under load)."""
    proc: subprocess.Popen[Any] = subprocess.Popen(argv, process_group=0, **popen)
    _RUNNING[proc.pid] = (name, proc)
    return proc


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (a process this package started with its own
    group); a group already gone is not an error."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


#: How long a SIGKILLed process may take to leave the kernel: under a second on an idle host; once
#: more than 30 s here, an engine of a 2P2D fleet on two cores (its threads' states are then said).
KILLED_EXIT_S = 120.0


def kernel_states(pid: int) -> str:
    """How many of ``pid``'s threads are in which kernel state and wait channel (``/proc``), e.g.
    ``{('D', 'io_schedule'): 3}``; what a process that outlives SIGKILL is stuck in."""
    states: dict[tuple[str, str], int] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            wchan = (task / "wchan").read_text().strip() or "-"
        except OSError:  # the thread has gone meanwhile
            continue
        states[(state, wchan)] = states.get((state, wchan), 0) + 1
    return str(states or "no threads left")


def reap_killed(proc: subprocess.Popen[Any]) -> None:
    """Wait for ``proc``, SIGKILLed, to exit; past 30 s its threads' kernel states are said on
    stderr, and past :data:`KILLED_EXIT_S` a :class:`NodeError` carries them."""
    try:
        proc.wait(30)
        return
    except subprocess.TimeoutExpired:
        states = kernel_states(proc.pid)
    print(f"kvcompose: pid {proc.pid} still there 30 s after SIGKILL; its threads: {states}", file=sys.stderr)
    try:
        proc.wait(KILLED_EXIT_S - 30)
    except subprocess.TimeoutExpired:
        raise NodeError(
            f"pid {proc.pid} still there {KILLED_EXIT_S:.0f} s after SIGKILL; its threads at 30 s: {states}, "
            f"now: {kernel_states(proc.pid)}"
        ) from None


def stop_group(proc: subprocess.Popen[Any], grace_s: float, ask: Callable[[], None] | None = None) -> None:
    """Stop ``proc`` and its process group: ``ask`` it to exit (default: SIGTERM to the group),
    wait ``grace_s``, then SIGKILL the group either way (vLLM's engine core is a child that can
    outlive its parent)."""
    if proc.poll() is None:
        try:
            if ask is None:
                signal_group(proc, signal.SIGTERM)
            else:
                ask()
            proc.wait(grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
    signal_group(proc, signal.SIGKILL)
    reap_killed(proc)
    _RUNNING.pop(proc.pid, None)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) arrived; every process group started here is already stopped."""

    def __init__(self, signum: int, stopped: list[str]) -> None:
        super().__init__(signum, stopped)
        self.signum = signum
        self.stopped = stopped

    def message(self, command: str) -> str:
        """What the command prints about it."""
        why = signal.Signals(self.signum).name
        if not self.stopped:
            return f"kvcompose {command}: interrupted ({why}); no engine or router process was running"
        return (
            f"kvcompose {command}: interrupted ({why}); stopped the {len(self.stopped)} engine/router "
            f"process groups it started: {', '.join(self.stopped)}"
        )


@contextlib.contextmanager
def stopped_on_interrupt(grace_s: float = 5.0) -> Iterator[None]:
    """Within: SIGINT or SIGTERM first stops every process group :func:`start_group` started and
    that is still running (SIGTERM, then SIGKILL after ``grace_s``), then raises
    :class:`Interrupted` naming them, so the code unwinds past processes that are already gone.

    Their own process groups keep a terminal's Ctrl-C from reaching the engines, so this process
    is the one that must stop them. Further signals are ignored while it does (a second Ctrl-C
    would otherwise cut the cleanup short and leave engines behind).
    """

    def stop_all(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopped = []
        for name, proc in list(_RUNNING.values()):
            stop_group(proc, grace_s)
            stopped.append(f"{name} (pid {proc.pid})")
        raise Interrupted(signum, stopped)

    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ProcessNode:
    """One process group started here (:func:`start_group`), its output in ``<log_dir>/<name>.log``:
    an engine, an API server or a router. ``host``: the process runs in that host
    (:mod:`kvcompose_tools.e2e.hosts`). Subclasses say what runs and when it is ready."""

    #: What :meth:`close` waits for the process to exit before it kills the group.
    close_grace_s: ClassVar[float] = 10.0

    def __init__(
        self,
        name: str,
        label: str,
        argv: list[str],
        log_dir: Path,
        host: Host | None = None,
        env: Mapping[str, str] | None = None,
        **popen: Any,
    ) -> None:
        self._name = name
        self.host = host
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.started_at = time.monotonic()
        self.proc = start_group(
            label,
            host.command(argv) if host else argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            **popen,
        )

    @property
    def name(self) -> str:
        return self._name

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the node's log."""
        return log_tail(self.log_path, lines)

    def kill(self) -> None:
        """SIGKILL the node's whole process group now (the dead-peer tests use this)."""
        signal_group(self.proc, signal.SIGKILL)
        reap_killed(self.proc)

    def close(self, grace_s: float | None = None) -> None:
        """Ask the node to exit (:meth:`ask_exit`), then kill its process group if it has not
        within ``grace_s`` (default :attr:`close_grace_s`)."""
        stop_group(self.proc, self.close_grace_s if grace_s is None else grace_s, ask=self.ask_exit)
        self._log.close()

    def ask_exit(self) -> None:
        """How :meth:`close` asks the node to exit: SIGTERM to its group."""
        signal_group(self.proc, signal.SIGTERM)
