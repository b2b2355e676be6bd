"""Hosts on one machine: network namespaces joined by a switch, each link at a rate the caller sets.

A :class:`Host` is a network namespace of its own (``kvc-<pid>-<n>-<name>``) with loopback up and
one end of a veth pair, ``eth0``, holding an address on a private /24 the kit picks (one that no
route of this machine covers). The other end of every host's veth is a port of a bridge that
lives in a namespace of its own (``kvc-<pid>-<n>``, the switch); the root namespace joins that
bridge through one more veth pair and holds the subnet's first address, so a client or a router
started without a host reaches every host's servers. A link rate (``link="10gbit"``) is a ``tc``
token bucket on both ends of the host's veth: the host's own ``eth0`` (what it sends) and its
switch port (what it receives). The root namespace's link is not shaped.

Processes in a host (:meth:`Host.command`, :meth:`Host.popen`) run through ``ip netns exec``,
which execs the command in place: the process keeps the pid and process group its parent gave
it. Their environment (:meth:`Host.environ`) confines UCX to its ``tcp`` transport over the
host's ``eth0`` (:data:`NETWORK_ENV`): namespaces separate the network only, so without that
UCX reaches a peer in another host through shared memory (``cma``), and the link carries
nothing. ``kvcompose_tools.e2e.linkprobe`` checks both, by the bytes that cross the link.

:class:`Hosts` creates the switch and the hosts, and removes them (namespaces, veths, qdiscs,
and any process still inside) on :meth:`Hosts.close`: at the end of its ``with`` block, on an
exception, Ctrl-C or SIGTERM, and at interpreter exit. Namespaces left by a kit that was killed
outright (SIGKILL) are removed by the next kit that starts (:func:`sweep_stale`).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvcompose.serving import SIDE_CHANNEL_HOST_ENV

#: Every namespace the kit creates starts with this, then the creating process's pid.
PREFIX = "kvc-"
#: The device a host reaches the others through (namespace-local names: every host has one).
DEVICE = "eth0"
#: The /16s the kit takes a /24 from, in this order, skipping any a route of this machine covers.
SUBNET_POOLS = ("10.213.0.0/16", "172.29.0.0/16", "192.168.213.0/24")
#: Serialises subnet picks between kits started at the same moment.
LOCK_PATH = "/tmp/kvcompose-hosts.lock"
#: How long :meth:`Hosts.close` waits for the processes it killed in a host to be gone.
KILL_WAIT_S = 10.0

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")
#: tc's rate units (``man tc``): bits per second, or bytes per second (``bps``), SI or IEC.
_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
    "kibps": 8 * 2**10,
    "mibps": 8 * 2**20,
    "gibps": 8 * 2**30,
    "tibps": 8 * 2**40,
}
#: The link rate the demo and the benchmarks use across hosts unless told: the tiny test model's
#: KV is 1 KiB per token (2 layers x K and V x 2 KV heads x 32 dims x 4 bytes, float32; measured:
#: 622,592 NIXL bytes for a 600-token prompt, 19 blocks of 32 tokens), Llama-3-8B's 128 KiB
#: (32 layers x K and V x 8 KV heads x 128 dims x 2 bytes). A link that moves the tiny model's
#: tokens as fast as 100 Gbit/s moves the 8B model's is 100 Gbit/s / 128 = 781 Mbit/s, rounded
#: to 800mbit.
DEFAULT_LINK = "800mbit"
#: The hardware address :meth:`Host.cut` points two hosts' entries for each other at: a locally
#: administered address that is all zeros otherwise, which no veth the kit makes is given.
NOWHERE = "02:00:00:00:00:00"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,15}$")


class HostsError(RuntimeError):
    """A host could not be created or removed; says which command failed and what it printed."""


class HostsUnavailable(HostsError):
    """Network namespaces cannot be made here (not root); the message is one line saying why."""


def parse_rate(text: str) -> int:
    """A link rate as ``tc`` writes it (``10gbit``, ``800mbit``, ``50mbit``, ``125mbps``) -> bits
    per second."""
    m = _RATE.match(text) if isinstance(text, str) else None
    unit = m.group(2).lower() if m else ""
    if m and unit in _RATE_UNITS:
        try:
            bits = int(Decimal(m.group(1)) * _RATE_UNITS[unit])
        except InvalidOperation:  # the pattern admits only plain decimals; kept for safety
            bits = 0
        if bits > 0:
            return bits
    raise ValueError(
        f"expected a link rate such as 10gbit, 800mbit or 50mbit (tc's units: bit, kbit, mbit, gbit, "
        f"tbit, or bytes per second: bps, kbps, mbps, gbps), got {text!r}"
    )


def format_rate(bits: int) -> str:
    """Bits per second in tc's largest unit that divides them (``10gbit``), else in ``bit``."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits % _RATE_UNITS[unit] == 0:
            return f"{bits // _RATE_UNITS[unit]}{unit}"
    return f"{bits}bit"


