"""A burst into a busy decode (marker ``engine``): issue 43's reproduction, shortened.

The burst (:data:`kvcompose_tools.bench.overload.SHORT`: a 6 s lease on both servers, a decode of 48
device blocks, 24 requests of 64 prompt tokens and 300 tokens out at once, sent the way vLLM's
disaggregated proxy sends them) goes into a pair of the shipped examples. The decode queues
requests past the lease; its heartbeats and lease questions keep their blocks on the prefill. The
examples must answer every request of the burst (vLLM's NixlConnector as shipped answers all 24
of this burst: docs/performance.md 5i; the side-by-side comparison with it is
``kvcompose bench --quick --only overload``, which runs the same burst on both), every read the
prefill saw after a lease (``Potentially invalid KV blocks``) must be one the decode refused or
never made (no read of released blocks used), and the decode must refuse no read whose blocks the
prefill never released (the examples recompute a refused read, so the count alone would not show
it).
"""

from __future__ import annotations

import pytest

from kvcompose_tools.bench.overload import SHORT, SUBJECT, SideRun, row_text, side_run
from kvcompose_tools.e2e.model import make_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SideRun]:
    model, logs = str(make_model(0)), tmp_path_factory.mktemp("overload")
    return {SUBJECT: side_run(SUBJECT, model, SHORT, logs)}


def test_the_examples_answer_every_request_of_the_burst(runs: dict[str, SideRun]) -> None:
    """As many as vLLM's own NixlConnector answers (all of them); an answer held past the lease
    and then refused would be recomputed, not failed (``load_failure: recompute``)."""
    examples = runs[SUBJECT]
    ours = examples.burst.answered  # a count, so that a failure prints it alone
    assert ours == SHORT.requests, f"the examples: {row_text(examples.figures())}; logs: {examples.logs}"


def test_every_read_after_a_lease_was_refused_by_the_decode(runs: dict[str, SideRun]) -> None:
    lines = runs[SUBJECT].lines
    assert lines.unmatched() == {}, (
        f"prefill requests whose late reads no refusal or release on the decode accounts for: "
        f"{lines.unmatched()}; logs: {runs[SUBJECT].logs}"
    )


def test_no_read_is_refused_that_the_prefill_still_held(runs: dict[str, SideRun]) -> None:
    """The examples recompute a refused read (``load_failure: recompute``), so the count above
    would not show one: a refusal must be of blocks the prefill released."""
    lines = runs[SUBJECT].lines
    assert lines.refused_while_held() == {}, (
        f"reads the decode refused while the prefill held their blocks: {lines.refused_while_held()}; "
        f"logs: {runs[SUBJECT].logs}"
    )
