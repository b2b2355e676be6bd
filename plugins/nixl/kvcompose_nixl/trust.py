"""What a decode instance believes, and what a prefill instance gives away, over P/D.

vLLM's NIXL connector believes a request's ``kv_transfer_params`` whole: whoever reaches a
decode's HTTP API chooses the address it connects to and the remote blocks it reads, and a
malformed field kills its engine (an assert in the worker's ``start_load_kv``). Its side channel
hands the NIXL agent metadata (what a peer needs to read registered memory) to anyone who asks.
This module holds the checks, with no vLLM import:

- :func:`screen` checks a decode request's P/D params on the scheduler, before vLLM's code
  reads them: types, ranges, block counts against the prompt, the peer allowlist, and, with a
  deployment key, the prefill's signature. A refused set is never handed to vLLM: the request
  is computed locally, or ends with an error under ``kv_load_failure_policy: fail``
  (:class:`kvcompose_nixl.connector.NixlConnector`).
- :class:`Keyring` holds the deployment keys (from an environment variable or a file the YAML
  names, never the YAML): the first signs, every one verifies (a rotation accepts two).
  :meth:`Keyring.sign` binds a prefill's params to the engine, request, blocks, side channel,
  an expiry, and the prompt tokens the blocks hold; :meth:`Keyring.seal` encrypts and
  authenticates NIXL agent metadata (AES-GCM), so the side channel answers anyone with
  something only a key holder can load.
- :class:`Peers` is the allowlist of side channels a decode may connect to.

The threat model, and what is not protected (NIXL's data path itself), are in docs/security.md.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvcompose.api import MAX_HOST_CHARS
from kvcompose_nixl import LEASE_ANSWERS_KEY

#: The ``kv_transfer_params`` keys a kvcompose prefill adds: the digest of the prompt tokens its
#: blocks hold (with or without a key), and with a key the signature and its wall-clock end.
PROMPT_KEY = "kvcompose_prompt"
SIG_KEY = "kvcompose_sig"
SIGNED_UNTIL_KEY = "kvcompose_expires"
SIGNED_KEYS: frozenset[str] = frozenset({SIG_KEY, SIGNED_UNTIL_KEY, PROMPT_KEY})

#: The P/D fields a signature covers: every field vLLM's decode reads to connect and read, but
#: not ``do_remote_prefill`` / ``do_remote_decode`` (a proxy sets those per leg).
BOUND_KEYS: tuple[str, ...] = (
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_block_size",
    "remote_blocks_expiry_time",
    "remote_registration_generation",
    "tp_size",
    "dcp_size",
    "pp_size",
    "transfer_mode",
    LEASE_ANSWERS_KEY,
    SIGNED_UNTIL_KEY,
    PROMPT_KEY,
)

#: The shortest key accepted, in characters (``openssl rand -hex 32`` writes 64).
MIN_KEY_CHARS = 32
#: Largest values a field may hold (well beyond any real deployment, far below what breaks vLLM).
MAX_BLOCK_ID = 2**31 - 1
MAX_PARALLEL = 1024
MAX_ID_CHARS = 256
#: The most blocks one group of ``remote_block_ids`` may name (2^20 blocks of 16: 16M tokens).
MAX_BLOCKS = 1 << 20

#: Reasons a set of params is refused: the label of ``vllm:kvcompose_refused_params``.
REASONS = (
    "malformed",  # a field of the wrong type or out of range, or blocks that do not fit the token count
    "prompt",  # a prompt other than the one the prefill computed (another length, another token)
    "peer",  # a side channel the allowlist does not list
    "unsigned",  # no signature, and the YAML does not accept unsigned prefills
    "signature",  # a signature that does not verify: another key, a changed field
    "expired",  # signed longer ago than the prefill's lease
    "replayed",  # params this decode already took
    "role",  # do_remote_decode sent to a decode-only instance (it would hold its blocks for nobody)
)

_encode = msgspec.msgpack.Encoder().encode
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?$")


#: Untrusted input each engine process dropped, by kind: side-channel frames
#: (:mod:`kvcompose_nixl.side_channel`) and NIXL notifications (:mod:`kvcompose_nixl.lease`).
DROPPED: Counter[str] = Counter()
_log = logging.getLogger("kvcompose.nixl")


def drop(kind: str, detail: str) -> None:
    """Count one dropped frame or notification of ``kind``; the first of each kind is logged
    (an attacker repeating one must not flood the log)."""
    if DROPPED[kind] == 0:
        _log.warning("NIXL: dropped a %s (%s); further ones are counted, not logged", kind, detail)
    DROPPED[kind] += 1


class TrustConfigError(ValueError):
    """A key that cannot be read, or an allowlist entry that does not parse."""


class Refused(Exception):
    """A set of ``kv_transfer_params`` that the decode does not act on; ``reason`` is one of
    :data:`REASONS`, ``detail`` says which field and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------- keys