def tbf_args(bits: int) -> list[str]:
    """``tc qdisc`` arguments of a token bucket at ``bits`` per second: a bucket of a millisecond
    at the rate but at least 64 KiB (a veth hands tbf segmentation-offload packets of up to 64 KiB,
    which a smaller bucket splits in software), and 50 ms of queue before it drops."""
    burst = max(64 * 1024, bits // 8 // 1000)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]


#: CAP_NET_ADMIN (links, addresses, qdiscs) and CAP_SYS_ADMIN (namespaces, setns), as bit numbers.
_CAPS = {"CAP_NET_ADMIN": 12, "CAP_SYS_ADMIN": 21}


def effective_capabilities() -> int:
    """This process's effective capability set (``CapEff`` in /proc/self/status), 0 if unknown."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def unavailable() -> str | None:
    """Why hosts cannot be made here, in one line; None where they can (root, with ``ip`` and
    ``tc``). The tests that need hosts skip with this line (:func:`skip_reason`)."""
    caps = effective_capabilities()
    missing = [name for name, bit in _CAPS.items() if not caps >> bit & 1]
    if missing:
        return (
            f"network namespaces need root ({' and '.join(missing)} missing, uid {os.geteuid()}): "
            "the two-host kit and its tests are off"
        )
    tools = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if tools:
        return (
            f"network namespaces need iproute2 ({', '.join(tools)} not found): the two-host kit and its tests are off"
        )
    return None


#: Set to ``1`` where the tests that make hosts must run (CI: ``.ci/run``); there they are not
#: skipped where namespaces cannot be made, they fail (:func:`skip_reason`).
REQUIRE_ENV = "KVCOMPOSE_REQUIRE_HOSTS"


def skip_reason() -> str | None:
    """Why a test module that makes hosts skips here, for its ``skipif``: :func:`unavailable`'s
    line, or None where hosts can be made. Where ``$KVCOMPOSE_REQUIRE_HOSTS`` is ``1`` it is None
    too: the tests run, and where namespaces cannot be made they fail when they make their hosts
    (:class:`HostsUnavailable`, with the same line), so that a CI runner without root fails the
    run instead of skipping them."""
    if os.environ.get(REQUIRE_ENV) == "1":
        return None
    return unavailable()


def _run(argv: Sequence[str], check: bool = True) -> str:
    """Run one ``ip``/``tc`` command; its stdout. A failure is a :class:`HostsError` quoting it."""
    done = subprocess.run(list(argv), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise HostsError(f"{' '.join(argv)} failed (rc={done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class LinkBytes:
    """Bytes a host's ``eth0`` has received and sent since it was created."""

    rx: int
    tx: int

    def __sub__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.rx - other.rx, self.tx - other.tx)


