"""The two-host kit (:mod:`kvcompose_tools.e2e.hosts`), no engine: namespaces made and removed whatever
happens, the link's rate measured, NIXL's bytes seen on the link, servers and the router placed in
the hosts named. The tests that make hosts skip, with the kit's one-line reason, where it cannot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.needs import hosts_or_skip
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e import hosts as hosts_module
from kvcompose_tools.e2e import processes as processes_module
from kvcompose_tools.e2e.hosts import (
    Hosts,
    HostsUnavailable,
    format_rate,
    kit_namespaces,
    list_namespaces,
    parse_rate,
    skip_reason,
    sweep_stale,
    tbf_args,
    unavailable,
)
from kvcompose_tools.e2e.linkprobe import Lane, nixl_read, off_network, throughput, ucx_lanes
from kvcompose_tools.e2e.node import EngineNode
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec

#: The rate the link probe sets: low enough that this machine's CPUs never limit it.
PROBE_RATE = "50mbit"
PROBE_S = 2.0
#: Payload over the set rate: TCP/IP and Ethernet headers take about 4 % of a full frame.
RATE_BOUNDS = (0.80, 1.05)


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Root (else skip), and no namespace of this process's kits in ``ip netns list`` before the
    test or after it (other processes' kits may come and go meanwhile)."""
    hosts_or_skip()
    assert kit_namespaces(os.getpid()) == []
    yield
    assert kit_namespaces(os.getpid()) == [] and _root_devices(os.getpid()) == []


def _root_devices(pid: int) -> list[str]:
    out = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    return [line.split("@")[0].split()[0] for line in out.splitlines() if line.startswith(f"kvc{pid}r")]


def _netns_of(pid: int, wait_s: float = 5.0) -> str:
    """The named namespace ``pid`` runs in, once it has entered one (``ip netns exec`` does so
    right after it starts)."""
    deadline = time.monotonic() + wait_s
    while True:
        name = subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()
        if name or time.monotonic() > deadline:
            return name
        time.sleep(0.02)


# ---------------------------------------------------------------------------- no root needed


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("10gbit", 10**10),
        ("800mbit", 8 * 10**8),
        ("50mbit", 5 * 10**7),
        ("1.5gbit", 15 * 10**8),
        ("64kibit", 64 * 1024),
        ("125mbps", 10**9),
        (" 2 Gbit ", 2 * 10**9),
    ],
)
def test_link_rates_are_read_in_tcs_units(text: str, bits: int) -> None:
    assert parse_rate(text) == bits
    assert parse_rate(format_rate(bits)) == bits


@pytest.mark.parametrize("text", ["10 gigs", "0mbit", "", "-5mbit", "mbit", "10", 10])
def test_a_rate_that_is_not_one_is_a_clear_error(text: Any) -> None:
    with pytest.raises(ValueError, match=r"expected a link rate such as 10gbit, 800mbit or 50mbit .*got"):
        parse_rate(text)