def _derive(key: bytes, purpose: bytes, size: int = 32) -> bytes:
    return hashlib.blake2b(purpose, key=key, digest_size=size).digest()


@dataclass(frozen=True)
class _Key:
    id: bytes
    mac: bytes
    seal: bytes

    @classmethod
    def of(cls, secret: bytes) -> _Key:
        material = hashlib.sha512(secret).digest() if len(secret) > 64 else secret  # BLAKE2b keys: 64 bytes at most
        return cls(
            _derive(material, b"kvcompose key id", 8),
            _derive(material, b"kvcompose pd params"),
            _derive(material, b"kvcompose nixl agent"),
        )


@dataclass(frozen=True)
class Keyring:
    """Deployment keys: the first signs and seals, each verifies and opens (two during a
    rotation: add the new key second everywhere, then first, then drop the old)."""

    keys: tuple[_Key, ...]
    source: str

    @classmethod
    def parse(cls, text: str, source: str) -> Keyring:
        """Keys separated by whitespace or commas, each at least :data:`MIN_KEY_CHARS` long."""
        secrets = [s for s in re.split(r"[\s,]+", text.strip()) if s]
        if not secrets:
            raise TrustConfigError(f"{source} holds no key")
        short = [i for i, s in enumerate(secrets) if len(s) < MIN_KEY_CHARS]
        if short:
            raise TrustConfigError(
                f"{source}: key {short[0] + 1} has fewer than {MIN_KEY_CHARS} characters; "
                "make one with `openssl rand -hex 32`"
            )
        return cls(tuple(_Key.of(s.encode()) for s in secrets), source)

    @classmethod
    def load(cls, env: str | None = None, file: str | None = None, owner: str = "nixl") -> Keyring | None:
        """The keys from the environment variable ``env`` or the file ``file`` (None: neither
        named); a named source that is missing or empty is an error, never "no key", naming the
        ``owner`` type whose option named it."""
        if env:
            text = os.environ.get(env)
            if not text:
                raise TrustConfigError(
                    f"the {owner} option key_env names ${env}, which is not set in this process's environment"
                )
            return cls.parse(text, f"${env}")
        if file:
            try:
                text = Path(file).read_text()
            except OSError as exc:
                raise TrustConfigError(f"the {owner} option key_file: cannot read {file}: {exc.strerror}") from None
            return cls.parse(text, file)
        return None

    def _key(self, key_id: bytes) -> _Key | None:
        for key in self.keys:
            if hmac.compare_digest(key.id, key_id):
                return key
        return None

    # -- P/D params

    def sign(self, params: Mapping[str, Any]) -> str:
        """The signature of ``params``' :data:`BOUND_KEYS` (the prompt through its digest,
        :data:`PROMPT_KEY`) with the first key."""
        key = self.keys[0]
        return key.id.hex() + "." + _mac(key, params).hex()

    def verify(self, params: Mapping[str, Any]) -> None:
        """Raise :class:`Refused` unless ``params`` carry a signature of one of these keys over
        their :data:`BOUND_KEYS`."""
        sig = params.get(SIG_KEY)
        if sig is None:
            raise Refused("unsigned", f"no {SIG_KEY}: the prefill instance does not sign (or a client wrote these)")
        key_hex, _, mac_hex = sig.partition(".") if isinstance(sig, str) else ("", "", "")
        try:
            key_id, mac = bytes.fromhex(key_hex), bytes.fromhex(mac_hex)
        except ValueError:
            raise Refused("signature", f"{SIG_KEY} is not <key id>.<mac> in hex") from None
        key = self._key(key_id)
        if key is None:
            raise Refused("signature", f"signed with key {key_hex[:16]!r}, which this decode does not hold")
        if not hmac.compare_digest(_mac(key, params), mac):
            raise Refused("signature", "the signature does not match these fields in this deployment")

    # -- NIXL agent metadata

    def seal(self, data: bytes) -> bytes:
        """``data`` encrypted and authenticated with the first key (AES-256-GCM)."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        key = self.keys[0]
        nonce = os.urandom(12)
        return SEALED + key.id + nonce + AESGCM(key.seal).encrypt(nonce, data, SEALED)

    def open(self, blob: bytes) -> bytes:
        """What :meth:`seal` sealed; :class:`Refused` for anything else."""
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if not is_sealed(blob):
            raise Refused("unsigned", "NIXL agent metadata that is not sealed with a deployment key")
        head = len(SEALED)
        key = self._key(blob[head : head + 8])
        if key is None:
            raise Refused("signature", "NIXL agent metadata sealed with a key this engine does not hold")
        nonce = blob[head + 8 : head + 20]
        try:
            return AESGCM(key.seal).decrypt(nonce, blob[head + 20 :], SEALED)
        except InvalidTag:
            raise Refused("signature", "sealed NIXL agent metadata that does not authenticate") from None

    def tag(self, data: bytes) -> bytes:
        """A 16-byte MAC of ``data`` with the first key (the lease protocol's messages)."""
        key = self.keys[0]
        return key.id + hashlib.blake2b(data, key=key.mac, digest_size=16, person=b"kvc-lease").digest()

    def untag(self, tagged: bytes) -> bytes | None:
        """The message of ``tagged`` (:meth:`tag` + message) if it authenticates, else None."""
        key = self._key(tagged[:8])
        if key is None or len(tagged) < 24:
            return None
        data = tagged[24:]
        good = hashlib.blake2b(data, key=key.mac, digest_size=16, person=b"kvc-lease").digest()
        return data if hmac.compare_digest(good, tagged[8:24]) else None


#: How sealed metadata starts (and its AES-GCM associated data).
SEALED = b"kvcompose-sealed-v1:"


def is_sealed(blob: bytes) -> bool:
    return isinstance(blob, bytes) and blob.startswith(SEALED)


def _bound(value: Any) -> Any:
    """A float bound in whole milliseconds: vLLM's router re-encodes the params' JSON, which can
    move a double by one ULP (``remote_blocks_expiry_time``)."""
    return round(value * 1000) if type(value) is float else value


def _mac(key: _Key, params: Mapping[str, Any]) -> bytes:
    bound = [_bound(params.get(k)) for k in BOUND_KEYS]
    return hashlib.blake2b(_encode([b"kvcompose-pd-v2", bound]), key=key.mac, digest_size=32).digest()


def prompt_digest(prompt: Sequence[int], context: Sequence[Any] = ()) -> str:
    """The digest of the prompt tokens a prefill's blocks hold and of what else their KV depends
    on (``context``: cache salt, LoRA, media; :func:`request_context`), in hex. Unkeyed: it
    tells a prompt from another, and the signature, over it, tells who computed it."""
    return hashlib.blake2b(_encode([b"kvcompose-prompt-v1", list(context), prompt]), digest_size=16).hexdigest()


def sign_params(
    params: dict[str, Any], prompt: Sequence[int], context: Sequence[Any], keys: Keyring | None, expires: int
) -> None:
    """On the prefill: bind ``params`` (vLLM's ``request_finished`` answer for a decode) to the
    prompt tokens their blocks hold, ``prompt[:remote_num_tokens]`` (:data:`PROMPT_KEY`), and with
    ``keys`` sign them, valid until ``expires`` (wall clock, whole seconds). :meth:`Policy.screen`
    is the other side."""
    held = params.get("remote_num_tokens")
    count = held if type(held) is int and 0 < held <= len(prompt) else len(prompt)
    params[PROMPT_KEY] = prompt_digest(prompt if count == len(prompt) else prompt[:count], context)
    if keys is not None:
        params[SIGNED_UNTIL_KEY] = expires
        params[SIG_KEY] = keys.sign(params)


# ---------------------------------------------------------------------------- peers


@dataclass(frozen=True)
class _Peer:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    name: str | None
    ports: tuple[int, int]

    def allows(self, host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address | None, port: int) -> bool:
        if not self.ports[0] <= port <= self.ports[1]:
            return False
        if self.network is not None:
            return address is not None and address in self.network
        return host.lower().rstrip(".") == self.name


@dataclass(frozen=True)
class Peers:
    """Side channels a decode may connect to: addresses, networks or host names, each with an
    optional port or port range (``10.0.0.0/8``, ``10.1.2.3:5600``, ``[fd00::1]:5600-5607``,
    ``prefill-0.svc:5600``). A host name matches only as written: a request naming an address is
    matched against addresses and networks, never resolved."""

    entries: tuple[_Peer, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Peers:
        return cls(tuple(_parse_peer(entry) for entry in entries))

    def allows(self, host: str, port: int) -> bool:
        address = _address(host)
        return any(p.allows(host, address, port) for p in self.entries)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _parse_peer(entry: str) -> _Peer:
    text = entry.strip()
    ports = (1, 65535)
    host = text
    if text.startswith("["):  # [v6] or [v6]:port
        end = text.find("]")
        if end < 0:
            raise TrustConfigError(f"peers: {entry!r} opens a [ without closing it")
        host, rest = text[1:end], text[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise TrustConfigError(f"peers: {entry!r}: expected :PORT after ]")
            ports = _ports(rest[1:], entry)
    elif text.count(":") == 1:  # v4, network or name with a port
        host, port_text = text.split(":")
        ports = _ports(port_text, entry)
    if not host:
        raise TrustConfigError(f"peers: {entry!r} names no host")
    try:
        return _Peer(ipaddress.ip_network(host, strict=False), None, ports)
    except ValueError:
        pass
    if not _HOSTNAME.match(host):
        raise TrustConfigError(f"peers: {entry!r} is not an address, a network (10.0.0.0/8) or a host name")
    return _Peer(None, host.lower().rstrip("."), ports)


def _ports(text: str, entry: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise TrustConfigError(f"peers: {entry!r}: the port is not a number or a range (5600-5607)") from None
    if not 1 <= lo <= hi <= 65535:
        raise TrustConfigError(f"peers: {entry!r}: ports run from 1 to 65535, low to high")
    return lo, hi


#: What a decode connects to when neither ``peers`` nor a key says more: this host only.
LOOPBACK_PEERS = Peers.parse(["127.0.0.0/8", "::1", "localhost"])


# ---------------------------------------------------------------------------- the decode's check


@dataclass(frozen=True)
class Facts:
    """What a decode knows about itself and a request, to check its params against:
    ``remote_tokens`` is how many of the prompt's tokens vLLM's decode counts as the prefill's
    (the prompt, less the tokens a Mamba or MTP model recomputes on the decode)."""

    block_size: int
    groups: int
    tp_size: int
    remote_tokens: int


#: Seconds between two purges of the params a decode took.
PURGE_S = 10.0


@dataclass
class Replays:
    """Params this decode took, by (prefill engine, prefill request), until they expire."""

    seen: dict[tuple[str, str], float] = field(default_factory=dict)
    #: When expired entries are next dropped: every :data:`PURGE_S`, so that a take stays O(1)
    #: however many requests a lease holds.
    purge_at: float = 0.0

    def take(self, engine: str, request: str, expires: float, now: float) -> None:
        if now >= self.purge_at:
            self.seen = {k: t for k, t in self.seen.items() if t >= now}
            self.purge_at = now + PURGE_S
        if self.seen.get((engine, request), -math.inf) >= now:
            raise Refused("replayed", f"prefill request {request!r} of engine {engine!r} was already read here")
        self.seen[(engine, request)] = expires


def _int(params: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise Refused("malformed", f"{key} must be a whole number from {low} to {high}, not {_show(value)}")
    return value


def text_field(params: Mapping[str, Any], key: str, limit: int, where: str = "") -> str:
    """``params[key]``: printable text of 1 to ``limit`` characters, else :class:`Refused`
    (``malformed``); ``where`` names the mapping holding it in the message (``remote_prefiller.``)."""
    value = params.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= limit or not value.isprintable():
        raise Refused(
            "malformed", f"{where}{key} must be printable text of 1 to {limit} characters, not {_show(value)}"
        )
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def block_groups(value: Any, groups: int) -> Sequence[Sequence[int]]:
    """``remote_block_ids`` as one list per KV-cache group; :class:`Refused` unless it is a list of
    ``groups`` lists (or, for one group, a flat list) of block ids. Missing (None) is no block."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise Refused("malformed", f"remote_block_ids must be a list, not {_show(value)}")
    lists = value if value and isinstance(value[0], (list, tuple)) else [value]
    if value and (len(lists) != groups or not all(isinstance(g, (list, tuple)) for g in lists)):
        raise Refused("malformed", f"remote_block_ids must hold {groups} list(s) of block ids (one per KV-cache group)")
    for group in lists:
        if len(group) > MAX_BLOCKS:
            raise Refused("malformed", f"remote_block_ids names {len(group)} blocks, more than {MAX_BLOCKS}")
        for block in group:
            if type(block) is not int or not 0 <= block <= MAX_BLOCK_ID:
                raise Refused(
                    "malformed", f"remote_block_ids holds {_show(block)}, not a block id (0 to {MAX_BLOCK_ID})"
                )
    return lists


def check_fields(params: Mapping[str, Any], facts: Facts) -> Sequence[Sequence[int]]:
    """The types and ranges of a remote prefill's params (pull mode), and that their blocks are
    exactly those of their token count; :class:`Refused` if one would make vLLM's decode assert
    or connect somewhere it cannot. Returns the remote block ids, one list per KV-cache group."""
    if params.get("do_remote_prefill") is not True:
        raise Refused("malformed", f"do_remote_prefill must be true, not {_show(params.get('do_remote_prefill'))}")
    text_field(params, "remote_engine_id", MAX_ID_CHARS)
    text_field(params, "remote_request_id", MAX_ID_CHARS)
    host = text_field(params, "remote_host", MAX_HOST_CHARS)
    if _address(host) is None and not _HOSTNAME.match(host):
        raise Refused("malformed", f"remote_host must be an address or a host name, not {_show(host)}")
    _int(params, "remote_port", 1, 65535)
    if params.get("remote_port") is None:
        raise Refused("malformed", "remote_port is missing")
    block_size = _int(params, "remote_block_size", 1, 1 << 16) or facts.block_size
    groups = block_groups(params.get("remote_block_ids"), facts.groups)
    tokens = _int(params, "remote_num_tokens", 0, MAX_BLOCKS * block_size)
    if any(groups):
        # vLLM's worker end-trims the prefill's blocks to the decode's: one block more or fewer
        # than the tokens fill shifts every position (or asserts).
        if not tokens:
            raise Refused("malformed", "remote_num_tokens must count the tokens the remote blocks hold")
        fill = -(-tokens // block_size)
        if any(len(g) > fill for g in groups) or max(len(g) for g in groups) != fill:
            raise Refused(
                "malformed",
                f"remote_block_ids names {max(len(g) for g in groups)} blocks; {tokens} tokens fill {fill}",
            )
    for key in ("tp_size", "dcp_size", "pp_size"):
        size = _int(params, key, 1, MAX_PARALLEL)
        if key == "tp_size" and size is not None and size % facts.tp_size and facts.tp_size % size:
            raise Refused("malformed", f"tp_size {size} and this decode's {facts.tp_size} do not divide")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (type(expiry) not in (int, float) or not math.isfinite(expiry)):
        raise Refused("malformed", f"remote_blocks_expiry_time must be a number, not {_show(expiry)}")
    if params.get("transfer_mode", "pull") != "pull":
        raise Refused("malformed", f"transfer_mode must be 'pull' here, not {_show(params.get('transfer_mode'))}")
    _int(params, "remote_registration_generation", 0, 2**62)
    digest = params.get(PROMPT_KEY)
    if digest is not None and not (isinstance(digest, str) and len(digest) == 32):
        raise Refused("malformed", f"{PROMPT_KEY} must be 32 hex digits, not {_show(digest)}")
    return groups


def check_prompt(params: Mapping[str, Any], facts: Facts, prompt: Sequence[int], context: Sequence[Any]) -> None:
    """:class:`Refused` (``prompt``) unless the params' blocks hold this prompt's KV: as many
    tokens as vLLM's decode will count as loaded, and, where the prefill stamped it (kvcompose
    does, with or without a key), the digest of those tokens and their context."""
    tokens = params["remote_num_tokens"]
    if tokens != facts.remote_tokens:
        raise Refused(
            "prompt",
            f"the prefill computed {tokens} tokens and this prompt loads {facts.remote_tokens}: not the same prompt",
        )
    digest = params.get(PROMPT_KEY)
    if digest is not None:
        held = prompt if tokens == len(prompt) else prompt[:tokens]
        if not hmac.compare_digest(digest, prompt_digest(held, context)):
            raise Refused("prompt", "the prompt's tokens (or salt, LoRA, media) are not those the prefill computed")


def check_push(registered: Any, computed: str | None, keyed: bool) -> None:
    """Push mode, on the prefill before it writes: :class:`Refused` unless the decode's
    registration digest (``registered``, :data:`PROMPT_KEY` of what the decode registered, the
    digest of the tokens it counts as loaded) is the digest of the tokens this prefill computed
    for the request (``computed``). A registration without a digest comes from a decode without
    kvcompose's push binding: refused under a deployment key (``keyed``: only kvcompose opens
    sealed metadata, so such a decode is a bug), written as vLLM writes it without one. The
    other side of :func:`check_prompt`, for the blocks a prefill WRITEs."""
    if registered is None:
        if keyed:
            raise Refused("prompt", f"the decode's registration carries no {PROMPT_KEY}: its prompt is not known")
        return
    if not (isinstance(registered, str) and len(registered) == 32):
        raise Refused("malformed", f"{PROMPT_KEY} must be 32 hex digits, not {_show(registered)}")
    if computed is None:
        raise Refused("prompt", "this prefill holds no digest of what it computed for the request")
    if not hmac.compare_digest(registered, computed):
        raise Refused("prompt", "the decode's prompt (or salt, LoRA, media) is not the one this prefill computed")


@dataclass
class Policy:
    """What a decode's nixl child accepts: ``keys`` (None: no key), unsigned params or not, and
    the side channels it may connect to (None: those a signature names, else loopback)."""

    keys: Keyring | None
    accept_unsigned: bool
    peers: Peers | None
    clock_skew_s: float = 10.0
    replays: Replays = field(default_factory=Replays)

    def connectable(self, host: str, port: int, signed: bool) -> bool:
        """Whether this decode may open a connection to the side channel ``host:port``."""
        if self.peers is not None:
            return self.peers.allows(host, port)
        return signed or LOOPBACK_PEERS.allows(host, port)

    def handshake_allowed(self, host: str, port: int) -> bool:
        """For the worker, whose handshakes name only side channels the scheduler let through:
        the allowlist, else with a key any (the scheduler took only signed ones), else loopback."""
        return self.connectable(host, port, self.keys is not None)

    def screen(
        self,
        params: Mapping[str, Any],
        facts: Facts,
        prompt: Sequence[int],
        context: Sequence[Any] = (),
        now: float | None = None,
    ) -> None:
        """Raise :class:`Refused` unless the decode may act on ``params`` for this prompt. The
        checks run in this order, each reason pinned by a test beside a control that passes the
        checks before it: the fields (``malformed``), the prompt against what the blocks hold
        (``prompt``), the signature (``unsigned``, ``signature``), its end (``expired``), this
        decode's earlier reads (``replayed``) and the side channel (``peer``). Params that name
        no block are checked field by field only: nothing is read and no connection opened for
        them (the connector computes the prompt locally)."""
        if not any(check_fields(params, facts)):
            return
        check_prompt(params, facts, prompt, context)
        signed = self.keys is not None and not (self.accept_unsigned and params.get(SIG_KEY) is None)
        if signed:
            self._verify(params, time.time() if now is None else now)
        if not self.connectable(params["remote_host"], params["remote_port"], signed):
            raise Refused(
                "peer",
                f"the side channel {params['remote_host']}:{params['remote_port']} is not among this decode's peers",
            )

    def _verify(self, params: Mapping[str, Any], now: float) -> None:
        assert self.keys is not None
        issuer, request = params["remote_engine_id"], params["remote_request_id"]
        verify_signed(params, self.keys, self.replays, (issuer, request), now, self.clock_skew_s)


def verify_signed(
    view: Mapping[str, Any],
    keys: Keyring,
    replays: Replays,
    read: tuple[str, str],
    now: float,
    clock_skew_s: float,
    digest: str | None = None,
) -> None:
    """Raise :class:`Refused` unless ``view`` (the fields a signature binds) is signed with
    ``keys``, for a prompt of ``digest`` when one is given, unexpired, and ``read`` (the issuer,
    its request id) not read here before: ``unsigned``, ``prompt``, ``signature``, ``expired``,
    ``replayed``, in that order. The NIXL child's params and the p2p tier's roles both pass here."""
    expires = view.get(SIGNED_UNTIL_KEY)
    if view.get(PROMPT_KEY) is None or type(expires) not in (int, float) or not math.isfinite(expires):
        raise Refused("unsigned", f"no {PROMPT_KEY} and {SIGNED_UNTIL_KEY}: no prefill of this deployment signed it")
    if digest is not None and not (isinstance(view[PROMPT_KEY], str) and hmac.compare_digest(view[PROMPT_KEY], digest)):
        raise Refused("prompt", "the prompt's tokens (or salt, LoRA, media) are not those the prefill computed")
    keys.verify(view)
    if now > expires + clock_skew_s:
        raise Refused(
            "expired",
            f"signed for reads until {now - expires:.1f} s ago; the prefill's hold on its blocks has ended "
            "(if it has not, this host's clock runs ahead of the prefill's)",
        )
    replays.take(read[0], read[1], expires + clock_skew_s, now)


def request_context(request: Any) -> tuple[Any, ...]:
    """What a request's KV depends on beside its tokens (vLLM's ``Request``): its cache salt,
    LoRA adapter and media. A signature binds them, so a prompt with another image, adapter or
    tenant salt does not read the KV computed for this one."""
    lora = getattr(request, "lora_request", None)
    media = [getattr(f, "identifier", None) for f in getattr(request, "mm_features", None) or ()]
    return (getattr(request, "cache_salt", None), getattr(lora, "lora_name", None), media)