#: What every process in a host gets on top of its environment (:meth:`Host.environ`; the address
#: is filled in): UCX's tcp transport only, over the host's own device, so that NIXL between two
#: hosts cannot use the shared memory (cma, posix, sysv) the namespaces do not separate; and vLLM's
#: own address and NIXL side channel on the host's address (the compositions leave
#: ``side_channel_host`` unset there, as ``deploy/kubernetes/`` does: :func:`~kvcompose_tools.e2e.spec.placed`).
NETWORK_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": DEVICE,
    "VLLM_HOST_IP": "{address}",
    SIDE_CHANNEL_HOST_ENV: "{address}",
}


@dataclass(frozen=True)
class Host:
    """One host: a network namespace with ``eth0`` at ``address`` on the kit's subnet."""

    name: str
    netns: str
    address: str
    #: the link's rate in bits per second, both directions; None: not shaped
    rate: int | None = None
    device: str = DEVICE

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this host (``ip netns exec`` execs it in place: same pid, same process
        group)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def env(self) -> dict[str, str]:
        """:data:`NETWORK_ENV` for this host."""
        return {k: v.format(address=self.address) for k, v in NETWORK_ENV.items()}

    def environ(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with :meth:`env` on top."""
        return {**(os.environ if base is None else base), **self.env()}

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in this host with ``env`` as it is (default: :meth:`environ`)."""
        return subprocess.Popen(self.command(argv), env=dict(self.environ() if env is None else env), **popen)

    def url(self, port: int) -> str:
        return f"http://{self.address}:{port}"

    def link_bytes(self) -> LinkBytes:
        """What ``eth0`` has received and sent so far (the kernel's counters)."""
        out = _run(["ip", "-n", self.netns, "-j", "-s", "link", "show", "dev", self.device])
        stats = json.loads(out)[0]["stats64"]
        return LinkBytes(int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"]))

    def mac(self) -> str:
        """``eth0``'s hardware address."""
        out = _run(["ip", "-n", self.netns, "-j", "link", "show", "dev", self.device])
        return str(json.loads(out)[0]["address"])

    def cut(self, peer: Host) -> None:
        """Cut the path between this host and ``peer`` both ways, silently, as a failed switch
        path does: each host's neighbour entry for the other becomes a hardware address no host
        has (:data:`NOWHERE`), so their packets to each other reach no one, with no error to the
        sender (TCP retransmits, UCX sees no answer). Everything else, the root namespace's
        router and clients included, still reaches both. :meth:`restore` undoes it."""
        for a, b in ((self, peer), (peer, self)):
            a._neighbour(b, NOWHERE, "permanent")

    def restore(self, peer: Host) -> None:
        """Undo :meth:`cut`: each host's entry for the other is its real address again."""
        for a, b in ((self, peer), (peer, self)):
            a._neighbour(b, b.mac(), "reachable")

    def _neighbour(self, peer: Host, lladdr: str, state: str) -> None:
        """This host's neighbour entry for ``peer``: ``lladdr``, in ``state``."""
        _run(
            [
                "ip",
                "-n",
                self.netns,
                "neigh",
                "replace",
                peer.address,
                "lladdr",
                lladdr,
                "nud",
                state,
                "dev",
                self.device,
            ]
        )

    def is_cut(self, peer: Host) -> bool:
        """Whether :meth:`cut` holds between this host and ``peer`` (either way)."""
        for a, b in ((self, peer), (peer, self)):
            out = _run(["ip", "-n", a.netns, "-j", "neigh", "show", b.address, "dev", a.device])
            if any(e.get("lladdr") == NOWHERE for e in json.loads(out or "[]")):
                return True
        return False


#: Sequence numbers of the kits this process creates (several may live at once).
_SEQ = itertools.count()
#: The kits of this process that are up: what the atexit hook removes.
_LIVE: set[Hosts] = set()
_LIVE_LOCK = threading.Lock()


class Hosts:
    """Hosts named ``names``, their links at ``link`` (tc's units; ``links`` sets single hosts'
    rates apart; None: unshaped). Use as a context manager, or call :meth:`start` and
    :meth:`close`. ``hosts["decode"]`` is a :class:`Host`; :attr:`root_address` is the root
    namespace's address on the switch.

    Raises :class:`HostsUnavailable` (one line) where namespaces cannot be made.
    """

    def __init__(
        self, names: Sequence[str], link: str | None = None, links: Mapping[str, str | None] | None = None
    ) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"hosts need distinct names, got {list(names)}")
        for name in names:
            if not _NAME.match(name):
                raise ValueError(f"a host's name is a lowercase letter then up to 15 letters or digits, got {name!r}")
        unknown = set(links or {}) - set(names)
        if unknown:
            raise ValueError(f"links names hosts that are not among {list(names)}: {sorted(unknown)}")
        rates = {n: (links or {}).get(n, link) for n in names}
        self.rates: dict[str, int | None] = {n: parse_rate(r) if r is not None else None for n, r in rates.items()}
        self.names = list(names)
        self.tag = f"{PREFIX}{os.getpid()}-{next(_SEQ)}"
        #: the switch's namespace (the bridge and every host's port)
        self.switch = self.tag
        #: the root namespace's end of its link to the switch (veth names are at most 15 characters)
        self.root_device = f"kvc{os.getpid()}r{self.tag.rsplit('-', 1)[1]}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.root_address: str | None = None
        self.hosts: dict[str, Host] = {}
        self._created: list[str] = []

    # ------------------------------------------------------------------ access

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    @property
    def namespaces(self) -> list[str]:
        """The namespaces this kit created and has not removed yet."""
        return list(self._created)

    # ------------------------------------------------------------------ lifetime

    def __enter__(self) -> Hosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Hosts:
        """Create the switch and every host; on any failure, remove what was made and raise."""
        reason = unavailable()
        if reason is not None:
            raise HostsUnavailable(reason)
        with _LIVE_LOCK:
            _LIVE.add(self)
        _catch_sigterm()
        try:
            with _signals_held():
                with _creation_lock():
                    sweep_stale()
                    self._create()
        except BaseException:  # a Ctrl-C held during creation arrives here, after it
            self.close()
            raise
        return self

    def _create(self) -> None:
        self.subnet = free_subnet()
        addresses = self.subnet.hosts()
        self.root_address = str(next(addresses))
        self._add_netns(self.switch)
        sw = ["ip", "-n", self.switch]
        _run([*sw, "link", "add", "br0", "type", "bridge"])
        _run([*sw, "link", "set", "br0", "up"])
        _run(["ip", "link", "add", self.root_device, "type", "veth", "peer", "name", "uplink", "netns", self.switch])
        _run([*sw, "link", "set", "uplink", "master", "br0", "up"])
        _run(["ip", "addr", "add", f"{self.root_address}/{self.subnet.prefixlen}", "dev", self.root_device])
        _run(["ip", "link", "set", self.root_device, "up"])
        for i, name in enumerate(self.names):
            host = Host(name, f"{self.tag}-{name}", str(next(addresses)), self.rates[name])
            self._add_netns(host.netns)
            port = f"port{i}"
            # Both ends are made in their namespaces: no name is ever taken in the root's.
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    port,
                    "netns",
                    self.switch,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    DEVICE,
                    "netns",
                    host.netns,
                ]
            )
            _run([*sw, "link", "set", port, "master", "br0", "up"])
            hn = ["ip", "-n", host.netns]
            _run([*hn, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", DEVICE])
            _run([*hn, "link", "set", DEVICE, "up"])
            if host.rate is not None:
                _run(["tc", "-n", host.netns, "qdisc", "add", "dev", DEVICE, "root", *tbf_args(host.rate)])
                _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *tbf_args(host.rate)])
            self.hosts[name] = host

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def close(self) -> list[str]:
        """Stop every process still in the hosts, remove the namespaces (their veths and qdiscs go
        with them) and the root namespace's link; what could not be removed (empty: all). Safe to
        call twice, and from an exception handler."""
        with _signals_held():
            leftovers = remove_namespaces(self._created, [self.root_device])
            self._created = [n for n in self._created if n in leftovers]
        with _LIVE_LOCK:
            _LIVE.discard(self)
            last = not _LIVE
        if last:
            _restore_sigterm()
        return leftovers


