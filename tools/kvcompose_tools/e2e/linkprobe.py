"""What crosses the link between two hosts: a TCP stream's rate, and where a NIXL READ's bytes go.

Both run as processes in :class:`~kvcompose_tools.e2e.hosts.Host` s (``python -m
kvcompose_tools.e2e.linkprobe ROLE ...``), no engine involved:

- :func:`throughput`: a TCP stream from one host to another for a few seconds, measured by its
  receiver (payload bits per second from its first byte to its last): what a link's ``tc`` rate
  lets through.
- :func:`nixl_read`: one NIXL agent in a host READs a registered buffer from an agent in another
  (UCX backend, as vLLM's NixlConnector does), the data checked; the result holds the bytes the
  reader's ``eth0`` received meanwhile and the lanes UCX chose (:func:`ucx_lanes`, from its
  ``UCX_PROTO_INFO`` tables). With the hosts' environment (:data:`~kvcompose_tools.e2e.hosts.NETWORK_ENV`)
  every byte crosses the link over ``tcp/eth0``; without it UCX copies the buffer through the
  kernel (``cma``) and the link carries almost nothing.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcompose_tools.e2e.hosts import Host, LinkBytes

#: Where the probes listen in their hosts (each host is a namespace of its own: nothing else does).
PORT = 9400
PROBE_TIMEOUT_S = 60.0
#: The NIXL probe's block size (a KV block of the demo model is 32 KiB).
BLOCK = 32 * 1024


# ---------------------------------------------------------------------------- stream rate


def throughput(src: Host, dst: Host, seconds: float) -> float:
    """One TCP stream from ``src`` to ``dst`` for ``seconds``; its payload rate in bits per second
    as the receiver measured it (first byte to last)."""
    sink = _probe(dst, "sink", dst.address, str(PORT))
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "listening":  # it prints this once it listens
            raise RuntimeError(f"stream sink in {dst.name} did not start: {sink.communicate(timeout=10)[1].strip()}")
        source = _probe(src, "source", dst.address, str(PORT), str(seconds))
        _, err = source.communicate(timeout=seconds + PROBE_TIMEOUT_S)
        if source.returncode != 0:
            raise RuntimeError(f"stream source in {src.name} failed: {err.strip()}")
        out, err = sink.communicate(timeout=PROBE_TIMEOUT_S)
        if sink.returncode != 0:
            raise RuntimeError(f"stream sink in {dst.name} failed: {err.strip()}")
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    got = json.loads(out)
    return got["bytes"] * 8 / got["seconds"]


def _probe(host: Host, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    return host.popen(
        [sys.executable, "-m", __name__, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _sink(address: str, port: int) -> None:
    with socket.create_server((address, port)) as server:
        print("listening", flush=True)
        server.settimeout(PROBE_TIMEOUT_S)
        conn, _ = server.accept()
    with conn:
        total, first = 0, None
        while chunk := conn.recv(1 << 20):
            if first is None:
                first = time.perf_counter()
            total += len(chunk)
        end = time.perf_counter()
    print(json.dumps({"bytes": total, "seconds": end - (first or end) or 1e-9}))


def _source(address: str, port: int, seconds: float) -> None:
    buf = b"\0" * (1 << 16)
    with socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S) as conn:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            conn.sendall(buf)


# ---------------------------------------------------------------------------- UCX's lanes

#: A UCX_PROTO_INFO table's first line: ``| <agent> <peer> cfg#<n> |``, the peer being ``self``,
#: ``intra-node`` (UCX found it on this machine) or ``inter-node``.
_TABLE = re.compile(r"\|\s+(\S+) (self|intra-node|inter-node) cfg#\d+\s+\|$")
#: A table row: ``| <size range> | <description> | <transports> |``.
_ROW = re.compile(r"\|\s*[\d.]+\S*\s*\|\s*[^|]*\|\s*([^|]+?)\s*\|$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*/[A-Za-z0-9_.:-]+)")


@dataclass(frozen=True)
class Lane:
    """One protocol UCX chose: ``agent`` to a ``peer`` (``self``, ``intra-node``,
    ``inter-node``), for ``operation`` (``remote memory read by ucp_get*...``), over
    ``transport`` (``tcp/eth0``, ``cma/memory``, ...)."""

    agent: str
    peer: str
    operation: str
    transport: str


def ucx_lanes(text: str) -> list[Lane]:
    """Every (peer, operation, transport) in the ``UCX_PROTO_INFO=y`` tables of a process's
    output, once each, in order."""
    lanes: list[Lane] = []
    header: tuple[str, str] | None = None
    operation = ""
    for raw in text.splitlines():
        line = raw.split("]", 2)[-1].strip() if raw.startswith("[") else raw.strip()
        if m := _TABLE.search(line):
            header, operation = (m.group(1), m.group(2)), ""
        elif header is not None and not operation and line.startswith("|") and "|" not in line[1:-1]:
            operation = line.strip("| ")
        elif header is not None and (m := _ROW.match(line)):
            for transport in _TRANSPORT.findall(m.group(1)):
                lane = Lane(header[0], header[1], operation, transport)
                if lane not in lanes:
                    lanes.append(lane)
    return lanes


def off_network(lanes: Sequence[Lane], device: str) -> list[Lane]:
    """The lanes to another process (not ``self``) that do not go over ``tcp/<device>``."""
    return [lane for lane in lanes if lane.peer != "self" and lane.transport != f"tcp/{device}"]


# ---------------------------------------------------------------------------- NIXL READ


@dataclass
class NixlRead:
    """One NIXL READ of ``nbytes`` between two hosts."""

    nbytes: int
    #: the reader got the target's bytes, every one checked
    ok: bool
    #: what the reader's ``eth0`` received and sent during the probe
    link: LinkBytes
    #: UCX's lanes in the reader's process
    lanes: list[Lane]
    seconds: float
    #: the reader's output (UCX's tables, NIXL's log)
    log: str


def nixl_read(
    target: Host, reader: Host, nbytes: int, env: Mapping[str, str] | None = None, timeout: float = PROBE_TIMEOUT_S
) -> NixlRead:
    """``reader`` READs ``nbytes`` (whole :data:`BLOCK` s) that ``target`` registered, with NIXL's
    UCX backend. ``env``: both processes' environment instead of their hosts' own
    (:meth:`Host.environ`), e.g. without UCX's transport settings, to see what they prevent.
    The agents exchange their metadata as files (the control plane is not what is measured)."""
    blocks = max(1, nbytes // BLOCK)
    with tempfile.TemporaryDirectory(prefix="kvcompose-nixl-probe-") as tmp:
        envs = [{**(env if env is not None else host.environ()), "UCX_PROTO_INFO": "y"} for host in (target, reader)]
        before = reader.link_bytes()
        t = _probe(target, "nixl-target", tmp, str(blocks), env=envs[0])
        r = _probe(reader, "nixl-read", tmp, str(blocks), env=envs[1])
        try:
            r_out, r_err = r.communicate(timeout=timeout)
            t.communicate(timeout=timeout)
        finally:
            for p in (r, t):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        moved = reader.link_bytes() - before
    log = r_out + r_err
    result = json.loads(r_out.strip().splitlines()[-1]) if r.returncode == 0 and r_out.strip() else {}
    return NixlRead(blocks * BLOCK, bool(result.get("ok")), moved, ucx_lanes(log), result.get("seconds", 0.0), log)


def _pattern(blocks: int) -> Any:
    import torch

    return torch.arange(blocks * BLOCK // 8, dtype=torch.int64) * 7 + 1000


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _wait_for(path: Path) -> bytes:
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)
    return path.read_bytes()


def _publish(path: Path, data: bytes) -> None:
    path.with_suffix(".tmp").write_bytes(data)
    os.rename(path.with_suffix(".tmp"), path)  # appears whole


def _nixl_target(folder: Path, blocks: int) -> None:
    agent = _agent("target")
    buf = _pattern(blocks)
    agent.register_memory(buf)
    descs = agent.get_xfer_descs([(buf.data_ptr() + i * BLOCK, BLOCK, 0) for i in range(blocks)], "DRAM")
    _publish(folder / "target.descs", agent.get_serialized_descs(descs))
    _publish(folder / "target.meta", agent.get_agent_metadata())
    peer = agent.add_remote_agent(_wait_for(folder / "reader.meta")).decode()
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while b"done" not in agent.get_new_notifs().get(peer, []):
        if time.monotonic() > deadline:
            raise TimeoutError("no notification from the reader")
        time.sleep(0.001)


def _nixl_reader(folder: Path, blocks: int) -> None:
    import torch

    agent = _agent("reader")
    dst = torch.zeros(blocks * BLOCK // 8, dtype=torch.int64)
    agent.register_memory(dst)
    peer = agent.add_remote_agent(_wait_for(folder / "target.meta")).decode()
    remote = agent.deserialize_descs(_wait_for(folder / "target.descs"))
    _publish(folder / "reader.meta", agent.get_agent_metadata())
    local = agent.get_xfer_descs([(dst.data_ptr() + i * BLOCK, BLOCK, 0) for i in range(blocks)], "DRAM")
    t0 = time.perf_counter()
    handle = agent.initialize_xfer("READ", local, remote, peer, b"done")
    state = agent.transfer(handle)
    while state == "PROC":
        if time.perf_counter() - t0 > PROBE_TIMEOUT_S:
            raise TimeoutError("the READ did not finish")
        state = agent.check_xfer_state(handle)
    seconds = time.perf_counter() - t0
    print(json.dumps({"ok": state == "DONE" and bool(torch.equal(dst, _pattern(blocks))), "seconds": seconds}))


def main(argv: list[str]) -> int:
    role, *args = argv
    if role == "sink":
        _sink(args[0], int(args[1]))
    elif role == "source":
        _source(args[0], int(args[1]), float(args[2]))
    elif role == "nixl-target":
        _nixl_target(Path(args[0]), int(args[1]))
    elif role == "nixl-read":
        _nixl_reader(Path(args[0]), int(args[1]))
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
