"""Trust (kvcompose_nixl.trust, side_channel): attacks on a decode's params and a prefill's side
channel, against vLLM's real scheduler and real ZMQ sockets; vLLM's own classes as the control."""

from __future__ import annotations

import re
import socket
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

from kvcompose.testing.harness import decode_request, make_request, prefill_request, scheduler_for, step
from kvcompose_nixl.connector import REFUSED_ATTR
from kvcompose_nixl.patches import seal_agent_metadata
from kvcompose_nixl.side_channel import listener
from kvcompose_nixl.trust import (
    DROPPED,
    PROMPT_KEY,
    SIG_KEY,
    SIGNED_UNTIL_KEY,
    Facts,
    Keyring,
    Peers,
    Policy,
    Refused,
    Replays,
    TrustConfigError,
    sign_params,
)

BLOCK_SIZE = 16
KEY = "k" * 16 + "0123456789abcdef0123456789abcdef"
OTHER_KEY = "z" * 48
OURS = "kvcompose_nixl.connector"


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``keyed(role, key=KEY, module=OURS, **extra)``: a scheduler whose nixl connector reads its
    key from ``$KVCOMPOSE_TEST_KEY`` (None: no key)."""

    def make(role: str, key: str | None = KEY, module: str | None = OURS, **extra: Any) -> Any:
        if key is not None:
            monkeypatch.setenv("KVCOMPOSE_TEST_KEY", key)
            extra["kvcompose_key_env"] = "KVCOMPOSE_TEST_KEY"
        ktc: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}
        if module is not None:
            ktc["kv_connector_module_path"] = module
        return scheduler_for(ktc, block_size=BLOCK_SIZE, num_blocks=100)

    return make


def prefilled(scheduler: Any, prompt: list[int]) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill instance returns for ``prompt``."""
    request = prefill_request(len(prompt), block_size=BLOCK_SIZE, prompt=prompt)
    scheduler.add_request(request)
    while True:
        _, eco = step(scheduler)
        for params in (o.kv_transfer_params for e in eco.values() for o in e.outputs):
            if params:
                assert params["do_remote_prefill"]
                return dict(params)


def pulled(scheduler: Any, prompt: list[int], params: dict[str, Any]) -> bool:
    """Whether the decode ``scheduler`` queues a NIXL read for ``prompt`` with ``params``. Else
    it schedules the prompt for local compute, or, for refused params under vLLM's default
    ``kv_load_failure_policy`` ``fail``, names the request to its workers to fail its load
    (:data:`~kvcompose_nixl.connector.REFUSED_ATTR`; the next test shows the end)."""
    request = make_request(len(prompt), block_size=BLOCK_SIZE, prompt=prompt, max_tokens=2, kv_transfer_params=params)
    scheduler.add_request(request)
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    read = request.request_id in meta.reqs_to_recv
    failing = request.request_id in getattr(meta, REFUSED_ATTR, {})
    if not read:  # computed here (after what the decode's own prefix cache holds), now; or failed
        assert (out.num_scheduled_tokens.get(request.request_id, 0) > 0) != failing
    return read


PROMPT_A = [5 + (i * 11) % 400 for i in range(70)]
PROMPT_B = [7 + (i * 13) % 400 for i in range(70)]


# ---------------------------------------------------------------------------- signed params


def test_a_signed_prefill_and_a_keyed_decode_pull_only_what_was_signed_for_the_prompt(keyed: Any) -> None:
    prefill, decode = keyed("kv_producer"), keyed("kv_consumer")
    params = prefilled(prefill, PROMPT_A)
    assert {SIG_KEY, SIGNED_UNTIL_KEY, PROMPT_KEY} <= params.keys() and params["remote_num_tokens"] == len(PROMPT_A)
    assert pulled(decode, PROMPT_A, dict(params))
    # The attacks of issue 51's table: A's params with prompt B; made-up blocks; a host of the
    # client's choosing; the same params again (replay).
    assert not pulled(decode, PROMPT_B, dict(params))
    assert not pulled(decode, PROMPT_A, {**params, "remote_block_ids": [[40, 41, 42, 43, 44]]})
    assert not pulled(decode, PROMPT_A, {**params, "remote_host": "10.9.9.9"})
    assert not pulled(decode, PROMPT_A, dict(params))  # already read once here
    refused = decode.connector.refused_params
    assert refused == {"prompt": 1, "signature": 2, "replayed": 1}


def test_a_keyed_decode_refuses_unsigned_and_foreign_keys_unless_told(keyed: Any) -> None:
    unsigned = prefilled(keyed("kv_producer", key=None), PROMPT_A)
    assert SIG_KEY not in unsigned
    assert not pulled(keyed("kv_consumer"), PROMPT_A, dict(unsigned))
    foreign = prefilled(keyed("kv_producer", key=OTHER_KEY), PROMPT_A)
    assert not pulled(keyed("kv_consumer"), PROMPT_A, dict(foreign))
    # accept_unsigned: a prefill that cannot sign (vLLM's own NixlConnector), on loopback.
    assert pulled(keyed("kv_consumer", kvcompose_accept_unsigned=True), PROMPT_A, dict(unsigned))
    # Rotation: a decode holding the new key and the old one takes both.
    assert pulled(keyed("kv_consumer", key=f"{OTHER_KEY},{KEY}"), PROMPT_A, dict(foreign))


