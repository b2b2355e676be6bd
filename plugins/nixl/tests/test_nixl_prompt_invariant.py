"""The decode's invariant over positions (issue 60), drawn with everything a client controls.

**Invariant.** Every prompt position a decode counts as loaded holds KV that the prefill computed
for that same token at that same position. With vLLM's pull-mode NIXL worker this reads, for a
queued read of a decode prompt Q from a prefill prompt P whose blocks are R, into the decode's
uncomputed blocks L after c blocks of its own prefix cache (vLLM end-trims R to ``len(L)``):

- ``len(L) <= len(R)`` (else vLLM's worker asserts: the engine dies);
- ``len(R) - len(L) == c`` (remote block k lands in local block k: no position shifts);
- ``Q[:loaded] == P[:loaded]`` and ``loaded <= len(P)``, with ``loaded`` the tokens vLLM counts as
  the prefill's (the KV of a position depends on the tokens up to it, and P's blocks hold KV only
  for P's positions).

Hypothesis draws, together: the prompt's relation to the signed one (equal; extended, across a
block or not; cut short; one token changed at any position, the last partial block included;
another prompt of the same length), the params (the prefill's own, one field replaced or
dropped), and the decode's state (cold, or its prefix cache holding some of Q's blocks). Each
example runs vLLM's real schedulers: a prefill's, whose ``request_finished`` makes the params,
and a decode's, whose queued read (``reqs_to_recv``) is checked. The decodes: kvcompose's with
the deployment key (the shipped examples: the invariant holds for every draw), kvcompose's keyed
decode under ``accept_unsigned`` with an unkeyed prefill, and kvcompose's without a key (params
from loopback: it holds for the prefill's own params with any prompt; a client that rewrites
unauthenticated params chooses what is read, and only "no assert, no shift" holds), and vLLM's
own NixlConnector, the control, which breaks the invariant with the prefill's real params
(pinned below). A failure shrinks to a minimal example in the test output (hypothesis prints
it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st
from vllm.v1.request import RequestStatus

from kvcompose.testing.harness import make_request, model_runner_output, prefill_request, scheduler_for, step

BLOCK = 16
KEY = "p" * 16 + "0123456789abcdef0123456789abcdef"
OURS = "kvcompose_nixl.connector"
#: Room for every example's prefill blocks, held for the decode's read until the lease ends.
BLOCKS = 4000


def _scheduler(role: str, *, keyed: bool, ours: bool, accept_unsigned: bool = False) -> Any:
    extra: dict[str, Any] = {"kvcompose_key_env": "KVCOMPOSE_INVARIANT_KEY"} if keyed else {}
    if accept_unsigned:
        extra["kvcompose_accept_unsigned"] = True
    ktc: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
        "kv_load_failure_policy": "recompute",
    }
    if ours:
        ktc["kv_connector_module_path"] = OURS
    return scheduler_for(ktc, block_size=BLOCK, num_blocks=BLOCKS)


@dataclass
class Pair:
    prefill: Any
    decode: Any


DECODES = ("kvcompose keyed", "kvcompose unkeyed", "kvcompose keyed, accept_unsigned", "vllm")


@pytest.fixture(scope="module")
def pairs() -> dict[str, Pair]:
    mp = pytest.MonkeyPatch()
    mp.setenv("KVCOMPOSE_INVARIANT_KEY", KEY)
    try:
        yield {
            "kvcompose keyed": Pair(
                _scheduler("kv_producer", keyed=True, ours=True), _scheduler("kv_consumer", keyed=True, ours=True)
            ),
            "kvcompose unkeyed": Pair(
                _scheduler("kv_producer", keyed=False, ours=True), _scheduler("kv_consumer", keyed=False, ours=True)
            ),
            # A keyed decode that takes an unkeyed prefill's params (a rollout, vLLM's own prefill).
            "kvcompose keyed, accept_unsigned": Pair(
                _scheduler("kv_producer", keyed=False, ours=True),
                _scheduler("kv_consumer", keyed=True, ours=True, accept_unsigned=True),
            ),
            "vllm": Pair(
                _scheduler("kv_producer", keyed=False, ours=False), _scheduler("kv_consumer", keyed=False, ours=False)
            ),
        }
    finally:
        mp.undo()


def prefilled(prefill: Any, prompt: list[int]) -> dict[str, Any]:
    req = prefill_request(len(prompt), block_size=BLOCK, prompt=prompt)
    prefill.add_request(req)
    for _ in range(4):
        _, eco = step(prefill)
        for params in (o.kv_transfer_params for e in eco.values() for o in e.outputs):
            if params:
                return dict(params)
    raise AssertionError("the prefill returned no params")


def cache(decode: Any, tokens: list[int]) -> None:
    """Leave ``tokens``' full blocks in the decode's prefix cache (a local request, finished)."""
    if len(tokens) < BLOCK:
        return
    req = make_request(len(tokens), block_size=BLOCK, prompt=tokens, max_tokens=1)
    decode.add_request(req)
    for _ in range(4):
        step(decode, eos=True)
        if req.is_finished():
            return
    raise AssertionError("the caching request did not finish")


@dataclass
class Verdict:
    """What the decode did with one request: read queued (with the invariant's three terms) or not."""

    queued: bool
    asserts: bool = False  # len(L) > len(R): vLLM's worker asserts
    shifted: bool = False  # len(R) - len(L) != c
    foreign: bool = False  # a loaded position whose token, or KV, is not the prefill's

    @property
    def holds(self) -> bool:
        return not (self.asserts or self.shifted or self.foreign)


def judge(decode: Any, signed: list[int], prompt: list[int], params: dict[str, Any]) -> Verdict:
    req = make_request(len(prompt), block_size=BLOCK, prompt=prompt, max_tokens=2, kv_transfer_params=params)
    decode.add_request(req)
    out = decode.schedule()
    meta = out.kv_connector_metadata
    queued = getattr(meta, "reqs_to_recv", {}).get(req.request_id)
    verdict = Verdict(queued=False)
    if queued is not None and queued.remote is not None and any(queued.local_block_ids):
        (local,) = queued.local_block_ids
        (remote,) = queued.remote.block_ids
        (blocks,) = decode.kv_cache_manager.get_block_ids(req.request_id)
        cached = len(blocks) - len(local)
        loaded = len(prompt)  # vLLM's decode counts every prompt token as the prefill's
        verdict = Verdict(
            queued=True,
            asserts=len(local) > len(remote),
            shifted=len(remote) - len(local) != cached,
            foreign=loaded > len(signed) or prompt[:loaded] != signed[:loaded],
        )
    # What follows the verdict is not this test's: the request goes, its blocks with it.
    decode.update_from_output(out, model_runner_output([decode.requests[r] for r in out.num_scheduled_tokens]))
    decode.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    step(decode)
    return verdict


def tokens_of(seed: int, n: int) -> list[int]:
    return [3 + (i * 29 + seed * 7919) % 480 for i in range(n)]


RELATIONS = ("equal", "extended", "cut", "changed", "other")


Case = tuple[list[int], list[int], str, tuple[str | None, str], int]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """(signed prompt, decode prompt, their relation, (params field, change), decode's cached blocks)."""
    seed = draw(st.integers(0, 10_000))
    n = draw(st.integers(1, 6 * BLOCK))
    signed = tokens_of(seed, n)
    relation = draw(st.sampled_from(RELATIONS))
    if relation == "equal":
        prompt = list(signed)
    elif relation == "extended":
        prompt = signed + tokens_of(seed + 1, draw(st.integers(1, 3 * BLOCK)))
    elif relation == "cut" and n > 1:
        prompt = signed[: draw(st.integers(1, n - 1))]
    elif relation == "changed":
        at = draw(st.integers(0, n - 1))
        prompt = [*signed[:at], (signed[at] + 1) % 480 + 3, *signed[at + 1 :]]
    else:
        prompt = tokens_of(seed + 2, n)
    field = draw(st.sampled_from([None, None, "remote_num_tokens", "remote_block_ids", "kvcompose_prompt"]))
    change = draw(st.sampled_from(["drop", "one more", "one fewer"]))
    cached_blocks = draw(st.integers(0, len(prompt) // BLOCK))
    return signed, prompt, relation, (field, change), cached_blocks


def mutate(params: dict[str, Any], field: str | None, change: str) -> dict[str, Any]:
    """``params`` with ``field`` dropped, or one more / one fewer (a count, a block, a digest's digit)."""
    params = dict(params)
    if field is None or field not in params:
        return params
    if change == "drop":
        del params[field]
    elif field == "remote_num_tokens":
        params[field] += 1 if change == "one more" else -1
    elif field == "remote_block_ids":
        (group,) = params[field]
        params[field] = [[*group, group[-1]] if change == "one more" else list(group)[:-1]]
    else:
        params[field] = params[field][:-1] + ("0" if params[field][-1] != "0" else "1")
    return params


def run(pair: Pair, case: Case) -> Verdict:
    signed, prompt, _, (field, change), cached_blocks = case
    params = mutate(prefilled(pair.prefill, signed), field, change)
    cache(pair.decode, prompt[: cached_blocks * BLOCK])
    return judge(pair.decode, signed, prompt, params)


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("decode", ["kvcompose keyed", "kvcompose unkeyed", "kvcompose keyed, accept_unsigned"])
@SETTINGS
@given(case=cases())
def test_every_position_a_kvcompose_decode_counts_as_loaded_holds_the_prefills_kv(
    pairs: dict[str, Pair], decode: str, case: Case
) -> None:
    verdict = run(pairs[decode], case)
    field = case[3][0]
    if decode == "kvcompose keyed" or field is None:
        assert verdict.holds, verdict
    else:
        # Without a key nothing authenticates the params: a client that rewrites them (drops the
        # digest, names one block more and a count to match) chooses what is read. What holds is
        # what vLLM's worker needs: no assert, no shifted position (docs/security.md).
        assert not verdict.asserts and not verdict.shifted, verdict


@pytest.mark.parametrize("decode", ["kvcompose keyed", "kvcompose unkeyed", "kvcompose keyed, accept_unsigned"])
def test_the_prompts_own_params_are_read_whatever_the_decode_caches(pairs: dict[str, Pair], decode: str) -> None:
    """The liveness beside the invariant: a prompt with its own params is read, cold or with its
    first blocks in the decode's prefix cache (else the invariant would hold by reading nothing)."""
    for n, cached_blocks in ((5, 0), (3 * BLOCK, 0), (3 * BLOCK + 5, 2), (6 * BLOCK, 5)):
        signed = tokens_of(n * 13 + cached_blocks, n)
        verdict = run(pairs[decode], (signed, signed, "equal", (None, "drop"), cached_blocks))
        assert verdict.queued and verdict.holds, (n, cached_blocks, verdict)


#: Issue 60's table, against vLLM's own decode: P + 10 (the same number of blocks) is read from
#: slots P's prefill never wrote for those tokens; P + 40 and P + 100 make its worker assert; P + 40
#: with P's first 7 blocks cached on the decode shifts positions.
CONTROL = {
    "P + 10": (200, 10, 0, "foreign"),
    "P + 40": (200, 40, 0, "asserts"),
    "P + 100": (200, 100, 0, "asserts"),
    "P + 40, 7 blocks cached": (200, 40, 7, "foreign"),
}


@pytest.mark.parametrize("name", CONTROL)
def test_vllms_own_decode_breaks_the_invariant_with_the_prefills_real_params(pairs: dict[str, Pair], name: str) -> None:
    n, extra, cached_blocks, broken = CONTROL[name]
    signed = tokens_of(n + extra + cached_blocks, n)
    prompt = signed + tokens_of(99, extra)
    case: Case = (signed, prompt, "extended", (None, "drop"), cached_blocks)
    verdict = run(pairs["vllm"], case)
    assert verdict.queued and getattr(verdict, broken), verdict
    for ours in ("kvcompose keyed", "kvcompose unkeyed", "kvcompose keyed, accept_unsigned"):
        assert not run(pairs[ours], case).queued, ours


def test_the_same_draws_find_where_vllms_own_decode_breaks_it(pairs: dict[str, Pair]) -> None:
    """The draws reach the failing region: hypothesis finds (and shrinks) a case the control breaks."""
    control = pairs["vllm"]

    def broken(case: Case) -> bool:
        try:
            return not run(control, case).holds
        except AssertionError:  # vLLM's own scheduler asserted: the engine would die
            control.decode = _scheduler("kv_consumer", keyed=False, ours=False)
            return True

    found = find(cases(), broken, settings=settings(max_examples=150, deadline=None, derandomize=True, database=None))
    print("vLLM's own decode breaks the invariant with:", found[2:], len(found[0]), len(found[1]))
