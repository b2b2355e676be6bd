"""Benchmark 5m: a third decode joins the router mid-run, and what the conversations it takes cost (issue 62).

vllm-router 0.1.17 in P/D mode adds no worker over HTTP; it adds one that registers on its
discovery socket (:mod:`kvcompose.discovery`). A 2P2D fleet of the native examples
under ``consistent_hash`` starts with a third decode on standby (its engine up, unknown to the
router), one side per pool of :data:`kvcompose_tools.e2e.fleet.POOLS`.
:func:`~kvcompose_tools.e2e.fleet.join_scenario` sends each conversation a few turns, one at a
time, registers the third decode, and goes on until every conversation has had two more turns.
The router's hash ring now has three decodes, so some conversations land on the new one.

Per conversation that moved (its first turn after the join answered by the new decode): the
prompt tokens the prefill and the new decode computed, against what a live instance held (the
previous turn's prompt in whole blocks): the figures of :mod:`kvcompose_tools.bench.fleet_kill`.
The target is none recomputed. Every turn's answer is checked against one engine's.
"""

from __future__ import annotations

from kvcompose_tools.bench.fleet_kill import runner

run = runner("join")