def test_a_decode_without_a_key_connects_only_to_loopback_or_its_peers(keyed: Any) -> None:
    decode = keyed("kv_consumer", key=None)
    assert not pulled(decode, PROMPT_A, decode_params(PROMPT_A, remote_host="10.9.9.9"))
    assert pulled(decode, PROMPT_A, decode_params(PROMPT_A))
    listed = keyed("kv_consumer", key=None, kvcompose_peers=["10.9.0.0/16:5600-5601"])
    assert pulled(listed, PROMPT_A, decode_params(PROMPT_A, remote_host="10.9.9.9"))
    assert not pulled(listed, PROMPT_A, decode_params(PROMPT_A, remote_host="10.9.9.9", remote_port=5700))
    assert decode.connector.refused_params == {"peer": 1}


def decode_params(prompt: list[int], **fields: Any) -> dict[str, Any]:
    params = decode_request(len(prompt), block_size=BLOCK_SIZE).kv_transfer_params
    assert params is not None
    return {**params, **fields}


#: The fields issue 51 found to kill a decode engine (the first five) and more: each is dropped on
#: the scheduler, and the prompt is computed locally.
MALFORMED: dict[str, dict[str, Any]] = {
    "block ids a string": {"remote_block_ids": "0,1,2"},
    "block ids strings": {"remote_block_ids": ["0", "1"]},
    "negative block ids": {"remote_block_ids": [-1, -2]},
    "block ids past 2^62": {"remote_block_ids": [2**62 + 1]},
    "engine id a mapping": {"remote_engine_id": {"a": 1}},
    "block ids an int": {"remote_block_ids": 7},
    "more blocks than the prompt": {"remote_block_ids": list(range(50))},
    "fewer blocks than the tokens": {"remote_block_ids": [0, 1, 2]},
    "no token count": {"remote_num_tokens": None},
    "a float block id": {"remote_block_ids": [0.5]},
    "three groups for one": {"remote_block_ids": [[0], [1], [2]]},
    "port a string": {"remote_port": "5600"},
    "port out of range": {"remote_port": 70000},
    "host with a path": {"remote_host": "evil/../x"},
    "host missing": {"remote_host": None},
    "huge remote_num_tokens": {"remote_num_tokens": 10**12},
    "negative tp_size": {"tp_size": -1},
    "tp_size zero": {"tp_size": 0},
    "expiry not a number": {"remote_blocks_expiry_time": "soon"},
    "do_remote_prefill a string": {"do_remote_prefill": "yes"},
    "request id empty": {"remote_request_id": ""},
    "transfer mode push": {"transfer_mode": "push"},
}


