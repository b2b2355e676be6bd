"""The path between the prefill and the decode host cut during P/D traffic, longer than the
prefill's lease, then restored (marker ``engine``; issue 36, items 4 and 5).

The shipped examples' servers, each in a host of its own (:mod:`kvcompose_tools.e2e.hosts`), behind
vLLM's router in the root namespace, with ``lease_seconds: 10`` on both sides (vLLM's 30 s would
triple the test) and each ``ucx_error_handling`` setting in turn.
:func:`kvcompose_tools.e2e.linkcut.cut_and_restore` cuts the path (:meth:`Host.cut`: silent, both
ways; the router still reaches both servers) for :data:`CUT_S`, sends requests through the router
meanwhile, restores it, and checks: every request sent during the cut ends (an answer or an HTTP
error) within :data:`~kvcompose_tools.e2e.linkcut.HANG_S`; KV usage is back to 0 on both servers; the
pair serves requests over NIXL again. Skipped, with the kit's reason, where namespaces cannot be
made.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.stack import Nodes, module_stack
from kvcompose.examples import EXAMPLES
from kvcompose_tools.e2e.hosts import DEFAULT_LINK, Hosts, kit_namespaces, skip_reason
from kvcompose_tools.e2e.linkcut import cut_and_restore
from kvcompose_tools.e2e.model import make_model
from kvcompose_tools.e2e.node import wait_all_ready
from kvcompose_tools.e2e.ports import free_ports
from kvcompose_tools.e2e.router import RouterNode
from kvcompose_tools.e2e.server import ServerNode
from kvcompose_tools.e2e.spec import EngineSpec

NO_HOSTS = skip_reason()
#: Long (``make test-long``), kept out of CI's hour for time; test_two_hosts.py and test_attacks.py
#: keep the hosts in ``make test``.
pytestmark = [pytest.mark.engine, pytest.mark.long, pytest.mark.skipif(NO_HOSTS is not None, reason=NO_HOSTS or "")]

LEASE_S = 10
#: Longer than the lease: the prefill frees the blocks nobody could read.
CUT_S = 15.0


class Stack(Nodes):
    """A prefill and a decode server of the examples, each in its host, behind the router."""

    def __init__(self, logs: Path, hosts: Hosts, error_handling: str) -> None:
        model = str(make_model(0))
        self.hosts = hosts
        options = {"ucx_error_handling": error_handling, "lease_seconds": LEASE_S}
        p_port, d_port = free_ports(2)
        super().__init__()
        self.prefill = ServerNode(
            EngineSpec("prefill", model, str(EXAMPLES / "pd-prefill.yaml"), p_port, options),
            logs,
            host=hosts["prefill"],
        )
        self.decode = ServerNode(
            EngineSpec("decode", model, str(EXAMPLES / "pd-decode.yaml"), d_port, options),
            logs,
            host=hosts["decode"],
        )
        self.nodes += [self.prefill, self.decode]
        wait_all_ready([self.prefill, self.decode])
        self.router = RouterNode([self.prefill], [self.decode], model, logs)
        self.nodes.append(self.router)
        self.router.wait_ready()


# The examples' own setting in `make test`; the other, a second pair of servers, in `make test-long`.
@pytest.fixture(params=["none", "peer"], ids=lambda v: f"ucx_error_handling-{v}")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    assert kit_namespaces(os.getpid()) == []
    with Hosts(["prefill", "decode"], link=DEFAULT_LINK) as hosts:
        yield from module_stack(Stack, "kvcompose-e2e-linkcut-", hosts, request.param)
    assert kit_namespaces(os.getpid()) == [], "the hosts' namespaces outlived the test"


def test_a_cut_longer_than_the_lease_hangs_no_request_frees_the_kv_and_the_pair_serves_again(
    stack: Stack,
) -> None:
    report = cut_and_restore(
        stack.router,
        stack.prefill,
        stack.decode,
        stack.hosts["prefill"],
        stack.hosts["decode"],
        CUT_S,
        echo=print,
    )
    assert report.problems() == [], "\n".join(report.lines()) + "\n" + stack.decode.log_tail(30)
