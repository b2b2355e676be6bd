"""The ``KVConnectorBase_V1`` contract as vLLM states it, as a pytest suite for any connector type.

A plugin author runs it against their own type with one line in a test module::

    from kvcompose.testing.conformance import conformance

    test_my_type = conformance("my-type", {"some_option": 1}, role="both")

That is one test per contract (``test_my_type[lookup-is-side-effect-free]``, ...). Each builds
vLLM's real ``Scheduler`` around a one-child composition of the type and calls the child
connector the way vLLM's scheduler does. A broken contract fails with the contract, the call,
what vLLM expects and what the connector did. ``plugin=`` registers a plugin object (module)
for the test's duration, for types that are not installed through the ``kvcompose`` entry
point group.
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from kvcompose.testing import inspector

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from kvcompose.plugins import Plugins
    from kvcompose.testing.worker import WorkerHarness

CHILD = "subject"
_prompts = itertools.count(1)


class ContractViolation(AssertionError):
    """A connector broke a rule of vLLM's connector contract."""


@dataclass
class Subject:
    """The connector under test, inside vLLM's scheduler."""

    type_name: str
    scheduler: Scheduler
    #: The worker role on the same configs, for contracts that need the whole step.
    worker: WorkerHarness | None = None
    block_size: int = 16

    @property
    def connector(self) -> KVConnectorBase_V1:
        from kvcompose.vllm.connector import KVComposeConnector

        composed = self.scheduler.connector
        assert isinstance(composed, KVComposeConnector)
        return inspector.child(composed, CHILD)

    def fresh_request(self, num_tokens: int = 64) -> Request:
        """A plain request whose prompt no cache has seen (a distinct token sequence each time)."""
        from kvcompose.testing.harness import make_request

        base = next(_prompts) * 997
        return make_request(prompt=[3 + (base + i * 13) % 500 for i in range(num_tokens)], block_size=self.block_size)

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def violation(self, contract: str, call: str, expected: str, got: Any) -> ContractViolation:
        return ContractViolation(
            f"connector type {self.type_name!r} ({type(self.connector).__qualname__}) breaks the contract "
            f"[{contract}]\n  call:     {call}\n  expected: {expected}\n  got:      {got!r}"
        )


@dataclass(frozen=True)
class Contract:
    id: str
    #: vLLM's rule, in its words where it has them.
    rule: str
    check: Callable[[Subject], None]
    #: Runs whole engine steps: the scheduler and the worker role (a WorkerHarness).
    needs_worker: bool = False


def _lookup(s: Subject, req: Request, n: int = 0) -> tuple[int | None, bool]:
    return s.connector.get_num_new_matched_tokens(req, n)


def _same_lookups(s: Subject, req: Request, what: str, times: int = 3) -> tuple[int | None, bool]:
    """Look ``req`` up ``times`` times: the answers and the free device blocks must not move."""
    before = s.free_blocks()
    answers = [_lookup(s, req) for _ in range(times)]
    call = f"get_num_new_matched_tokens(<{what} {req.request_id}>, 0) {times}x"
    if len(set(answers)) != 1:
        raise s.violation("lookup-is-side-effect-free", call, "the same answer every time", answers)
    if s.free_blocks() != before:
        raise s.violation(
            "lookup-is-side-effect-free", call, f"{before} free blocks left untouched", f"{s.free_blocks()} free blocks"
        )
    return answers[0]


def lookup_is_side_effect_free(s: Subject) -> None:
    """A miss and a hit, each looked up repeatedly, change nothing; a hit looked up and then
    abandoned (the request aborted before allocation) is still there for the next request.

    The hit is a prompt the connector saw run to completion; a type that then answers 0 (it
    stores nothing, as a P/D consumer) is skipped for the hit half, with that reason.
    """
    from vllm.v1.request import RequestStatus

    from kvcompose.testing.harness import assert_scheduler_empty, make_request

    assert s.worker is not None
    miss = s.fresh_request()
    s.scheduler.add_request(miss)  # on_new_request, as vLLM calls it first
    _same_lookups(s, miss, "new prompt")
    s.scheduler.finish_requests(miss.request_id, RequestStatus.FINISHED_ABORTED)

    seen = s.fresh_request()
    s.scheduler.add_request(seen)
    for _ in range(4):
        s.worker.engine_step(eos=True)
    s.worker.drain(eos=True)
    s.scheduler.reset_prefix_cache()  # only the connector may answer for the prompt now

    def again() -> Request:
        req = make_request(prompt=seen.prompt_token_ids, block_size=s.block_size)
        s.scheduler.add_request(req)
        return req

    looked = again()
    hit = _same_lookups(s, looked, "prompt seen before")
    if not hit[0]:
        pytest.skip(f"{s.type_name!r} holds nothing for a prompt it saw finish: the hit half does not apply")
    s.scheduler.finish_requests(looked.request_id, RequestStatus.FINISHED_ABORTED)  # never allocated
    s.worker.drain(eos=True)
    try:
        assert_scheduler_empty(s.scheduler)
    except AssertionError as exc:
        raise s.violation(
            "lookup-is-side-effect-free",
            f"abort <{looked.request_id}> after looking up its hit",
            "nothing held once the looked-up request is gone",
            str(exc),
        ) from exc
    later = again()
    got = _lookup(s, later)
    if got != hit:
        raise s.violation(
            "lookup-is-side-effect-free",
            f"get_num_new_matched_tokens(<{later.request_id}, the same prompt>, 0) after an abandoned lookup",
            f"the hit still there: {hit}",
            got,
        )
    s.scheduler.finish_requests(later.request_id, RequestStatus.FINISHED_ABORTED)
    s.worker.drain(eos=True)


