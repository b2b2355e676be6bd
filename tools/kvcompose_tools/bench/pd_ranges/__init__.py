"""Benchmark 5c: range loads on a P/D decode instance, multi-turn conversations, real engines.

A decode instance composed of ``host`` (the cpu-offload host-memory prefix tier) and ``pd``
(NIXL from the prefill instance) serves a conversation's next turn in one of three ways
(:data:`COMPOSITIONS`):

* ``pd-first``: ``[pd, host]``, ``load: first-wins``: NIXL pulls the whole prompt every turn;
* ``host-first``: ``[host, pd]``, ``load: first-wins``: host loads the prefix it holds and the
  decode instance computes the rest of the prompt itself (NIXL only when host has nothing);
* ``ranges``: ``[host, pd]``, ``load: ranges``: host loads its prefix, NIXL pulls the rest.

The workload (:func:`make_workload`): :data:`CONVERSATIONS` conversations of :data:`TURNS` turns.
A turn's prompt is the previous turn's prompt, the previous answer (the decode's output token
ids, :data:`ANSWER_TOKENS` of them) and a new user message of a seeded length in
:data:`MESSAGE_TOKENS`. Turns go round-robin over the conversations (turn 1 of every
conversation, then turn 2, ...). Each request goes the proxy way: prefill on the prefill engine
(``do_remote_decode``, one token), then decode with the prefill's ``kv_transfer_params``.

The decode engine's own (device) prefix cache is dropped before every decode request
(``reset_prefix_cache``; the connectors keep what they hold). Otherwise it would hold the
conversation and the host tier would never be asked; a small device cache (``num_gpu_blocks``)
would also push conversations out, but how much of a prefix survives there then depends on the
LRU order and on the mixed lengths, so each composition would get a different, partial share
of its prefix from the device cache, and under ``pd-first`` the device hits would cut the NIXL
pull as well. With the cache dropped, every prompt's prefix can only come from the connectors:
the three compositions differ in exactly the split being measured. The host tier's
``cpu_bytes`` (:data:`CPU_BYTES`) holds every conversation (checked before the run).

One prefill engine (``examples/pd-prefill.yaml``) and one decode engine per composition are up
at once (four engines, 1 GiB of KV each), and the workload goes in lockstep
(:func:`serve_lockstep`): each request is sent to every decode engine back to back, the first
one rotating, so the compositions share the machine's moments. The first composition served
makes the prompts (its answers go into the next turns' prompts); every other composition and
pass sends the very same prompts, and every answer must equal the first one (seeded model,
greedy decoding): a difference is reported as a failure. The engines stay up between passes, so
a second pass meets host tiers that already hold every conversation (the same conversations
asked again): its figures are printed per pass, and the totals hold both.

Figures per composition, from the decode engine's counters around each request
(:func:`kvcompose_tools.e2e.flow.decode_request`): NIXL bytes, tokens each child loaded, prompt tokens
the decode engine computed, and the decode engine's TTFT (arrival to first token: the loads,
any local prefill, the first step; the prefill instance's time is the same for all three and
is left out).

Those TTFTs still come from different engine processes (a sequential design, one decode engine
restarted per composition, showed the machine's drift as 3.8 ms between two compositions doing
identical work). Every request also has a twin (:func:`twin_prompt`): a prompt of the same length
that no tier has seen, sent to the same decode engine right before or after it (the order flips
every request), which every composition pulls whole over NIXL. A composition's TTFT / its twins'
TTFT is an interleaved ratio inside one engine (``pd-first``'s is the control: its requests and
twins do the same work), and ``ranges``' against another's cancels what is left of the drift. Twins
enter no
other figure; their answers are checked like the requests'.

Targets, each on the ratio of ``ranges`` to another composition:

* NIXL bytes, ``ranges / pd-first <= 1 - host fraction``. The host fraction is counted in what
  NIXL moves, whole blocks: host-loaded blocks / the prompts' blocks (the partial last block
  included, which NIXL pulls whole). The same fraction in tokens (host-loaded tokens / prompt
  tokens) is slightly larger, since every prompt's partial last block costs NIXL a whole block
  under both compositions; ``1 - that`` would sit below what even an exact split can reach.
* host-loaded tokens, ``ranges / host-first >= 1``: host loads the whole prefix it holds, as it
  does when it alone loads (without this, loading nothing from host would meet the NIXL target);
* decode-computed prompt tokens: at most one block (:data:`BLOCK_SIZE` tokens) per request under
  ``ranges`` (shown as the largest per request, over one block);
* TTFT median: ``ranges`` at most the better (lower median) of the other two (raw medians;
  the twin-normalised ratios are shown beside them, and judged by no target).

The engines need ``/tmp/kvcompose-engines.lock`` (taken as in :mod:`kvcompose_tools.bench.pd_ttft`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcompose_tools.bench.pd_ranges.compositions import CPU_BYTES
from kvcompose_tools.bench.pd_ranges.engines import measure
from kvcompose_tools.bench.pd_ranges.figures import build_result
from kvcompose_tools.bench.pd_ranges.workload import MESSAGE_TOKENS, SEED, Workload, make_workload
from kvcompose_tools.bench.pd_ttft import engine_lock
from kvcompose_tools.bench.report import Result
from kvcompose_tools.e2e.spec import BLOCK_SIZE

#: Passes over the compositions: the first in :data:`COMPOSITIONS` order, the second reversed.
PASSES = 2


def run(
    quick: bool = False,
    passes: int | None = None,
    echo: Callable[[str], None] = print,
    work: Path | None = None,
    workload: Workload | None = None,
) -> Result:
    """The three decode compositions over one multi-turn workload; ratios of ``ranges`` to each."""
    from kvcompose_tools.e2e.model import kv_bytes_per_token, make_model

    n = passes or (1 if quick else PASSES)
    w = workload or make_workload()
    logs = Path(work or tempfile.mkdtemp(prefix="kvcompose-bench-ranges-"))
    model = make_model(0)
    block_bytes = BLOCK_SIZE * kv_bytes_per_token(model)
    if w.kv_blocks() * block_bytes > CPU_BYTES:
        raise ValueError(f"the workload needs {w.kv_blocks()} blocks in the host tier, over cpu_bytes {CPU_BYTES}")
    with engine_lock(echo=echo):
        served, reference, starts = measure(w, n, str(model), logs, echo)
    lengths = [len(m) for conv in w.messages for m in conv]
    return build_result(
        served,
        reference,
        n,
        quick,
        {
            "conversations": w.conversations,
            "turns": w.turns,
            "message_tokens": list(MESSAGE_TOKENS),
            "message_tokens_drawn": lengths,
            "answer_tokens": w.answer_tokens,
            "seed": SEED,
            "requests_per_run": w.conversations * w.turns,
            "lockstep": True,
            "block_bytes": block_bytes,
            "cpu_bytes": CPU_BYTES,
            "decode_engine_start_s": starts,
            "engine_logs": str(logs),
        },
        [
            f"workload: {w.conversations} conversations x {w.turns} turns, round-robin; a turn's prompt = the "
            f"previous prompt + its answer ({w.answer_tokens} tokens, greedy) + a new message of "
            f"{MESSAGE_TOKENS[0]}-{MESSAGE_TOKENS[1]} tokens (seeded); prefill then decode with its params",
            "the decode engine's device prefix cache is dropped before every request (reset_prefix_cache): "
            "a prompt's prefix can only come from the host tier; one prefill engine (examples/pd-prefill.yaml) "
            "and one decode engine per composition, all up at once; each request goes to every decode back to "
            "back, the first one rotating (lockstep: the compositions share the machine's moments)",
            "pd-first: [pd, host] first-wins; host-first: [host, pd] first-wins; ranges: [host, pd] ranges. "
            "Totals over every run; TTFT: the decode engine's arrival to first token (loads, local prefill, "
            "first step), prefill instance's time left out",
            "ratio cells are ranges/other of the totals (TTFT: of the medians; best-sample ratios in the JSON)",
            "TTFT/twin: each request against its twin (a never-seen prompt of the same length, pulled whole over "
            "NIXL) sent next to it to the same engine, order flipping; best-sample / median ratio. In the "
            "ranges/other rows: ranges' TTFT/twin over the other's (the engines' drift cancelled)",
        ],
    )