def _catch_sigterm() -> None:
    """SIGTERM, left at its default (which would end the process without cleanup), becomes an
    exit that unwinds while any kit is up: ``with`` blocks and the atexit hook remove the hosts."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _restore_sigterm() -> None:
    """SIGTERM's default again, once the last kit is down (unless someone else set it since)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is _exit_on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait (blocked, not lost) while hosts are created or removed, so that a
    Ctrl-C cannot leave half a host behind; in other threads, nothing to do (signals go to the
    main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def _creation_lock() -> Iterator[None]:
    with open(LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 from :data:`SUBNET_POOLS` that no route or address of the root namespace overlaps
    (other kits' subnets included: each has a route to its switch)."""
    taken = []
    for entry in json.loads(_run(["ip", "-4", "-j", "route", "show", "table", "all"]) or "[]"):
        dst = entry.get("dst", "")
        if dst and dst != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    for link in json.loads(_run(["ip", "-4", "-j", "addr", "show"]) or "[]"):
        for a in link.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a.get('prefixlen', 32)}", strict=False))
    start = os.getpid() % 256
    for pool in SUBNET_POOLS:
        subnets = list(ipaddress.ip_network(pool).subnets(new_prefix=24))
        for net in subnets[start % len(subnets) :] + subnets[: start % len(subnets)]:
            if not any(net.overlaps(t) for t in taken):
                return net
    raise HostsError(f"no free /24 in {', '.join(SUBNET_POOLS)}: every one overlaps a route of this machine")


def remove_namespaces(namespaces: Sequence[str], root_devices: Sequence[str] = ()) -> list[str]:
    """Kill every process in ``namespaces`` (SIGKILL, by pid: only the kit starts processes in
    them), delete ``root_devices`` and the namespaces; those still listed afterwards."""
    existing = set(list_namespaces())
    mine = [n for n in namespaces if n in existing]
    for name in mine:
        for pid in _pids_in(name):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    while any(_pids_in(n) for n in mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    for device in root_devices:
        _run(["ip", "link", "del", device], check=False)
    for name in mine:
        _run(["ip", "netns", "del", name], check=False)
    left = set(list_namespaces())
    return [n for n in namespaces if n in left]


def _pids_in(netns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def list_namespaces() -> list[str]:
    """The named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).splitlines() if line.strip()]


def kit_namespaces(pid: int | None = None) -> list[str]:
    """The namespaces kits created (``pid``: only that process's)."""
    prefix = f"{PREFIX}{pid}-" if pid is not None else PREFIX
    return [n for n in list_namespaces() if n.startswith(prefix)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove the namespaces (and root-namespace links) of kits whose process is gone: a kit
    killed outright leaves them. The namespaces removed."""
    stale = [n for n in kit_namespaces() if (m := re.match(rf"{PREFIX}(\d+)-", n)) and not _alive(int(m.group(1)))]
    devices = []
    for link in json.loads(_run(["ip", "-j", "link", "show"], check=False) or "[]"):
        m = re.fullmatch(r"kvc(\d+)r\d+", link.get("ifname", ""))
        if m and not _alive(int(m.group(1))):
            devices.append(link["ifname"])
    if not stale and not devices:
        return []
    left = remove_namespaces(stale, devices)
    return [n for n in stale if n not in left]


def _close_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for hosts in live:
        hosts.close()


atexit.register(_close_all)
