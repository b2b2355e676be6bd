"""The p2p tier's role keys are client input: what vLLM's tier believes, and what the composition's
class (``kvcompose_cpu_offload.p2p``) refuses, each attack pinned by its reason beside a control
that passes the checks before it."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from vllm.v1.kv_offload.tiering.p2p import manager as vllm_p2p

from kvcompose.api import P2P_DECODER, P2P_PREFILLER, P2P_SOURCE
from kvcompose_cpu_offload.p2p import decoder_params, screen, seal_handshake
from kvcompose_nixl.trust import Keyring, Refused, Replays, prompt_digest

KEY = "k" * 64
OTHER_KEY = "o" * 64
PROMPT = list(range(3, 403))
DIGEST = prompt_digest(PROMPT)
NOW = 1_000_000.0


def keys(secret: str = KEY) -> Keyring:
    return Keyring.parse(secret, "test")


def role(host: str = "127.0.0.1", port: int = 5711, kv_request_id: str = "kvcompose-p2p-1") -> dict[str, Any]:
    return {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": port}


def signed(**kw: Any) -> dict[str, Any]:
    """What a keyed prefill answers for its decode (the control of the keyed attacks)."""
    return decoder_params(None, role(**kw), DIGEST, keys(), NOW)


def reason(params: dict[str, Any], keyring: Keyring | None = None, digest: str = DIGEST, **kw: Any) -> str | None:
    try:
        screen(params, digest, keyring, kw.pop("replays", Replays()), kw.pop("now", NOW))
    except Refused as refused:
        return refused.reason
    return None


# -- vLLM's tier alone


def test_vllms_tier_believes_a_client_chosen_peer() -> None:
    source = vllm_p2p._parse_source({P2P_PREFILLER: role(host="10.9.9.9", port=22)})
    assert source is not None and "10.9.9.9" in str(source)


@pytest.mark.parametrize("bad", [5, "x", ["kv_request_id"]])
def test_vllms_tier_raises_on_a_role_that_is_not_a_mapping(bad: Any) -> None:
    """In the engine this runs in the scheduler (``_annotate_req_context`` from ``on_new_request``)."""
    with pytest.raises(AttributeError):
        vllm_p2p._parse_source({P2P_PREFILLER: bad})


# -- malformed roles, with or without a key


@pytest.mark.parametrize(
    "params",
    [
        {P2P_PREFILLER: 5},
        {P2P_PREFILLER: "x"},
        {P2P_PREFILLER: {**role(), "remote_port": "5711"}},
        {P2P_PREFILLER: {**role(), "remote_port": 70000}},
        {P2P_PREFILLER: {**role(), "remote_port": True}},
        {P2P_PREFILLER: {**role(), "kv_request_id": ""}},
        {P2P_PREFILLER: {**role(), "kv_request_id": "x" * 257}},
        {P2P_PREFILLER: {**role(), "remote_host": "a\nb"}},
        {P2P_PREFILLER: {**role(), "extra": 1}},
        {P2P_PREFILLER: {"kv_request_id": "a"}},
        {P2P_DECODER: {"kv_request_id": 7}},
        {P2P_PREFILLER: role(), P2P_SOURCE: role()},
        {P2P_PREFILLER: role(), P2P_DECODER: {"kv_request_id": "a"}},
    ],
)
def test_a_malformed_role_is_refused(params: dict[str, Any]) -> None:
    assert reason(params) == "malformed"
    assert reason(params, keys()) == "malformed"


def test_controls_well_formed_roles_pass_without_a_key() -> None:
    assert reason({P2P_PREFILLER: role()}) is None
    assert reason({P2P_SOURCE: role()}) is None
    assert reason({P2P_DECODER: {"kv_request_id": "a"}, P2P_SOURCE: role()}) is None


# -- peers


@pytest.mark.parametrize("name", [P2P_PREFILLER, P2P_SOURCE])
def test_without_a_key_a_role_naming_a_peer_beyond_loopback_is_refused(name: str) -> None:
    assert reason({name: role()}) is None  # control: loopback
    assert reason({name: role(host="10.9.9.9")}) == "peer"


def test_with_a_key_an_unsigned_source_beyond_loopback_is_refused() -> None:
    assert reason({P2P_SOURCE: role()}, keys()) is None
    assert reason({P2P_SOURCE: role(host="10.9.9.9")}, keys()) == "peer"


# -- with a key: the prefill's signature binds the role, its end and the prompt


def test_with_a_key_a_client_written_remote_decoder_is_refused() -> None:
    assert reason({P2P_DECODER: {"kv_request_id": "a"}}) is None  # control: no key, as vLLM
    assert reason({P2P_DECODER: {"kv_request_id": "a"}}, keys()) == "role"


def test_control_the_prefills_signed_answer_passes_even_for_a_peer_beyond_loopback() -> None:
    assert reason(signed(), keys()) is None
    assert reason(signed(host="10.1.2.3"), keys()) is None


def test_an_unsigned_prefiller_is_refused_with_a_key() -> None:
    assert reason({P2P_PREFILLER: role()}, keys()) == "unsigned"


def test_params_signed_for_another_prompt_are_refused() -> None:
    assert reason(signed(), keys(), digest=prompt_digest([*PROMPT, 7])) == "prompt"
    assert reason(signed(), keys(), digest=prompt_digest(PROMPT[:-1])) == "prompt"


@pytest.mark.parametrize(
    ("field", "value"), [("remote_host", "10.9.9.9"), ("remote_port", 22), ("kv_request_id", "kvcompose-p2p-2")]
)
def test_a_field_changed_after_signing_is_refused(field: str, value: Any) -> None:
    params = signed()
    params[P2P_PREFILLER] = {**params[P2P_PREFILLER], field: value}
    assert reason(params, keys()) == "signature"


def test_a_role_signed_with_another_key_is_refused() -> None:
    assert reason(signed(), keys(OTHER_KEY)) == "signature"
    assert reason(signed(), Keyring.parse(f"{OTHER_KEY},{KEY}", "rotation")) is None  # control: the key held


def test_a_signature_past_its_end_is_refused() -> None:
    assert reason(signed(), keys(), now=NOW + 60) is None
    assert reason(signed(), keys(), now=NOW + 60 + 10.5) == "expired"


def test_a_signed_role_is_taken_once() -> None:
    replays = Replays()
    assert reason(signed(), keys(), replays=replays) is None
    assert reason(signed(), keys(), replays=replays) == "replayed"
    assert reason(signed(kv_request_id="kvcompose-p2p-2"), keys(), replays=replays) is None


def test_a_nixl_signature_does_not_pass_for_a_p2p_role() -> None:
    """The signature binds ``transfer_mode: p2p``: NIXL params signed with the same key, holding
    the same host, port and request id, are not a p2p role's signature."""
    from kvcompose_nixl.trust import PROMPT_KEY, SIG_KEY, SIGNED_UNTIL_KEY

    nixl = {"remote_request_id": "kvcompose-p2p-1", "remote_host": "127.0.0.1", "remote_port": 5711}
    nixl |= {PROMPT_KEY: DIGEST, SIGNED_UNTIL_KEY: int(NOW + 60), "transfer_mode": "pull"}
    sig = keys().sign(nixl)
    forged = {P2P_PREFILLER: role(), PROMPT_KEY: DIGEST, SIGNED_UNTIL_KEY: int(NOW + 60), SIG_KEY: sig}
    assert reason(forged, keys()) == "signature"


