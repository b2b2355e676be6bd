"""How to run vLLM's router (vllm-router) in front of composed P/D instances.

vllm-router's P/D mode (``--vllm-pd-disaggregation --kv-connector nixl``) sends each request to
a prefill with ``max_tokens: 1``, then to a decode with the prefill's ``kv_transfer_params``. A
composition's host tier only pays where a conversation's next turn reaches the instance that
holds its history, so the router's policy matters (docs/e2e.md, "A fleet: 2P2D behind
vllm-router, prefills routed by their KV events"):

- ``kv_aware``: the prefill is chosen by the prompt tokens it would compute, from the prefills'
  KV events (``--pd-kv-events PREFILL_URL=tcp://HOST:PORT``: every composed tier's stores, host
  tier at ``--kv-penalty-host``); the decode by load, kept per ``X-Session-ID`` by
  ``--kv-aware-session-affinity-ttl-secs``, a soft affinity: a session is moved ("rebind") to a
  decode with fewer pending and active requests. vllm-router 0.1.17 indexes 16-token blocks
  only: engines of other block sizes publish through :mod:`kvcompose.relay`.
- ``kv_aware+hash``: the prefill as ``kv_aware``, the decode by ``consistent_hash``
  (``--decode-policy consistent_hash``): a session stays on its decode, whose host tier holds
  the conversation, whatever the decodes' load.
- ``consistent_hash``: prefill and decode by a hash of ``X-Session-ID``: a session stays on one
  of each, whatever they hold, and moves when the ring changes.
- ``round_robin``: neither kept.

:func:`pd_router_args` is that command line; the test kit's router and ``kvcompose check`` use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcompose.catalog import Plan
from kvcompose.relay import ROUTER_BLOCK_SIZE

#: The policies a fleet is measured under (``kvcompose bench --only fleet``).
POLICIES = ("round_robin", "consistent_hash", "kv_aware", "kv_aware+hash")
#: How long a session's decode stays bound while it is idle (``kv_aware``'s session affinity).
AFFINITY_TTL_S = 600
#: The request header that names a conversation (``consistent_hash``'s key; ``kv_aware``'s
#: session affinity).
SESSION_HEADER = "X-Session-ID"


def pd_router_args(
    prefills: Sequence[str],
    decodes: Sequence[str],
    policy: str = "kv_aware",
    prefill_events: Mapping[str, str] | None = None,
    affinity_ttl_s: int = AFFINITY_TTL_S,
) -> list[str]:
    """vllm-router's flags for P/D over NIXL in front of ``prefills`` and ``decodes`` (URLs)
    under ``policy`` (:data:`POLICIES`); ``prefill_events``: each prefill URL's KV events
    endpoint (``tcp://HOST:PORT``), which ``kv_aware`` needs for every prefill."""
    if policy not in POLICIES:
        raise ValueError(f"router policy {policy!r}: one of {', '.join(POLICIES)}")
    kv_aware = policy.startswith("kv_aware")
    args = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "kv_aware" if kv_aware else policy]
    if policy == "kv_aware+hash":
        args += ["--decode-policy", "consistent_hash"]
    for url in prefills:
        args += ["--prefill", url]
    for url in decodes:
        args += ["--decode", url]
    if kv_aware:
        events = dict(prefill_events or {})
        missing = [url for url in prefills if url not in events]
        if missing:
            raise ValueError(f"kv_aware routes prefills by their KV events: no endpoint for {', '.join(missing)}")
        for url in prefills:
            args += ["--pd-kv-events", f"{url}={events[url]}"]
        if policy == "kv_aware":
            args += ["--kv-aware-session-affinity-ttl-secs", str(affinity_ttl_s)]
    return args


#: The ``--kv-events-config`` a prefill needs for ``kv_aware`` (no topic: the router subscribes to none).
KV_EVENTS_CONFIG = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:PORT"}'


def router_brief(plan: Plan) -> list[str]:
    """``kvcompose check``'s short lines on vllm-router in front of this composition's instances
    (:func:`router_lines` has the reasons, for ``explain``)."""
    pd = plan.pd_transport
    if pd is None:
        return []
    if pd.role == "consumer":
        return ["behind vllm-router: --decode URL; --decode-policy consistent_hash keeps a session's decode"]
    return [
        "behind vllm-router: --prefill URL --policy kv_aware --pd-kv-events URL=tcp://HOST:PORT",
        "this prefill's vllm serve: --enable-scale-out --kv-events-config, for kv_aware:",
        f"  '{KV_EVENTS_CONFIG}'",
        f"vllm-router indexes {ROUTER_BLOCK_SIZE}-token blocks: another --block-size needs kvcompose relay-events",
    ]


def router_lines(plan: Plan) -> list[str]:
    """``kvcompose explain``'s lines on running vllm-router in front of this composition's
    instances (none without a P/D transport)."""
    pd = plan.pd_transport
    if pd is None:
        return []
    if pd.role == "consumer":
        return [
            "behind vllm-router: --decode URL; a conversation's turns stay on one decode, whose host tier "
            f"serves the earlier turns, with {SESSION_HEADER} and --decode-policy consistent_hash (kv_aware's "
            "--kv-aware-session-affinity-ttl-secs is soft: it moves a session to a less loaded decode)"
        ]
    return [
        "behind vllm-router: --prefill URL --policy kv_aware --pd-kv-events URL=tcp://HOST:PORT, this "
        "prefill's vllm serve started with --enable-scale-out (the router renders prompts there) and "
        '--kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:PORT"}\' (vLLM binds TCP only on every interface: firewall it; '
        "no topic: the router subscribes to none)",
        f"  vllm-router 0.1.17 indexes {ROUTER_BLOCK_SIZE}-token blocks only: with another --block-size "
        "(vLLM's CPU attention: multiples of 32) publish on ipc:// and run `kvcompose relay-events "
        "--from ipc://PATH --to tcp://HOST:PORT --engine-block-size N` beside the server",
    ]
