"""The router's source header on vLLM's server: ``--middleware`` as vLLM's server parses and
installs it (``init_entrypoints_middleware``), before a route that echoes the body it got; the
header is client input, so each refusal is pinned beside a control that passes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from kvcompose.serving import SOURCE_HEADER_MIDDLEWARE, server_args
from kvcompose.vllm import headers

SOURCE = "remote_kv_source"


@pytest.fixture(scope="module")
def client() -> TestClient:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    flags = server_args(None, source_header=True)
    assert flags == ["--middleware", SOURCE_HEADER_MIDDLEWARE]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *flags])
    app = FastAPI()

    async def echo(request: Request) -> dict[str, Any]:
        return {"body": json.loads(await request.body() or b"null"), "length": request.headers.get("content-length")}

    for route in (*headers.ROUTES, "/v1/embeddings"):
        app.post(route)(echo)
    init_entrypoints_middleware(args, app, ("generate",))
    return TestClient(app)


def post(client: TestClient, body: Any, header: str | None, route: str = "/v1/chat/completions") -> Any:
    extra = {} if header is None else {"x-kv-cache-source-host-port": header}
    return client.post(route, content=json.dumps(body), headers={"content-type": "application/json", **extra})


def test_the_header_becomes_the_source_role_of_the_params(client: TestClient) -> None:
    reply = post(client, {"messages": [], "kv_transfer_params": {"do_remote_decode": True}}, "10.0.0.8:5710")
    params = reply.json()["body"]["kv_transfer_params"]
    role = params[SOURCE]
    assert (role["remote_host"], role["remote_port"]) == ("10.0.0.8", 5710) and params["do_remote_decode"] is True
    assert role["kv_request_id"].startswith(headers.REQUEST_ID_PREFIX)
    assert int(reply.json()["length"]) == len(json.dumps(reply.json()["body"]).encode())
    again = post(client, {"prompt": [1, 2]}, "[fd00::8]:5710", "/v1/completions").json()["body"]
    assert again["kv_transfer_params"][SOURCE]["remote_host"] == "fd00::8"
    assert again["kv_transfer_params"][SOURCE]["kv_request_id"] != role["kv_request_id"]


@pytest.mark.parametrize(
    ("body", "header", "route"),
    [
        ({"prompt": [1]}, None, "/v1/completions"),  # no header
        ({"input": "x"}, "10.0.0.8:5710", "/v1/embeddings"),  # not a completion route
        ({"prompt": [1], "kv_transfer_params": {"do_remote_prefill": True}}, "10.0.0.8:5710", "/v1/completions"),
        ({"prompt": [1], "kv_transfer_params": {SOURCE: {"kv_request_id": "r"}}}, "10.0.0.8:5710", "/v1/completions"),
        ({"prompt": [1], "kv_transfer_params": "text"}, "10.0.0.8:5710", "/v1/completions"),
        ([1, 2], "10.0.0.8:5710", "/v1/completions"),  # not an object: vLLM answers it
    ],
)
def test_what_it_leaves_as_it_is(client: TestClient, body: Any, header: str | None, route: str) -> None:
    assert post(client, body, header, route).json()["body"] == body


@pytest.mark.parametrize(
    ("header", "says"),
    [
        ("10.0.0.8", "is not HOST:PORT"),
        (":5710", "is not HOST:PORT"),
        ("10.0.0.8:0", "the port is not a whole number"),
        ("10.0.0.8:99999", "the port is not a whole number"),
        ("10.0.0.8:57x", "the port is not a whole number"),
        ("a/b:5710", "is not HOST:PORT"),
        ("u@10.0.0.8:5710", "is not HOST:PORT"),
    ],
)
def test_a_bad_header_is_answered_400_naming_it_and_why(client: TestClient, header: str, says: str) -> None:
    reply = post(client, {"prompt": [1]}, header, "/v1/completions")
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert message.startswith("header x-kv-cache-source-host-port:") and says in message, message


def test_the_header_twice_and_a_body_over_the_limit_are_refused(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    twice = client.post(
        "/v1/completions",
        content=b"{}",
        headers=[("x-kv-cache-source-host-port", "10.0.0.8:5710"), ("x-kv-cache-source-host-port", "10.0.0.9:5710")],
    )
    assert twice.status_code == 400 and "more than once" in twice.json()["error"]["message"]
    monkeypatch.setattr(headers, "MAX_BODY_BYTES", 64)
    big = post(client, {"prompt": list(range(100))}, "10.0.0.8:5710", "/v1/completions")
    assert big.status_code == 413
    small = post(client, {"prompt": [1]}, "10.0.0.8:5710", "/v1/completions")  # control: under the limit
    assert small.status_code == 200 and SOURCE in small.json()["body"]["kv_transfer_params"]