def nothing_matches_is_zero(s: Subject) -> None:
    req = s.fresh_request()
    s.scheduler.add_request(req)
    got = _lookup(s, req)
    if got != (0, False):
        raise s.violation(
            "nothing-matches-is-zero",
            f"get_num_new_matched_tokens(<new prompt {req.request_id}>, 0)",
            "(0, False) for a prompt no tier holds",
            got,
        )


def async_only_with_tokens(s: Subject) -> None:
    for computed in (0, 16, 48):
        req = s.fresh_request()
        s.scheduler.add_request(req)
        got = _lookup(s, req, computed)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise s.violation(
                "async-only-with-tokens",
                f"get_num_new_matched_tokens(req, {computed})",
                "a (tokens, is_async) pair",
                got,
            )
        tokens, is_async = got
        if (tokens is None or tokens == 0) and is_async:
            raise s.violation(
                "async-only-with-tokens",
                f"get_num_new_matched_tokens(req, {computed})",
                "is_async False when there is nothing to load",
                got,
            )


def zero_tokens_after_alloc(s: Subject) -> None:
    req = s.fresh_request()
    s.scheduler.add_request(req)
    _lookup(s, req)
    blocks = s.scheduler.kv_cache_manager.empty_kv_cache_blocks
    try:
        s.connector.update_state_after_alloc(req, blocks, 0)
    except Exception as exc:  # the contract is that this is tolerated
        raise s.violation(
            "zero-tokens-after-alloc",
            "update_state_after_alloc(req, <no blocks>, 0)",
            "tolerated: a composite passes 0 to every child but the loading one",
            exc,
        ) from exc


def metadata_pickles(s: Subject) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    s.scheduler.add_request(s.fresh_request())
    out = s.scheduler.schedule()  # the scheduler built this step's metadata
    meta = s.connector.build_connector_meta(out)
    call = "build_connector_meta(<scheduler output with a new request>)"
    if not isinstance(meta, KVConnectorMetadata):
        raise s.violation("metadata-pickles", call, "a KVConnectorMetadata every step", meta)
    try:
        back = pickle.loads(pickle.dumps(meta))
    except Exception as exc:
        raise s.violation(
            "metadata-pickles",
            f"pickle.dumps({call})",
            "metadata that pickles (vLLM ships it to worker processes)",
            exc,
        ) from exc
    if type(back) is not type(meta):
        raise s.violation("metadata-pickles", "pickle round trip", type(meta).__name__, type(back).__name__)


def finish_is_idempotent(s: Subject) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    req = s.fresh_request()
    s.scheduler.add_request(req)
    _lookup(s, req)
    s.connector.update_state_after_alloc(req, s.scheduler.kv_cache_manager.empty_kv_cache_blocks, 0)
    hma = isinstance(s.connector, SupportsHMA)
    call = "request_finished_all_groups(req, ([],))" if hma else "request_finished(req, [])"

    def finish() -> Any:
        if hma:
            return s.connector.request_finished_all_groups(req, ([],))  # type: ignore[attr-defined]
        return s.connector.request_finished(req, [])

    answers = []
    for _ in range(2):
        try:
            answers.append(finish())
        except Exception as exc:
            raise s.violation(
                "finish-is-idempotent",
                f"{call}, called {len(answers) + 1}x",
                "a second call for the same request is harmless",
                exc,
            ) from exc
    for a in answers:
        if not (
            isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], bool) and (a[1] is None or isinstance(a[1], dict))
        ):
            raise s.violation("finish-is-idempotent", call, "(delay_free: bool, kv_transfer_params: dict | None)", a)
    if answers[0][0] is False and answers[1][0] is True:
        raise s.violation(
            "finish-is-idempotent",
            f"{call}, twice",
            "no delayed free on the repeat when the first call freed at once",
            answers,
        )


def empty_output_is_tolerated(s: Subject) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    try:
        s.connector.update_connector_output(KVConnectorOutput())
        list(s.connector.take_events())
    except Exception as exc:
        raise s.violation(
            "empty-output-is-tolerated",
            "update_connector_output(KVConnectorOutput()); take_events()",
            "a step with no KV results is a no-op",
            exc,
        ) from exc


