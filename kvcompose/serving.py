"""The command lines and environment of a P/D fleet behind vllm-router, written once.

A fleet is prefill and decode instances (vLLM's OpenAI-compatible servers, each with its
composition) behind vllm-router in P/D mode. What each process needs beyond its model and engine
settings is built here:

- :func:`server_args`: a server's flags for its composition: ``--kv-transfer-config`` (what
  ``kvcompose vllm-args`` prints) and, on a server that publishes its KV events (the prefills
  under ``kv_aware``), ``--kv-events-config`` and ``--enable-scale-out`` (the router renders each
  prompt through that server's ``/v1/completions/render``, which answers 403 without it);
- :data:`SIDE_CHANNEL_HOST_ENV`: the variable that puts a server's NIXL side channel on its own
  routable address when the composition leaves ``side_channel_host`` unset (the key variable is
  the composition's ``key_env``);
- :func:`router_args`: vllm-router's flags (:func:`kvcompose.router.pd_router_args`, where it
  listens, how long it waits for the servers), and :data:`HEALTH_ARGS`, its health checks in a fleet.

The test kit's servers and router (``kvcompose_tools.e2e``) build their command lines with these,
and the Kubernetes manifests in ``deploy/kubernetes/`` spell out the same flags:
``tools/tests/e2e/test_kubernetes.py`` checks them against these functions and Kubernetes' schemas.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvcompose.router import pd_router_args

#: vLLM's variable for the address a NIXL side channel binds and the prefill advertises as
#: ``remote_host`` (a composition's ``side_channel_host`` wins over it).
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
#: The router policy a fleet runs in ``deploy/kubernetes/`` and the kit's 2P2D engine test: the
#: prefill by the composed tiers' KV events, the decode by a hash of the session (benchmark 5k:
#: turns 2+ TTFT p50 0.74x ``round_robin``'s, every run; ``kv_aware``'s soft decode affinity
#: moved 9 % of later turns off the decode that held them).
FLEET_POLICY = "kv_aware+hash"
#: vLLM's ``--middleware`` that maps a router's source header onto the params (kvcompose.vllm.headers).
SOURCE_HEADER_MIDDLEWARE = "kvcompose.vllm.headers.SourceHeader"
#: The KV events topic: none, vLLM's default (vllm-router 0.1.17's subscribers take in only
#: batches published without one; docs/e2e.md, KV events).
KV_EVENTS_TOPIC = ""
#: vllm-router's health checks in a fleet: every second, out after two failures, back after one
#: success (its defaults: 60 s, 3, 2, which leave a dead prefill in the rotation for minutes), and
#: its circuit breaker open after two failed requests.
HEALTH_ARGS = (
    "--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--health-success-threshold", "1",
    "--health-check-timeout-secs", "2", "--cb-failure-threshold", "2",
)  # fmt: skip


def kv_events_config(endpoint: str) -> dict[str, Any]:
    """vLLM's ``KVEventsConfig`` for a server publishing its KV events (the composed tiers'
    included) on ``endpoint``: ``tcp://*:PORT`` (vLLM binds TCP only on every interface) or
    ``ipc://PATH``."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": KV_EVENTS_TOPIC}


def server_args(
    kv_transfer_config: str | None, kv_events: Mapping[str, Any] | None = None, source_header: bool = False
) -> list[str]:
    """A vLLM server's flags for P/D behind vllm-router, after its model and engine settings.

    ``kv_transfer_config``: the ``--kv-transfer-config`` value (``kvcompose vllm-args FILE``; None:
    a server without a connector). ``kv_events``: the server's ``KVEventsConfig``
    (:func:`kv_events_config`; None: it publishes none). ``source_header``: a router's
    ``x-kv-cache-source-host-port`` becomes the p2p tier's ``remote_kv_source``
    (:data:`SOURCE_HEADER_MIDDLEWARE`; a composition whose p2p tier has a pool)."""
    args: list[str] = []
    if source_header:
        args += ["--middleware", SOURCE_HEADER_MIDDLEWARE]
    if kv_events is not None:
        # The router's kv_aware tokenizes each prompt through this server's render routes.
        args += ["--kv-events-config", json.dumps(dict(kv_events)), "--enable-scale-out"]
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", kv_transfer_config]
    return args


def router_args(
    prefills: Sequence[str],
    decodes: Sequence[str],
    policy: str,
    prefill_events: Mapping[str, str] | None,
    listen: tuple[str, int],
    metrics: tuple[str, int],
    startup: tuple[int, int],
) -> list[str]:
    """vllm-router's flags (``python -m vllm_router.launch_router ...``): listen on ``listen``
    (host, port), P/D over NIXL in front of ``prefills`` and ``decodes`` (URLs) under ``policy``
    (``prefill_events``: each prefill URL's KV events endpoint, for ``kv_aware``), its Prometheus
    exporter on ``metrics`` (host, port), and ``startup``: how long it waits for every server's
    ``/health`` before it gives up, and how often it checks (seconds)."""
    host, port = listen
    args = ["--host", host, "--port", str(port)]
    args += pd_router_args(prefills, decodes, policy, prefill_events)
    args += ["--prometheus-host", metrics[0], "--prometheus-port", str(metrics[1])]
    args += ["--worker-startup-timeout-secs", str(startup[0]), "--worker-startup-check-interval", str(startup[1])]
    return args