def test_a_named_key_that_is_missing_stops_the_p2p_class_naming_its_option(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvcompose_nixl.trust import TrustConfigError

    monkeypatch.delenv("KVC_P2P_KEY_UNSET", raising=False)
    with pytest.raises(TrustConfigError, match=r"the native-offload option key_env names \$KVC_P2P_KEY_UNSET"):
        Keyring.load("KVC_P2P_KEY_UNSET", None, owner="native-offload")


# -- the tier's connect handshake: sealed with the deployment key


class Transport:
    """vLLM's ``NixlTransport`` over 4 blocks of 1 KiB of this process's memory (a real NIXL agent)."""

    def __init__(self, name: str, sealed_with: Keyring | None) -> None:
        from vllm.v1.kv_offload.tiering.p2p.data import NixlTransport

        self.memory = bytearray(4 * 1024)
        self.nixl = NixlTransport(f"{name}-{id(self)}", memoryview(self.memory).cast("B", (4, 1024)))
        if sealed_with is not None:
            seal_handshake(self.nixl, sealed_with)

    def connect(self, **changed: Any) -> dict[str, Any]:
        """The ``ConnectMsg`` vLLM's session sends from this transport (``session.py`` ``_send_connect``)."""
        from vllm.v1.kv_offload.tiering.p2p.session.protocol import TYPE_KEY, ConnectMsg

        t = self.nixl
        msg = {
            TYPE_KEY: ConnectMsg.TYPE,
            ConnectMsg.PEER_ID: "peer",
            ConnectMsg.AGENT_METADATA: t.get_agent_metadata(),
            ConnectMsg.BASE_ADDR: t.base_addr,
            ConnectMsg.NUM_BLOCKS: t.num_blocks,
            ConnectMsg.BLOCK_LEN: t.block_len,
            ConnectMsg.CONFIG_FINGERPRINT: t.config_fingerprint,
            ConnectMsg.HASH_SEED: "seed",
        }
        return {**msg, **{getattr(ConnectMsg, k.upper()): v for k, v in changed.items()}}


def rejected(receiver: Transport, msg: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str | None:
    """What vLLM's own session says when ``receiver`` takes ``msg`` (None: it took it)."""
    from vllm.v1.kv_offload.tiering.p2p.session.session import P2PSession

    caplog.clear()
    with caplog.at_level(logging.ERROR):
        P2PSession("peer", "me", receiver.nixl, receiver.nixl.block_len, "seed")._on_connect(msg)
    said = [r.getMessage() for r in caplog.records if "rejecting peer connect" in r.getMessage()]
    return said[0] if said else None


def test_a_sealed_handshake_opens_with_the_key_and_nothing_else_does(caplog: pytest.LogCaptureFixture) -> None:
    """The receiver's class seals; vLLM's session calls its ``add_remote_peer``: a peer with the key
    is loaded (the control); a peer without the key, with another key, or a sealed metadata moved to
    another memory layout is rejected by vLLM's session for the reason the class names."""
    receiver = Transport("receiver", keys())
    assert rejected(receiver, Transport("keyed", keys()).connect(), caplog) is None
    assert rejected(Transport("plain", None), Transport("plain", None).connect(), caplog) is None  # vLLM's, unkeyed
    cases = [
        (Transport("vllm", None).connect(), "refused (unsigned)"),
        (Transport("other", keys(OTHER_KEY)).connect(), "refused (signature)"),
        (Transport("keyed", keys()).connect(base_addr=4096), "refused (layout)"),
        (Transport("keyed", keys()).connect(agent_metadata=keys().seal(b"x")), "not a p2p handshake"),
    ]
    for msg, says in cases:
        said = rejected(receiver, msg, caplog)
        assert said is not None and says in said, said


@pytest.mark.parametrize("peer_key", [KEY, OTHER_KEY])
def test_two_keyed_schedulers_handshake_only_with_one_key(
    peer_key: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's scheduler twice, each with a keyed p2p tier: a request on A naming B as its source
    makes A's tier connect to B. With one key both sides load the other's sealed metadata and B
    answers A's lookup; with two keys (the control's attacker) vLLM's sessions reject the connect
    for the reason the class names, and A's request is computed there."""
    from kvcompose.testing.harness import make_request, scheduler_from_yaml, step
    from kvcompose_tools.e2e.ports import free_ports

    a_port, b_port = free_ports(2)
    monkeypatch.setenv("KVC_A_KEY", KEY)
    monkeypatch.setenv("KVC_B_KEY", peer_key)

    def yaml(port: int, env: str) -> str:
        return (
            "version: 1\nconnectors:\n  - name: host\n    type: native-offload\n    options:\n"
            f"      cpu_bytes: 4MiB\n      key_env: {env}\n"
            f"      tiers: [{{type: p2p, host: 127.0.0.1, port: {port}}}]\n"
        )

    a = scheduler_from_yaml(yaml(a_port, "KVC_A_KEY"), num_blocks=64, block_size=16)
    b = scheduler_from_yaml(yaml(b_port, "KVC_B_KEY"), num_blocks=64, block_size=16)
    try:
        source = {"kv_request_id": "kvcompose-p2p-1", "remote_host": "127.0.0.1", "remote_port": b_port}
        request = make_request(num_tokens=80, kv_transfer_params={P2P_SOURCE: source})
        with caplog.at_level(logging.INFO):
            a.add_request(request)
            deadline = time.monotonic() + 60
            while request.num_computed_tokens == 0 and time.monotonic() < deadline:
                out, _ = step(a)
                step(b)
                if request.request_id in out.num_scheduled_tokens:
                    break
                time.sleep(0.02)
        assert request.request_id in out.num_scheduled_tokens, "A's request never ran"
        said = [r.getMessage() for r in caplog.records if "rejecting peer connect" in r.getMessage()]
        down = [r.getMessage() for r in caplog.records if r.getMessage().endswith(" down")]
        if peer_key == KEY:
            assert said == [] and down == [], (said, down)
        else:
            assert said and all("refused (signature)" in s for s in said), said
    finally:
        for scheduler in (a, b):
            scheduler.connector.shutdown()