def test_the_token_bucket_holds_a_millisecond_at_the_rate_and_a_whole_offload_packet() -> None:
    assert tbf_args(10**10)[:5] == ["tbf", "rate", "10000000000bit", "burst", str(10**10 // 8 // 1000)]
    assert tbf_args(5 * 10**7)[4] == str(64 * 1024)


def test_host_names_and_links_are_checked_before_anything_is_made() -> None:
    with pytest.raises(ValueError, match="distinct names"):
        Hosts(["a", "a"])
    with pytest.raises(ValueError, match="lowercase letter"):
        Hosts(["Prefill"])
    with pytest.raises(ValueError, match=r"not among \['a'\]: \['b'\]"):
        Hosts(["a"], links={"b": "1gbit"})
    with pytest.raises(ValueError, match="expected a link rate"):
        Hosts(["a"], link="fast")


@pytest.mark.parametrize(
    ("caps", "missing"),
    [(0, "CAP_NET_ADMIN and CAP_SYS_ADMIN"), (1 << 12, "CAP_SYS_ADMIN"), (1 << 21, "CAP_NET_ADMIN")],
)
def test_without_root_the_kit_says_why_in_one_line_and_its_tests_skip(
    monkeypatch: pytest.MonkeyPatch, caps: int, missing: str
) -> None:
    monkeypatch.setattr(hosts_module, "effective_capabilities", lambda: caps)
    reason = unavailable()
    assert reason is not None and "\n" not in reason
    assert reason.startswith(f"network namespaces need root ({missing} missing, uid ")
    with pytest.raises(HostsUnavailable) as raised:
        Hosts(["a", "b"]).start()
    assert str(raised.value) == reason
    monkeypatch.delenv("KVCOMPOSE_REQUIRE_HOSTS", raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        hosts_or_skip()
    assert skipped.value.msg == reason
    # Where hosts are required (CI), the same test does not skip: it fails when it makes its hosts.
    monkeypatch.setenv("KVCOMPOSE_REQUIRE_HOSTS", "1")
    hosts_or_skip()
    assert skip_reason() is None


def test_ucx_lanes_are_read_from_its_protocol_tables() -> None:
    text = textwrap.dedent(
        """\
        [1795.1] [vm:1:0]   +--------+-------------+-----------------+
        [1795.1] [vm:1:0]   | reader inter-node cfg#1                 |
        [1795.1] [vm:1:0]   | remote memory read by ucp_get* from host memory |
        [1795.1] [vm:1:0]   +--------+-------------+-----------------+
        [1795.1] [vm:1:0]   | Range  | Description |     Config      |
        [1795.1] [vm:1:0]   +--------+-------------+-----------------+
        [1795.1] [vm:1:0]   | 0..inf | zero-copy   | tcp/eth0        |
        [1795.1] [vm:1:0]   +--------+-------------+-----------------+
        [1795.2] [vm:1:0]   | reader intra-node cfg#2                 |
        [1795.2] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
        [1795.2] [vm:1:0]   | 0..8184 | short      | cma/memory      |
        [1795.2] [vm:1:0]   | reader self cfg#0                 |
        [1795.2] [vm:1:0]   | active message by ucp_am_send* from host memory |
        [1795.2] [vm:1:0]   |  65529..inf | multi-frag zero-copy | sysv/memory |
        """
    )
    lanes = ucx_lanes(text)
    assert lanes == [
        Lane("reader", "inter-node", "remote memory read by ucp_get* from host memory", "tcp/eth0"),
        Lane("reader", "intra-node", "remote memory write by ucp_put* from host memory to host", "cma/memory"),
        Lane("reader", "self", "active message by ucp_am_send* from host memory", "sysv/memory"),
    ]
    assert off_network(lanes, "eth0") == [lanes[1]]


# ---------------------------------------------------------------------------- hosts made


def test_hosts_get_a_namespace_an_address_a_shaped_link_and_are_removed(no_leftovers: None) -> None:
    with Hosts(["prefill", "decode"], link="1gbit", links={"decode": None}) as hosts:
        prefill, decode = hosts["prefill"], hosts["decode"]
        assert set(hosts.namespaces) == {hosts.switch, prefill.netns, decode.netns}
        assert all(n.startswith(f"kvc-{os.getpid()}-") for n in hosts.namespaces)
        assert set(kit_namespaces(os.getpid())) >= set(hosts.namespaces)
        assert hosts.subnet is not None and {prefill.address, decode.address, hosts.root_address} <= {
            str(a) for a in hosts.subnet.hosts()
        }
        for host in hosts:
            links = json.loads(subprocess.check_output(["ip", "-n", host.netns, "-j", "addr", "show"]))
            assert {link["ifname"]: link["operstate"] for link in links} == {"lo": "UNKNOWN", "eth0": "UP"}
        qdisc = subprocess.check_output(["tc", "-n", prefill.netns, "qdisc", "show", "dev", "eth0"], text=True)
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        ports = subprocess.check_output(["tc", "-n", hosts.switch, "qdisc", "show"], text=True)
        assert ports.count("rate 1Gbit") == 1  # prefill's port; decode's link is not shaped
        assert "tbf" not in subprocess.check_output(["tc", "-n", decode.netns, "qdisc", "show"], text=True)
        assert decode.env() == {
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": "eth0",
            "VLLM_HOST_IP": decode.address,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": decode.address,
        }
        assert _root_devices(os.getpid()) == [hosts.root_device]
    assert not set(hosts.namespaces) & set(list_namespaces())
    assert _root_devices(os.getpid()) == []


def test_an_exception_in_the_block_removes_the_hosts_and_what_runs_in_them(no_leftovers: None) -> None:
    with pytest.raises(RuntimeError, match="the test failed"), Hosts(["a"]) as hosts:
        sleeper = hosts["a"].popen(["sleep", "300"])
        assert _netns_of(sleeper.pid) == hosts["a"].netns
        raise RuntimeError("the test failed")
    assert sleeper.wait(10) == -signal.SIGKILL
    assert kit_namespaces(os.getpid()) == []


# A shell without job control (CI's, a script's `&`) starts its background jobs with SIGINT
# ignored, and the child inherits that; a user's Ctrl-C reaches a foreground process that has
# Python's handler, which the script puts back.
KIT_SCRIPT = """
import json, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from kvcompose_tools.e2e.hosts import Hosts
with Hosts(["prefill", "decode"], link="1gbit") as hosts:
    sleeper = hosts["decode"].popen(["sleep", "300"])
    print(json.dumps({"namespaces": hosts.namespaces, "sleeper": sleeper.pid}), flush=True)
    time.sleep(120)
"""


def _ended(pid: int, wait_s: float = 5.0) -> bool:
    """``pid`` is gone, or a zombie its new parent has not reaped yet."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def _kit_in_a_child() -> tuple[subprocess.Popen[str], dict[str, Any]]:
    # Its traceback on Ctrl-C is expected: stderr is dropped.
    child = subprocess.Popen(
        [sys.executable, "-c", KIT_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_process_running_the_kit_stopped_by_a_signal_leaves_no_namespace(no_leftovers: None, sig: int) -> None:
    child, made = _kit_in_a_child()
    assert set(made["namespaces"]) <= set(list_namespaces())
    child.send_signal(sig)
    assert child.wait(30) != 0
    assert kit_namespaces(child.pid) == [] and _root_devices(child.pid) == []
    assert _ended(made["sleeper"])


def test_sigterm_unwinds_while_any_kit_is_up_and_is_its_default_again_after(no_leftovers: None) -> None:
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler in this process already; the kit leaves it alone")
    with Hosts(["a"]):
        with Hosts(["b"]):
            pass
        assert signal.getsignal(signal.SIGTERM) is hosts_module._exit_on_sigterm  # one kit is still up
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_kit_killed_outright_is_swept_by_the_next_one(no_leftovers: None) -> None:
    child, made = _kit_in_a_child()
    child.kill()
    child.wait(30)
    assert set(kit_namespaces(child.pid)) == set(made["namespaces"])  # SIGKILL: nothing ran
    assert set(made["namespaces"]) <= set(sweep_stale())
    assert kit_namespaces(child.pid) == [] and _root_devices(child.pid) == []
    assert _ended(made["sleeper"])


# ---------------------------------------------------------------------------- the link


def test_the_links_rate_holds_in_both_directions(no_leftovers: None) -> None:
    """A's link at 50 Mbit/s, B's unshaped: a stream each way is held to A's rate (A's own queue
    one way, its switch port's the other)."""
    with Hosts(["a", "b"], link=PROBE_RATE, links={"b": None}) as hosts:
        out = throughput(hosts["a"], hosts["b"], PROBE_S)
        back = throughput(hosts["b"], hosts["a"], PROBE_S)
    rate = parse_rate(PROBE_RATE)
    low, high = (bound * rate for bound in RATE_BOUNDS)
    print(f"\nset {PROBE_RATE}: a->b {out / 1e6:.1f} Mbit/s, b->a {back / 1e6:.1f} Mbit/s (payload)")
    assert low <= out <= high and low <= back <= high, (out, back)


NIXL_BYTES = 8 << 20


def test_nixl_between_two_hosts_moves_every_byte_over_the_link(no_leftovers: None) -> None:
    with Hosts(["prefill", "decode"], link="1gbit") as hosts:
        read = nixl_read(hosts["prefill"], hosts["decode"], NIXL_BYTES)
    assert read.ok, read.log[-2000:]
    print(f"\nNIXL READ of {read.nbytes} B: decode's eth0 received {read.link.rx} B")
    assert read.link.rx >= read.nbytes
    assert off_network(read.lanes, "eth0") == []
    assert any(lane.peer == "inter-node" and "read" in lane.operation for lane in read.lanes), read.lanes


def test_without_the_hosts_ucx_settings_nixl_would_read_through_shared_memory(no_leftovers: None) -> None:
    """The control: namespaces alone separate the network, not memory. UCX then finds the peer
    on this machine (intra-node) and copies through the kernel, and the link stays all but idle:
    the byte count above is what tells the two apart."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    with Hosts(["prefill", "decode"], link="1gbit") as hosts:
        read = nixl_read(hosts["prefill"], hosts["decode"], NIXL_BYTES, env=env)
    assert read.ok, read.log[-2000:]
    print(f"\nwithout UCX_TLS: NIXL READ of {read.nbytes} B, decode's eth0 received {read.link.rx} B")
    assert read.link.rx < read.nbytes // 10
    assert any(lane.peer == "intra-node" for lane in off_network(read.lanes, "eth0")), read.lanes


# ---------------------------------------------------------------------------- placed in hosts

WORKER_SCRIPT = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Ok(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Ok).serve_forever()
"""


class _Worker:
    def __init__(self, url: str) -> None:
        self.url = url


def test_the_router_runs_in_the_host_named_and_reaches_workers_in_others(no_leftovers: None, tmp_path: Path) -> None:
    with Hosts(["router", "prefill", "decode"]) as hosts:
        workers = [
            hosts[n].popen([sys.executable, "-c", WORKER_SCRIPT, hosts[n].address, "8100"])
            for n in ("prefill", "decode")
        ]
        router = None
        try:
            router = RouterNode(
                [_Worker(hosts["prefill"].url(8100))],
                [_Worker(hosts["decode"].url(8100))],
                "m",
                tmp_path,
                host=hosts["router"],
            )
            router.wait_ready()  # from the root namespace, through the switch
            assert router.url.startswith(f"http://{hosts['router'].address}:")
            assert _netns_of(router.proc.pid) == hosts["router"].netns
        finally:
            if router is not None:
                router.close()
            for w in workers:
                w.kill()
                w.wait()


def test_servers_and_engines_in_a_host_bind_its_address_with_its_network_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What a server and an offline engine are started with in a host (nothing started: a stand-in
    process takes their place)."""
    from kvcompose_tools.e2e.hosts import Host

    host = Host("decode", "kvc-1-0-decode", "10.213.9.3")
    started: list[tuple[list[str], dict[str, str]]] = []

    def start(name: str, argv: list[str], **popen: Any) -> subprocess.Popen[Any]:
        started.append((argv, popen["env"]))
        return subprocess.Popen(["true"], stdin=subprocess.PIPE, text=True)

    monkeypatch.setattr(processes_module, "start_group", start)
    spec = EngineSpec("decode", "model", str(EXAMPLES / "pd-decode.yaml"), 5601)
    server = ServerNode(spec, tmp_path, port=8200, host=host)
    EngineNode(spec, tmp_path, host=host).proc.wait()
    assert server.url == "http://10.213.9.3:8200"
    for argv, env in started:
        assert argv[:4] == ["ip", "netns", "exec", "kvc-1-0-decode"]
        # The side channel's address from the environment, the composition's host unset (the
        # example's 127.0.0.1 dropped), as deploy/kubernetes/ runs it with the pod IP.
        rendered = json.dumps(json.loads(_kv_config(argv)), separators=(",", ":"))
        assert "kvcompose_side_channel_host" not in rendered and "127.0.0.1" not in rendered
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.213.9.3"
        assert {k: env[k] for k in host.env()} == host.env()
    assert started[0][0][started[0][0].index("--host") + 1] == "10.213.9.3"
    server.proc.wait()


def _kv_config(argv: list[str]) -> str:
    if "--kv-transfer-config" in argv:
        return argv[argv.index("--kv-transfer-config") + 1]
    spec = json.loads(argv[-1])  # the offline engine's EngineSpec
    return json.dumps(EngineSpec(**spec).kv_transfer_config())


def _connects(src: hosts_module.Host | None, address: str, port: int) -> bool:
    """Whether a TCP connection from ``src`` (None: the root namespace) to ``address:port`` opens
    within a second."""
    code = f"import socket; socket.create_connection(({address!r}, {port}), timeout=1.0)"
    argv = [sys.executable, "-c", code]
    return subprocess.run(src.command(argv) if src else argv, capture_output=True).returncode == 0


def test_a_cut_path_drops_both_ways_between_two_hosts_only_and_is_restored(no_leftovers: None) -> None:
    listen = "import socket\ns = socket.socket(); s.bind(('0.0.0.0', 9099)); s.listen(64)\nwhile True: s.accept()[0]"
    with Hosts(["prefill", "decode", "other"]) as hosts:
        p, d, o = hosts["prefill"], hosts["decode"], hosts["other"]
        servers = [h.popen([sys.executable, "-c", listen]) for h in (p, d)]
        try:
            deadline = time.monotonic() + 10
            while not (_connects(None, p.address, 9099) and _connects(None, d.address, 9099)):
                assert time.monotonic() < deadline, "the listeners did not come up"
                time.sleep(0.1)
            assert _connects(p, d.address, 9099) and _connects(d, p.address, 9099)
            p.cut(d)
            assert p.is_cut(d) and d.is_cut(p)
            # Silent both ways (the connection times out: no error from the kernel either) ...
            assert not _connects(p, d.address, 9099) and not _connects(d, p.address, 9099)
            # ... and nothing else: the root namespace (the router) and a third host reach both.
            assert all(_connects(src, h.address, 9099) for src in (None, o) for h in (p, d))
            p.restore(d)
            assert not p.is_cut(d) and not d.is_cut(p)
            assert _connects(p, d.address, 9099) and _connects(d, p.address, 9099)
        finally:
            for s in servers:
                s.kill()
                s.wait(10)
