"""The kit as a user meets it: fresh test files outside this package, run by pytest (``pytester``)."""

from __future__ import annotations

import pytest

#: vLLM PR #43871's scenarios (NIXL + CPU offload: load first-wins, metadata merge, store-to-all,
#: HMA) written against a YAML composition with nothing but kvcompose's kit.
PD_CPU_EXAMPLE = """\
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvcompose.testing.harness import decode_request, make_request

YAML = \"\"\"
version: 1
connectors:
  - {name: pd, type: nixl, role: consumer}
  - {name: host, type: cpu-offload, options: {cpu_bytes: 16MiB}}
\"\"\"


def test_nixl_wins_the_load_and_metadata_is_merged(kvcompose_scheduler):
    sched = kvcompose_scheduler(YAML)
    req = decode_request(64)
    sched.add_request(req)
    meta = sched.schedule().kv_connector_metadata
    assert list(meta.children) == ["pd", "host"] and meta.loads_awaited == {req.request_id: (0,)}
    assert req.request_id in meta.children["pd"].reqs_to_recv
    assert not meta.children["host"].load_gpu_blocks


def test_store_to_all_then_the_cpu_tier_loads(kvcompose_worker):
    h = kvcompose_worker(YAML, block_size=32)
    first = make_request(96, block_size=32)
    h.scheduler.add_request(first)
    h.engine_step(eos=True)
    h.drain()  # the CPU tier's worker stores the blocks (on its copy thread) and acknowledges them
    assert h.scheduler.reset_prefix_cache()  # forget the device copy
    again = make_request(96, block_size=32, prompt=first.prompt_token_ids)
    tokens, is_async = h.scheduler.connector.get_num_new_matched_tokens(again, 0)
    assert tokens > 0 and is_async
    assert h.scheduler.connector.get_external_cache_hit_sources(again, tokens) == {CacheHitSource.HOST: tokens}


def test_hma_both_groups_and_no_async_save(kvcompose_scheduler):
    sched = kvcompose_scheduler(YAML, sliding_window=128)
    assert len(sched.kv_cache_config.kv_cache_groups) == 2
    assert sched.connector.request_finished_all_groups(make_request(40), ([1, 2], [1, 2])) == (False, None)
"""

#: A plugin author's package: a connector class and its kvcompose connector type.
AUTHOR_PACKAGE = """\
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

from kvcompose import hookimpl
from kvcompose.catalog import ConnectorType

ASYNC_WITH_NOTHING = {broken}


class EchoConnector(KVConnectorBase_V1):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, ASYNC_WITH_NOTHING

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


class EchoType(ConnectorType):
    name = "echo"
    summary = "a plugin author's connector"

    def vllm_config(self, child):
        return {{"kv_connector": "EchoConnector", "kv_connector_module_path": "echo_kv"}}


@hookimpl
def kvcompose_connector_types():
    return [EchoType()]
"""

AUTHOR_TEST = """\
import {module}
from kvcompose.testing.conformance import conformance

test_{module} = conformance("echo", plugin={module})
"""

PLAIN_TEST = """\
from kvcompose.plugins import get_plugins


def test_no_kit_fixture_no_test_type():
    assert "record" not in get_plugins().connector_types
"""


def test_the_kit_as_a_user_meets_it(pytester: pytest.Pytester) -> None:
    """One pytest run in a fresh process (vLLM cannot be imported twice into one process):
    the #43871 scenarios, a plugin author's passing and broken connector types, a plain test."""
    assert len(PD_CPU_EXAMPLE.splitlines()) < 40
    pytester.syspathinsert()
    pytester.makepyfile(
        test_pd_cpu=PD_CPU_EXAMPLE,
        good_kv=AUTHOR_PACKAGE.format(broken=False).replace("echo_kv", "good_kv"),
        broken_kv=AUTHOR_PACKAGE.format(broken=True).replace("echo_kv", "broken_kv"),
        test_good=AUTHOR_TEST.format(module="good_kv"),
        test_broken=AUTHOR_TEST.format(module="broken_kv"),
        test_plain=PLAIN_TEST,
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "-rs")
    out = result.stdout
    # The scenarios pass, written with nothing but the kit.
    out.fnmatch_lines(
        [
            "*test_pd_cpu.py::test_nixl_wins_the_load_and_metadata_is_merged PASSED*",
            "*test_pd_cpu.py::test_store_to_all_then_the_cpu_tier_loads PASSED*",
            "*test_pd_cpu.py::test_hma_both_groups_and_no_async_save PASSED*",
        ]
    )
    # A conforming plugin type passes every contract but the hit half of the lookup's, which it
    # cannot reach (it stores nothing) and which says so; a run without kit fixtures sees no test type.
    good = [line for line in out.lines if line.startswith("test_good.py::")]
    skipped = [line for line in good if "lookup-is-side-effect-free" in line]
    assert len(good) == 9 and all(" PASSED" in line for line in good if line not in skipped), good
    assert len(skipped) == 1 and " SKIPPED" in skipped[0], good
    out.fnmatch_lines(["*'echo' holds nothing for a prompt it saw finish: the hit half does not apply*"])
    out.fnmatch_lines(["*test_plain.py::test_no_kit_fixture_no_test_type PASSED*"])
    # The broken one fails the contracts it breaks, and says which, where, what and why.
    out.fnmatch_lines(
        [
            "*test_broken.py::test_broken_kv[[]nothing-matches-is-zero[]] FAILED*",
            "*test_broken.py::test_broken_kv[[]async-only-with-tokens[]] FAILED*",
        ]
    )
    out.fnmatch_lines(
        [
            "*connector type 'echo' (EchoConnector) breaks the contract [[]async-only-with-tokens[]]",
            "*call:     get_num_new_matched_tokens(req, 0)",
            "*expected: is_async False when there is nothing to load",
            "*got:      (0, True)",
            "*rule:     the async flag is False when the count is 0",
        ]
    )