@pytest.mark.parametrize("fields", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_params_never_reach_vllm_and_the_prompt_is_computed(keyed: Any, fields: dict[str, Any]) -> None:
    decode = keyed("kv_consumer", key=None)
    params = decode_params(PROMPT_A, **fields)
    assert not pulled(decode, PROMPT_A, params)
    assert decode.connector.refused_params == {"malformed": 1}
    assert "remote_block_ids" not in params and "remote_host" not in params
    # The next legitimate request is read as before.
    assert pulled(decode, PROMPT_B, decode_params(PROMPT_B))


@pytest.mark.parametrize("fields", [MALFORMED[k] for k in list(MALFORMED)[:5]], ids=list(MALFORMED)[:5])
def test_vllms_own_decode_hands_the_malformed_fields_to_its_worker(keyed: Any, fields: dict[str, Any]) -> None:
    """The control: vLLM's own NixlConnector queues the read with the field as sent, and its
    worker's ``start_load_kv`` then asserts (issue 51: ``EngineDeadError``)."""
    decode = keyed("kv_consumer", key=None, module=None)
    params = decode_params(PROMPT_A, **fields)
    request = make_request(70, block_size=BLOCK_SIZE, prompt=PROMPT_A, kv_transfer_params=params)
    try:
        decode.add_request(request)
    except TypeError:  # an engine id vLLM cannot hash: its scheduler raises on arrival
        assert not isinstance(params["remote_engine_id"], str)
        return
    out = decode.schedule()
    queued = out.kv_connector_metadata.reqs_to_recv[request.request_id]
    assert queued.remote is not None


@pytest.mark.parametrize("remote_block_ids", [[], [[]], None], ids=["empty-list", "empty-groups", "missing"])
def test_malformed_params_without_blocks_are_refused_too(keyed: Any, remote_block_ids: Any) -> None:
    """vLLM's scheduler reads the engine id on arrival, blocks or none: an unhashable one raised
    ``TypeError`` there. A set naming no block is checked field by field (nothing is read)."""
    decode = keyed("kv_consumer")
    params = decode_params(PROMPT_A, remote_block_ids=remote_block_ids, remote_engine_id={"a": 1})
    assert not pulled(decode, PROMPT_A, params)
    assert decode.connector.refused_params == {"malformed": 1}
    # Well-formed and naming no block: no signature asked for, computed locally as before.
    assert not pulled(decode, PROMPT_B, decode_params(PROMPT_B, remote_block_ids=remote_block_ids))
    assert decode.connector.refused_params == {"malformed": 1}


def test_client_markers_of_vllms_bookkeeping_are_dropped(keyed: Any) -> None:
    decode = keyed("kv_consumer", key=None)
    params = decode_params(PROMPT_A, _remote_blocks_processed=True)
    assert pulled(decode, PROMPT_A, params)  # vLLM would have skipped the read and computed nothing


# ---------------------------------------------------------------------------- the policy alone


def test_expired_signatures_are_refused_and_skew_is_allowed() -> None:
    keys = Keyring.parse(KEY, "test")
    params = decode_params(PROMPT_A)
    sign_params(params, PROMPT_A, (), keys, 1000)
    facts = Facts(BLOCK_SIZE, 1, 1, len(PROMPT_A))
    Policy(keys, False, None).screen(params, facts, PROMPT_A, now=1005.0)
    with pytest.raises(Refused) as refused:
        Policy(keys, False, None).screen(params, facts, PROMPT_A, now=1011.0)
    assert refused.value.reason == "expired"


def test_taken_params_are_kept_until_they_expire_and_then_dropped() -> None:
    replays = Replays()
    replays.take("e", "r1", expires=50.0, now=0.0)
    with pytest.raises(Refused, match="already read here"):
        replays.take("e", "r1", expires=50.0, now=49.0)
    replays.take("e", "r2", expires=60.0, now=49.0)
    replays.take("e", "r1", expires=100.0, now=51.0)  # r1's first use expired: a new read
    replays.take("e", "r3", expires=200.0, now=150.0)  # a purge: r1 and r2 expired
    assert set(replays.seen) == {("e", "r3")}


def test_a_signature_survives_a_json_re_encoding_that_moves_a_double_by_one_ulp() -> None:
    """vLLM's router re-encodes the prefill's params on their way to the decode; with the doubles
    bound exactly, the multi-turn benchmark's decodes refused some (``signature``)."""
    import json
    import math

    keys = Keyring.parse(KEY, "test")
    params = {**decode_params(PROMPT_A), "remote_blocks_expiry_time": 12345.678901234567}
    sign_params(params, PROMPT_A, (), keys, 2_000_000_000)
    routed = json.loads(json.dumps(params))
    routed["remote_blocks_expiry_time"] = math.nextafter(params["remote_blocks_expiry_time"], math.inf)
    keys.verify(routed)
    with pytest.raises(Refused):  # a lease moved by more than a millisecond is another lease
        keys.verify({**routed, "remote_blocks_expiry_time": params["remote_blocks_expiry_time"] + 0.01})


def test_keys_and_peers_refuse_what_does_not_parse(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    with pytest.raises(TrustConfigError, match=r"\$NOPE, which is not set"):
        Keyring.load(env="NOPE")
    with pytest.raises(TrustConfigError, match="fewer than 32 characters"):
        Keyring.parse("short", "x")
    key_file = tmp_path / "key"
    key_file.write_text(f"{KEY}\n{OTHER_KEY}\n")
    assert len(Keyring.load(file=str(key_file)).keys) == 2  # type: ignore[union-attr]
    for bad in ["10.0.0.0/8:0", "[::1", "a b", "10.0.0.1:x"]:
        with pytest.raises(TrustConfigError):
            Peers.parse([bad])
    peers = Peers.parse(["[fd00::1]:5600-5607", "prefill-0.svc", "10.0.0.0/8:5600"])
    assert peers.allows("fd00::1", 5607) and not peers.allows("fd00::1", 5608)
    assert peers.allows("prefill-0.svc", 1) and not peers.allows("prefill-1.svc", 1)
    assert peers.allows("10.2.3.4", 5600) and not peers.allows("11.2.3.4", 5600)


def test_sealed_metadata_opens_only_with_the_key() -> None:
    keys = Keyring.parse(KEY, "test")
    sealed = keys.seal(b"agent metadata")
    assert b"agent metadata" not in sealed
    assert keys.open(sealed) == b"agent metadata"
    with pytest.raises(Refused):
        Keyring.parse(OTHER_KEY, "other").open(sealed)
    with pytest.raises(Refused):
        keys.open(sealed[:-1] + bytes([sealed[-1] ^ 1]))

    class Agent:
        def __init__(self) -> None:
            self.loaded: list[bytes] = []

        def get_agent_metadata(self) -> bytes:
            return b"mine"

        def add_remote_agent(self, metadata: bytes) -> str:
            self.loaded.append(metadata)
            return "peer"

    prefill, decode, plain = Agent(), Agent(), Agent()
    seal_agent_metadata(prefill, keys, False)
    seal_agent_metadata(decode, keys, False)
    seal_agent_metadata(plain, None, False)
    published = prefill.get_agent_metadata()
    decode.add_remote_agent(published)
    assert decode.loaded == [b"mine"]
    for refuser, blob in ((plain, published), (decode, b"unsealed")):
        with pytest.raises(Refused):
            refuser.add_remote_agent(blob)


# ---------------------------------------------------------------------------- the side channel


def ask(port: int, frames: list[bytes], wait_s: float = 2.0) -> list[bytes] | None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart([b"", *frames])
        if not sock.poll(int(wait_s * 1000)):
            return None
        return sock.recv_multipart()[1:]
    finally:
        sock.close()


GOOD = msgspec.msgpack.encode((b"get_meta_msg", 0, 0))
GARBAGE: dict[str, list[bytes]] = {
    "msgpack that does not parse": [b"\xc1\x00\x00"],
    "a tuple of the wrong shape": [msgspec.msgpack.encode((b"get_meta_msg", 0))],
    "an unknown message": [msgspec.msgpack.encode((b"give me everything", 0, 0))],
    "a rank not served": [msgspec.msgpack.encode((b"get_meta_msg", 3, 9))],
    "two frames": [GOOD, GOOD],
    "an oversized frame": [b"\x00" * 100_000],
}


#: The kind each garbage frame is dropped as (ZMQ closes the connection of an oversized frame
#: before the listener reads it: nothing to count).
GARBAGE_DROPS: dict[str, dict[str, int]] = {
    "msgpack that does not parse": {"side-channel frame that does not parse": 1},
    "a tuple of the wrong shape": {"side-channel frame that does not parse": 1},
    "an unknown message": {"side-channel message of an unknown kind": 1},
    "a rank not served": {"side-channel request for a rank this engine does not serve": 1},
    "two frames": {"side-channel frame of the wrong shape": 1},
    "an oversized frame": {},
}


def serve(listen: Callable[..., None], port: int) -> tuple[threading.Thread, threading.Event]:
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=listen, args=({(0, 0): b"payload"}, ready, stop, "127.0.0.1", port), daemon=True)
    thread.start()
    assert ready.wait(5)
    return thread, stop


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_side_channel_drops_garbage_and_keeps_answering() -> None:
    port = free_port()
    thread, stop = serve(listener, port)
    try:
        for name, frames in GARBAGE.items():
            before = Counter(DROPPED)
            assert ask(port, frames, wait_s=0.3) is None, name  # no answer
            assert Counter(DROPPED) - before == GARBAGE_DROPS[name], name
            reply = ask(port, [GOOD])  # the control after each: answered
            assert reply is not None and reply[0] == b"payload", name
    finally:
        stop.set()
        thread.join(5)


def test_vllms_own_side_channel_dies_on_one_garbage_frame() -> None:
    """The control (vLLM #54757): vLLM's listener thread ends on the first malformed frame."""
    port = free_port()
    thread, stop = serve(NixlBaseConnectorScheduler._nixl_handshake_listener, port)
    try:
        ask(port, GARBAGE["msgpack that does not parse"], wait_s=0.3)
        thread.join(5)
        assert not thread.is_alive()
        assert ask(port, [GOOD], wait_s=1.0) is None
    finally:
        stop.set()


def test_the_connector_serves_its_side_channel_with_the_guarded_listener(keyed: Any) -> None:
    scheduler = keyed("kv_producer")
    # vLLM starts the thread at engine start, with the workers' metadata (the engine test runs it).
    assert scheduler.connector.connector_scheduler._nixl_handshake_listener is listener


def test_the_worker_opens_no_handshake_to_a_side_channel_off_the_list() -> None:
    """The worker's check behind the scheduler's: vLLM's handshake and the side channel's pre-wait
    both refuse before they connect."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcompose_nixl.patches import ask_patiently

    class Worker:
        def __init__(self) -> None:
            self.asked: list[tuple[str, int]] = []
            self._handshake_initiation_executor = ThreadPoolExecutor(1)

        def _nixl_handshake(self, host: str, port: int, *args: Any) -> str:
            self.asked.append((host, port))
            return "agents"

    without_key = Policy(None, False, None)
    worker = Worker()
    ask_patiently(worker, 1, without_key.handshake_allowed)
    assert worker._nixl_handshake("127.0.0.1", 5600) == "agents"
    with pytest.raises(Refused, match="10.9.9.9:5600 is not among this engine's peers"):
        worker._nixl_handshake("10.9.9.9", 5600)
    with pytest.raises(Refused):
        worker._handshake_initiation_executor.submit(worker._nixl_handshake, "10.9.9.9", 5600).result(5)
    assert worker.asked == [("127.0.0.1", 5600)]
    worker._handshake_initiation_executor.shutdown()
    keyed = Policy(Keyring.parse(KEY, "t"), False, None)
    assert keyed.handshake_allowed("10.9.9.9", 5600)  # the scheduler took only what a signature names
    listed = Policy(Keyring.parse(KEY, "t"), False, Peers.parse(["10.9.0.0/16"]))
    assert not listed.handshake_allowed("10.8.9.9", 5600)


def test_the_shipped_decode_counts_refusals_in_its_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composite takes the nixl child's refusals into ``vllm:kvcompose_refused_params``."""
    from kvcompose.examples import EXAMPLES
    from kvcompose.testing.harness import scheduler_from_yaml

    monkeypatch.setenv("KVCOMPOSE_PD_KEY", KEY)
    decode = scheduler_from_yaml(EXAMPLES / "pd-decode.yaml", block_size=BLOCK_SIZE)
    for fields in ({"remote_block_ids": "abc"}, {}):  # malformed; unsigned
        decode.add_request(
            make_request(
                70, block_size=BLOCK_SIZE, prompt=PROMPT_A, kv_transfer_params=decode_params(PROMPT_A, **fields)
            )
        )
    stats = decode.connector.get_kv_connector_stats()
    assert stats is not None
    refused = {k.rsplit(".", 1)[1]: n for k, n in stats.reduce().items() if ".pd.refused_params." in k}
    assert refused == {"malformed": 1, "unsigned": 1}
    assert decode.connector.get_kv_connector_stats() is None  # taken once


def test_check_says_where_a_named_key_is_missing_and_the_engine_says_it_at_start(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], keyed: Any
) -> None:
    from kvcompose.cli import main

    monkeypatch.delenv("PD_KEY", raising=False)
    f = tmp_path / "decode.yaml"
    f.write_text(
        "version: 1\nconnectors:\n  - name: pd\n    type: nixl\n    role: consumer\n    options:\n"
        "      key_file: /nonexistent/pd.key\n"
    )
    assert main(["check", str(f)]) == 0  # a warning: the engine's environment may hold it
    err = capsys.readouterr().err
    assert err.startswith(f"{f}:7:17: connectors[0].options.key_file: warning: the nixl option key_file: cannot read")
    assert "an engine started in this environment stops at start" in err and "Traceback" not in err
    f.write_text(f.read_text().replace("key_file: /nonexistent/pd.key", "peers: ['10.0.0.0/8:99999']"))
    assert main(["check", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}:7:15: connectors[0].options.peers[0]: peers: '10.0.0.0/8:99999': ports run from 1 to 65535" in err
    assert "Traceback" not in err
    # At engine start the connector stops with the same words.
    with pytest.raises(TrustConfigError, match=r"key_env names \$PD_KEY, which is not set"):
        scheduler_for(
            {
                "kv_connector": "NixlConnector",
                "kv_connector_module_path": OURS,
                "kv_role": "kv_consumer",
                "kv_connector_extra_config": {"kvcompose_key_env": "PD_KEY"},
            }
        )


def test_a_key_file_signs_and_verifies_like_a_key_variable(keyed: Any, tmp_path: Any) -> None:
    key_file = tmp_path / "pd.key"
    key_file.write_text(KEY + "\n")
    params = prefilled(keyed("kv_producer", key=None, kvcompose_key_file=str(key_file)), PROMPT_A)
    assert SIG_KEY in params
    assert pulled(keyed("kv_consumer"), PROMPT_A, params)  # the same key from $KVCOMPOSE_TEST_KEY


#: NIXL notifications a peer that loaded the prefill's agent can send it: vLLM's worker parses
#: them unguarded (``pull_worker.py`` ``_get_new_notifs``).
BAD_NOTIFS = {
    "not utf-8": b"\xff\xfe:1",
    "no colon": b"no-colon-here",
    "no count": b"cmpl-1:x",
    "zero readers": b"cmpl-1:0",
    "an unknown kvcompose kind": b"kvcompose:steal!:",
    "a lease question without a MAC": b"kvcompose:lease?" + msgspec.msgpack.encode((1, ["cmpl-1"])),
    "a hello with metadata in clear": b"kvcompose:hello:" + b"\x00" * 64,
}


def _fake_pair(fake_nixl: Any, producer: Any) -> tuple[Any, Any]:
    from kvcompose_nixl.testing.fake_nixl import CONSUMER

    return fake_nixl.pair(producer, CONSUMER)


def _pd_round(p: Any, d: Any) -> str:
    """One prompt prefilled on ``p``, read by ``d``, and released on ``p`` by the read's notification."""
    req = prefill_request(3 * 32, block_size=32)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (out,) = [o for e in eco.values() for o in e.outputs]
    dreq = make_request(3 * 32, block_size=32, prompt=req.prompt_token_ids, kv_transfer_params=out.kv_transfer_params)
    d.scheduler.add_request(dreq)
    d.step_until(lambda _o: dreq.request_id in (getattr(d.last_output, "finished_recving", None) or ()), "no read")
    p.step_until(lambda _o: req.request_id in (getattr(p.last_output, "finished_sending", None) or ()), "blocks kept")
    return req.request_id


@pytest.mark.parametrize("msg", BAD_NOTIFS.values(), ids=BAD_NOTIFS.keys())
def test_a_bad_notification_to_the_prefill_is_dropped_and_it_serves_on(fake_nixl: Any, msg: bytes) -> None:
    from kvcompose_nixl.testing.fake_nixl import nixl_worker

    p, d = _fake_pair(fake_nixl, {**PRODUCER_PLUGIN})
    before = sum(DROPPED.values())
    fake_nixl.deliver(nixl_worker(p).nixl_wrapper, "attacker", msg)
    p.engine_step()
    assert sum(DROPPED.values()) == before + 1
    _pd_round(p, d)


@pytest.mark.parametrize("msg", [BAD_NOTIFS[k] for k in ("not utf-8", "no colon")])
def test_vllms_own_prefill_dies_on_one_bad_notification(fake_nixl: Any, msg: bytes) -> None:
    """The control: vLLM's own NixlConnector raises in its worker's step (in an engine:
    ``EngineDeadError``, every later request fails)."""
    from kvcompose_nixl.testing.fake_nixl import PRODUCER, nixl_worker

    p, _ = _fake_pair(fake_nixl, PRODUCER)
    fake_nixl.deliver(nixl_worker(p).nixl_wrapper, "attacker", msg)
    with pytest.raises((UnicodeDecodeError, ValueError)):
        p.engine_step()


#: The nixl plugin's class as a prefill, with vLLM's settings otherwise (the fake pair's producer).
PRODUCER_PLUGIN = {
    "kv_connector": "NixlConnector",
    "kv_connector_module_path": "kvcompose_nixl.connector",
    "kv_role": "kv_producer",
    "engine_id": "prefill-engine",
}


# ---------------------------------------------------------------------------- refused under each policy

FAKE_BLOCK = 32  # the fake pair's block size (the CPU attention kernel's, which NIXL's worker checks)


def keyed_composition(role: str, port: int, top: str = "") -> str:
    return f"""version: 1
{top}connectors:
  - name: pd
    type: nixl
    role: {role}
    options: {{side_channel_host: 127.0.0.1, side_channel_port: {port}, key_env: KVCOMPOSE_TEST_KEY}}
"""


LOADS_KEY = "kvcompose:loads"  # the composite's load counters among its stats (kvcompose.vllm.loadstats)


def _served(
    d: Any, prompt: list[int], params: dict[str, Any], refused: Counter[str], prefill: Any = None
) -> tuple[Any, list[Any], bool]:
    """``prompt`` with ``params`` on the decode harness ``d``, stepped until it finished (with the
    ``prefill`` harness, which answers reads, stepped beside it); the request, its outputs, and
    whether the worker reported its load failed. Adds the nixl child's refusals (its stats) to
    ``refused``."""
    req = make_request(len(prompt), block_size=FAKE_BLOCK, prompt=prompt, max_tokens=2, kv_transfer_params=params)
    d.scheduler.add_request(req)
    outputs: list[Any] = []
    failed = False
    for _ in range(20):
        if prefill is not None:
            prefill.engine_step()
        _, eco = d.engine_step()
        failed = failed or req.request_id in d.last_output.failed_recving
        for e in eco.values():
            outputs += [o for o in e.outputs if o.request_id == req.request_id]
            stats = e.scheduler_stats.kv_connector_stats if e.scheduler_stats is not None else None
            loads = (stats or {}).get(LOADS_KEY)
            if loads:
                refused.update(loads["data"].get("refused_params", {}).get("pd", {}))
        if req.is_finished():
            return req, outputs, failed
    raise AssertionError(f"{req.request_id} did not finish: {req.status}")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_refused_request_fails_under_fail_and_is_computed_under_recompute_with_no_handshake(
    fake_nixl: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    """Issue 51: a refused set connects nowhere and reads nothing under either policy. Under
    ``load_failure: fail`` the request ends with an error, as vLLM ends a failed read (the
    worker reports the load failed, the scheduler finishes it with ``FINISHED_ERROR``); under
    ``recompute`` the prompt is computed on the decode. The composite hands the nixl child the
    engine's policy. The log names each reason once (vLLM's error carries no text: a 500)."""
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    from kvcompose.testing.harness import assert_scheduler_empty
    from kvcompose_nixl.testing.fake_nixl import nixl_worker

    monkeypatch.setenv("KVCOMPOSE_TEST_KEY", KEY)
    p, d = fake_nixl.pair(
        keyed_composition("producer", 5861),
        keyed_composition("consumer", 5862, top=f"load_failure: {policy}\n"),
        num_blocks=24,
    )
    worker = nixl_worker(d)
    handshakes: list[tuple[Any, ...]] = []
    real_handshake = worker._nixl_handshake
    monkeypatch.setattr(worker, "_nixl_handshake", lambda *a, **kw: handshakes.append(a) or real_handshake(*a, **kw))
    prompt_a, prompt_b = PROMPT_A[:64], PROMPT_B[:64]
    req = prefill_request(len(prompt_a), block_size=FAKE_BLOCK, prompt=prompt_a)
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (params,) = [o.kv_transfer_params for e in eco.values() for o in e.outputs if o.kv_transfer_params]
    assert SIG_KEY in params
    attacks = [
        (prompt_b, dict(params)),  # A's params, B's prompt
        (prompt_a, {**params, "remote_host": "10.9.9.9", "remote_port": 5600}),  # a host of the client's
        (prompt_a, {**params, "remote_block_ids": "0,1"}),  # one malformed field
        (prompt_b, {k: v for k, v in params.items() if k not in (SIG_KEY, SIGNED_UNTIL_KEY, PROMPT_KEY)}),  # unsigned
    ]
    transfers = len(worker.nixl_wrapper.called("transfer"))
    refused: Counter[str] = Counter()
    for prompt, attack in attacks:
        dreq, outputs, failed = _served(d, prompt, attack, refused)
        if policy == "fail":  # vLLM's scheduler ended it on the worker's report of a failed load
            assert failed and dreq.status == RequestStatus.FINISHED_ERROR
            assert [o.finish_reason for o in outputs] == [FinishReason.ERROR] and not dreq.output_token_ids
        else:  # computed here at once, as a local prompt: no load, nothing failed
            assert not failed and dreq.status == RequestStatus.FINISHED_LENGTH_CAPPED
            assert len(dreq.output_token_ids) == 2 and dreq.num_computed_tokens >= len(prompt)
    assert refused == {"prompt": 1, "signature": 1, "malformed": 1, "unsigned": 1}
    outcome = "the request fails (load_failure: fail)" if policy == "fail" else "computed here instead"
    told = [r.getMessage() for r in caplog.records if "kv_transfer_params refused" in r.getMessage()]
    # Once per reason and source (the second names the client's host).
    reasons = ("prompt", "signature", "malformed", "unsigned")
    assert len(told) == len(reasons)
    for message, reason in zip(told, reasons, strict=True):
        assert f"kv_transfer_params refused ({reason}), {outcome}: " in message
    (pd,) = [c for c in d.scheduler.connector.sub_connectors if hasattr(c, "refused_params")]
    assert handshakes == [] and len(worker.nixl_wrapper.called("transfer")) == transfers == 0
    assert pd.refusals.kept() == 0  # nothing left behind
    # The decode serves on: A with its own params is read from the prefill.
    dreq, outputs, failed = _served(d, prompt_a, dict(params), refused, prefill=p)
    assert dreq.status == RequestStatus.FINISHED_LENGTH_CAPPED and not failed
    assert len(worker.nixl_wrapper.called("transfer")) == 1 and handshakes == []
    assert_scheduler_empty(d.scheduler)


def test_the_plug_in_connector_alone_fails_a_refused_request_under_vllms_default_policy(
    fake_nixl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same without a composition: the nixl type's class as vLLM's only connector, vLLM's
    default ``kv_load_failure_policy`` (``fail``), no key (loopback peers only)."""
    from vllm.v1.request import RequestStatus

    from kvcompose.testing.harness import assert_scheduler_empty
    from kvcompose_nixl.testing.fake_nixl import nixl_worker

    consumer = {**PRODUCER_PLUGIN, "kv_role": "kv_consumer", "engine_id": "decode-engine"}
    p, d = fake_nixl.pair(PRODUCER_PLUGIN, consumer, num_blocks=24)
    worker = nixl_worker(d)
    handshakes: list[tuple[Any, ...]] = []
    real_handshake = worker._nixl_handshake
    monkeypatch.setattr(worker, "_nixl_handshake", lambda *a, **kw: handshakes.append(a) or real_handshake(*a, **kw))
    req = prefill_request(64, block_size=FAKE_BLOCK, prompt=PROMPT_A[:64])
    p.scheduler.add_request(req)
    _, eco = p.engine_step()
    (params,) = [o.kv_transfer_params for e in eco.values() for o in e.outputs if o.kv_transfer_params]
    ignored: Counter[str] = Counter()
    for attack in ({**params, "remote_host": "10.9.9.9"}, {**params, "remote_block_ids": [-1, -2]}):
        dreq, _, failed = _served(d, PROMPT_A[:64], attack, ignored)
        assert failed and dreq.status == RequestStatus.FINISHED_ERROR
    assert d.scheduler.connector.refused_params == {"peer": 1, "malformed": 1}
    assert handshakes == [] and not worker.nixl_wrapper.called("transfer")
    dreq, _, failed = _served(d, PROMPT_A[:64], dict(params), ignored, prefill=p)  # its own params: read
    assert dreq.status == RequestStatus.FINISHED_LENGTH_CAPPED and not failed
    assert len(worker.nixl_wrapper.called("transfer")) == 1
    assert_scheduler_empty(d.scheduler)


@pytest.mark.parametrize("module", [OURS, None], ids=["kvcompose", "vllm"])
def test_do_remote_decode_sent_to_a_decode_holds_nothing(keyed: Any, module: str | None) -> None:
    """A client that reaches a decode's API with ``do_remote_decode`` (a prefill leg's flag): vLLM's
    own decode holds the request's blocks for the lease after it finished, for a reader that never
    comes (a client can fill its KV cache so); kvcompose's decode-only instance drops the flag
    (reason ``role``) and frees them at once, having served the request."""
    decode = keyed("kv_consumer", key=None, module=module)
    request = make_request(
        64,
        block_size=BLOCK_SIZE,
        max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
    )
    decode.add_request(request)
    for _ in range(3):
        step(decode)
    assert request.is_finished()
    held = request.request_id in decode.requests
    if module is None:
        assert held and decode.kv_cache_manager.usage > 0
    else:
        assert not held and decode.kv_cache_manager.usage == 0
        assert decode.connector.refused_params == {"role": 1}


def test_the_digest_binds_the_salt_the_adapter_and_the_media() -> None:
    """The prompt's tokens alone do not make its KV: another cache salt, LoRA adapter or image than
    the prefill's is refused (``prompt``), with or without a key; the prefill's own context passes."""
    from kvcompose_nixl.trust import check_prompt

    facts = Facts(BLOCK_SIZE, 1, 1, len(PROMPT_A))
    computed = ("tenant-a", "adapter-1", ["image-hash-1"])
    params = decode_params(PROMPT_A)
    sign_params(params, PROMPT_A, computed, None, 0)
    check_prompt(params, facts, PROMPT_A, computed)
    for other in (
        ("tenant-b", "adapter-1", ["image-hash-1"]),
        ("tenant-a", None, ["image-hash-1"]),
        ("tenant-a", "adapter-1", ["image-hash-2"]),
    ):
        with pytest.raises(Refused) as refused:
            check_prompt(params, facts, PROMPT_A, other)
        assert refused.value.reason == "prompt"


def test_each_lease_message_is_dropped_by_the_check_it_names_beside_a_control(
    fake_nixl: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a key, on a prefill: a hello whose metadata loads but is not sealed is dropped by the
    seal (its sealed twin loads); a question from that loaded peer without a MAC is dropped by the
    MAC (its tagged twin is answered); a question from an agent that said no hello is dropped as
    such. Each drop is counted under its own kind, so a check that passes what it names fails here."""
    from kvcompose_nixl.lease import ANSWER, ASK, HELLO
    from kvcompose_nixl.testing.fake_nixl import FakeNixlAgent, nixl_worker

    monkeypatch.setenv("KVCOMPOSE_TEST_KEY", KEY)
    p, d = fake_nixl.pair(keyed_composition("producer", 5871), keyed_composition("consumer", 5872))
    prefill, decode = nixl_worker(p).nixl_wrapper, nixl_worker(d).nixl_wrapper
    keys = Keyring.parse(KEY, "test")
    clear = FakeNixlAgent.get_agent_metadata(decode)  # what NIXL's agent publishes, before sealing

    def dropped_after(msg: bytes, sender: str) -> Counter[str]:
        before = Counter(DROPPED)
        fake_nixl.deliver(prefill, sender, msg)
        p.engine_step()
        return Counter(DROPPED) - before

    assert dropped_after(HELLO + clear, decode.name) == {
        "NIXL lease hello that the deployment key does not open (it gets no answers)": 1
    }
    assert decode.name not in prefill.remote_agents
    assert dropped_after(HELLO + keys.seal(clear), decode.name) == {}  # the control: sealed, it loads
    assert decode.name in prefill.remote_agents
    question = msgspec.msgpack.encode((1, ["cmpl-1"]))
    assert dropped_after(ASK + question, decode.name) == {
        "NIXL lease question that the deployment key does not authenticate": 1
    }
    assert dropped_after(ASK + keys.tag(question) + question, decode.name) == {}  # the control: answered
    answers = [m for to, m in prefill.called("send_notif") if to == decode.name and m.startswith(ANSWER)]
    assert len(answers) == 1
    assert dropped_after(ASK + keys.tag(question) + question, "attacker") == {
        "NIXL lease question from an agent that said no hello": 1
    }


@pytest.mark.parametrize("placed_by", ["environment", "extra config"])
def test_the_engine_refuses_a_keyless_side_channel_beyond_loopback_in_its_own_environment(
    monkeypatch: pytest.MonkeyPatch, placed_by: str
) -> None:
    """``kvcompose check`` may have run where $VLLM_NIXL_SIDE_CHANNEL_HOST was unset: the scheduler
    half checks again before vLLM binds the side channel, and says why and what to do."""
    extra: dict[str, Any] = {}
    if placed_by == "environment":
        monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    else:
        monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
        extra["kvcompose_side_channel_host"] = "10.1.2.3"
    config = {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": OURS,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }
    where = "$VLLM_NIXL_SIDE_CHANNEL_HOST=10.1.2.3" if placed_by == "environment" else "side_channel_host 10.1.2.3"
    with pytest.raises(TrustConfigError, match=re.escape(f"the nixl child refuses to start: {where}")) as refused:
        scheduler_for(config)
    assert "name the deployment key on every nixl child" in str(refused.value)


def test_a_composition_check_passed_elsewhere_stops_at_engine_start_with_checks_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rendered where the variable is unset (loopback, accepted), started where it opens the
    side channel: the composite's own checks refuse it, located and naming the variable."""
    from kvcompose.compose import loads
    from kvcompose.errors import CompositionError
    from kvcompose.vllm.args import kv_transfer_config

    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    rendered = kv_transfer_config(loads("version: 1\nconnectors: [{name: pd, type: nixl, role: producer}]\n"))
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.1.2.3")
    with pytest.raises(CompositionError, match=re.escape("$VLLM_NIXL_SIDE_CHANNEL_HOST=10.1.2.3 (side_channel_host")):
        scheduler_for(rendered)
