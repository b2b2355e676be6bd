"""vllm-router's own service discovery in the kit: the flag that turns it on and the log line that
says a server joined. The registrations are :class:`kvcompose.discovery.Registrar`'s, what
``kvcompose register`` runs beside a server in production."""

from __future__ import annotations

import time
from pathlib import Path

from kvcompose_tools.e2e.processes import NodeError

#: How long :func:`wait_added` waits for the router's log to show a registration.
ADDED_TIMEOUT_S = 30.0
#: How the router's log names each kind (``Add Decode [HTTP:host:port, ...``).
LOGGED = {"prefill": "Prefill", "decode": "Decode"}


def router_flags(address: str) -> list[str]:
    """The router flag that turns its discovery on, on ``address`` (``host:port``)."""
    return ["--vllm-discovery-address", address]


def wait_added(log: Path, kind: str, url: str, timeout: float = ADDED_TIMEOUT_S) -> None:
    """Until the router's ``log`` says it added the ``kind`` server at ``url``; a
    :class:`~kvcompose_tools.e2e.processes.NodeError` naming the log after ``timeout`` seconds."""
    line = f"Add {LOGGED[kind]} [HTTP:{url.removeprefix('http://')},"
    deadline = time.monotonic() + timeout
    while line not in log.read_text(errors="replace"):
        if time.monotonic() >= deadline:
            raise NodeError(f"the router did not add {kind} {url} within {timeout:.0f} s (see {log})")
        time.sleep(0.1)
