"""Free TCP ports for the nodes the kit starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from kvcompose_tools.e2e.processes import NodeError


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that are free now, from below the kernel's
    ephemeral range.

    A port the kernel hands out for ``bind(0)`` is one it may hand out again the next moment:
    an engine starting beside another opens dozens of sockets on ephemeral ports (UCX's tcp
    listeners, ZMQ), and one took a side-channel port picked that way before its engine bound
    it. Ports below the range are never given out implicitly.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    for port in random.sample(range(max(1024, low - 12_000), low), k=min(400, low - 1024)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise NodeError(f"no {n} free TCP ports below {low} on 127.0.0.1")
