"""A server joins a running vllm-router in P/D mode through the router's own discovery socket, and
leaves it when its ``/health`` fails (:mod:`kvcompose.discovery`, what ``kvcompose register``
runs): the real router binary, stand-in workers (no engine;
:class:`kvcompose_tools.e2e.kv_replay.StandInWorker`)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcompose.discovery import Registrar
from kvcompose_tools.e2e.kv_replay import MODEL, StandInWorker
from kvcompose_tools.e2e.processes import NodeError
from kvcompose_tools.e2e.router import RouterNode


def send(router: RouterNode, n: int) -> None:
    for i in range(n):
        body = json.dumps({"model": MODEL, "prompt": [1, 2, 3 + i], "max_tokens": 1}).encode()
        req = urllib.request.Request(f"{router.url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as answer:
            assert answer.status == 200


@pytest.fixture
def workers() -> Iterator[list[StandInWorker]]:
    made = [StandInWorker() for _ in range(3)]
    yield made
    for w in made:
        w.close()


def test_a_decode_that_registers_takes_requests_from_a_running_router(
    tmp_path: Path, workers: list[StandInWorker]
) -> None:
    prefill, decode, joining = workers
    router = RouterNode([prefill], [decode], MODEL, tmp_path, policy="round_robin", discovery=True)
    try:
        router.wait_ready()
        send(router, 4)
        assert (decode.served, joining.served) == (4, 0)  # the control: not registered, not routed to
        router.join("decode", joining)
        send(router, 4)
        assert (decode.served, joining.served) == (6, 2)
        assert prefill.served == 8
    finally:
        router.close()


def test_a_decode_whose_health_fails_leaves_the_router_within_its_expiry(
    tmp_path: Path, workers: list[StandInWorker]
) -> None:
    prefill, decode, failing = workers
    router = RouterNode([prefill], [decode, failing], MODEL, tmp_path, policy="round_robin", discovery=True)
    try:
        router.wait_ready()
        send(router, 4)
        assert (decode.served, failing.served) == (2, 2)  # the control: healthy, registered, routed to
        failing.healthy = False
        deadline = time.monotonic() + 15  # the router expires a registration after about 5 s
        while "expired" not in router.log_path.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.2)
        served = decode.served, failing.served
        send(router, 4)
        assert (decode.served, failing.served) == (served[0] + 4, served[1]), router.log_tail()
    finally:
        router.close()


def test_a_router_without_discovery_refuses_a_join_and_the_registrar_an_unknown_kind(
    tmp_path: Path, workers: list[StandInWorker]
) -> None:
    prefill, decode, joining = workers
    router = RouterNode([prefill], [decode], MODEL, tmp_path)
    try:
        with pytest.raises(NodeError, match="started with discovery only"):
            router.join("decode", joining)
    finally:
        router.close()
    registrar = Registrar("127.0.0.1:1")
    try:
        with pytest.raises(ValueError, match="registration kind 'encoder': one of prefill, decode"):
            registrar.add("encoder", joining.url)
    finally:
        registrar.close()