def plain_request_runs_to_completion(s: Subject) -> None:
    from kvcompose.testing.harness import assert_scheduler_empty

    assert s.worker is not None
    req = s.fresh_request()
    s.scheduler.add_request(req)
    # As vLLM's engine loop: prefill, sample EOS, step on while the worker ends its async saves.
    for _ in range(4):
        s.worker.engine_step(eos=True)
    try:
        s.worker.drain(eos=True)
        assert_scheduler_empty(s.scheduler)
    except AssertionError as exc:
        raise s.violation(
            "plain-request-runs-to-completion",
            "engine steps (scheduler + worker) until EOS",
            "no request and no block held once a plain request finished",
            str(exc),
        ) from exc


def class_answers_are_valid(s: Subject) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cls = type(s.connector)
    layout = cls.get_required_kvcache_layout(s.connector._vllm_config)
    valid = {m.name for m in KVCacheLayout} | {"NHD", "HND"}
    if layout is not None and layout not in valid:
        raise s.violation(
            "class-answers-are-valid",
            f"{cls.__name__}.get_required_kvcache_layout(config)",
            f"None or one of {sorted(valid)}",
            layout,
        )
    stats = cls.build_kv_connector_stats()
    if stats is not None and not isinstance(stats, KVConnectorStats):
        raise s.violation(
            "class-answers-are-valid", f"{cls.__name__}.build_kv_connector_stats()", "None or a KVConnectorStats", stats
        )


CONTRACTS: tuple[Contract, ...] = (
    Contract(
        "lookup-is-side-effect-free",
        "get_num_new_matched_tokens may be called repeatedly and should be side-effect free",
        lookup_is_side_effect_free,
        needs_worker=True,
    ),
    Contract("nothing-matches-is-zero", "(0, False) when no external token matches", nothing_matches_is_zero),
    Contract("async-only-with-tokens", "the async flag is False when the count is 0", async_only_with_tokens),
    Contract(
        "zero-tokens-after-alloc",
        "update_state_after_alloc decides on num_external_tokens; 0 is tolerated",
        zero_tokens_after_alloc,
    ),
    Contract(
        "metadata-pickles", "build_connector_meta returns KVConnectorMetadata that crosses processes", metadata_pickles
    ),
    Contract(
        "finish-is-idempotent",
        "request_finished[_all_groups] returns (bool, dict|None); a repeat is harmless",
        finish_is_idempotent,
    ),
    Contract(
        "empty-output-is-tolerated",
        "update_connector_output/take_events on an empty step are no-ops",
        empty_output_is_tolerated,
    ),
    Contract(
        "plain-request-runs-to-completion",
        "a plain request leaves no request or block behind",
        plain_request_runs_to_completion,
        needs_worker=True,
    ),
    Contract("class-answers-are-valid", "class-level answers are None or valid values", class_answers_are_valid),
)


def composition(type_name: str, options: dict[str, Any] | None = None, role: str | None = None) -> str:
    """The one-child composition the suite builds (YAML)."""
    import json

    child: dict[str, Any] = {"name": CHILD, "type": type_name}
    if role is not None:
        child["role"] = role
    if options:
        child["options"] = options
    return f"version: 1\nconnectors:\n  - {json.dumps(child)}\n"  # JSON is YAML


def conformance(
    type_name: str,
    options: dict[str, Any] | None = None,
    *,
    role: str | None = None,
    plugin: object | None = None,
    num_blocks: int = 64,
    contracts: tuple[Contract, ...] = CONTRACTS,
) -> Callable[..., None]:
    """A pytest test function, parametrised over ``contracts``, for one connector type.

    Assign it to a ``test_*`` name in a test module. ``options`` and ``role`` configure the
    child as a composition file would.
    """
    text = composition(type_name, options, role)

    @pytest.mark.parametrize("contract", contracts, ids=[c.id for c in contracts])
    def test_conformance(contract: Contract, kvcompose_plugins: Plugins) -> None:
        from kvcompose.testing.harness import scheduler_from_yaml
        from kvcompose.testing.worker import WorkerHarness

        registered = plugin is not None and not kvcompose_plugins.pm.is_registered(plugin)
        if registered:
            kvcompose_plugins.register(plugin)
        worker = None
        try:
            if contract.needs_worker:
                # vLLM's CPU attention backend (and so the NIXL worker) needs blocks of a multiple of 32 tokens.
                worker = WorkerHarness.from_yaml(text, plugins=kvcompose_plugins, block_size=32, num_blocks=num_blocks)
                subject = Subject(type_name, worker.scheduler, worker, block_size=32)
            else:
                subject = Subject(
                    type_name, scheduler_from_yaml(text, plugins=kvcompose_plugins, num_blocks=num_blocks)
                )
            try:
                contract.check(subject)
            except ContractViolation as exc:
                pytest.fail(f"{exc}\n  rule:     {contract.rule}", pytrace=False)
        finally:
            if worker is not None:
                worker.shutdown()
            if registered:
                kvcompose_plugins.unregister(plugin)

    test_conformance.__doc__ = f"Connector type {type_name!r} keeps vLLM's connector contract."
    return test_conformance
