"""Real-engine check: vLLM on the CPU platform with the cpu-offload connector.

Starts one engine through the e2e kit (:class:`kvcompose_tools.e2e.node.EngineNode`, ``vllm.LLM`` in a
process of its own) with a tiny Llama whose weights are seeded random numbers at realistic
scales (so the output depends on the KV it attends to; dummy weights would not show whether KV
moved), serves prompt A, pushes A out of the device prefix cache with other prompts, then
serves A again. A must get an external prefix-cache hit from the host tier and the same
tokens and logprobs as the first time.

``--backend disk`` does the same with the disk tier (a file in a temporary directory).
Run it directly (``python cpu_offload_engine_check.py [--backend disk]``) or through
``test_cpu_offload_engine.py``. It prints one line ``RESULT {json}`` and exits 0 when every
check holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 600
MAX_TOKENS = 16
# 64 device blocks (2048 tokens) hold about three 600-token requests: four evictors push A out.
NUM_GPU_BLOCKS = 64
NUM_EVICTORS = 4
HOST_BYTES = 64 << 20
#: The engine's counters the result reports.
WANTED = ("prefix_cache", "prompt_tokens", "kv_offload", "cpu_offload", "external")


def token_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


def kv_config(backend: str, tmp: Path) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` for the plugin's connector on ``backend``."""
    extra: dict[str, Any] = {"cpu_bytes_to_use": HOST_BYTES}
    if backend == "disk":
        extra = {
            "kv_offload_backend": "disk",
            "disk_path": str(tmp / "kv" / "blocks.bin"),
            "disk_capacity_bytes": HOST_BYTES,
        }
    return {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_connector_module_path": "kvcompose_cpu_offload.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--backend",
        choices=["cpu", "disk"],
        default="cpu",
        help="the tier to offload to (disk: a file in a temporary directory)",
    )
    args = parser.parse_args(argv)
    from kvcompose_tools.e2e.model import make_model
    from kvcompose_tools.e2e.node import EngineNode, wait_all_ready
    from kvcompose_tools.e2e.spec import BLOCK_SIZE, EngineSpec

    source = "disk" if args.backend == "disk" else "host"
    with tempfile.TemporaryDirectory(prefix="kvcompose-cpu-offload-") as tmp:
        model = make_model(0)  # cached, shared with the e2e tests and the demo
        spec = EngineSpec(
            f"cpu-offload-{args.backend}",
            str(model),
            num_gpu_blocks=NUM_GPU_BLOCKS,
            kv_config=kv_config(args.backend, Path(tmp)),
        )
        node = EngineNode(spec, Path(tmp) / "logs")
        try:
            t0 = time.monotonic()
            wait_all_ready([node])
            start_s = time.monotonic() - t0

            def run(ids: list[int]) -> dict[str, Any]:
                (out,) = node.generate([ids], MAX_TOKENS)
                return out

            def counters() -> dict[str, float]:
                return {k: v for k, v in node.metrics().items() if any(w in k for w in WANTED)}

            a = token_prompt(0)
            t1 = time.monotonic()
            a1 = run(a)
            after_a1 = counters()
            for seed in range(1, NUM_EVICTORS + 1):
                run(token_prompt(seed))
            before_a2 = counters()
            a2 = run(a)
            after_a2 = counters()
            a3 = run(a)
            # The model must be sensitive to its KV for the equality above to mean anything: one
            # changed token in the first block has to change the output.
            a_changed = run([a[0] + 1, *a[1:]])
            serve_s = time.monotonic() - t1
        except Exception:
            print(f"--- engine log (tail) ---\n{node.log_tail()}", flush=True)
            raise
        finally:
            node.close()

    def delta(name: str) -> float:
        return after_a2.get(name, 0.0) - before_a2.get(name, 0.0)

    ext_key = "vllm:external_prefix_cache_hits"
    hit_tokens = int(delta(ext_key))
    full_blocks = (PROMPT_LEN - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed
    result = {
        "backend": args.backend,
        "engine_start_s": round(start_s, 1),
        "serve_s": round(serve_s, 2),
        "a1_tokens": a1["token_ids"],
        "a2_tokens": a2["token_ids"],
        "a3_tokens": a3["token_ids"],
        "a_changed_tokens": a_changed["token_ids"],
        "a1_num_cached_tokens": a1["num_cached_tokens"],
        "a2_num_cached_tokens": a2["num_cached_tokens"],
        "a3_num_cached_tokens": a3["num_cached_tokens"],
        "a2_external_hit_tokens": hit_tokens,
        "expected_hit_tokens": full_blocks,
        "tokens_equal": a1["token_ids"] == a2["token_ids"],
        "logprobs_equal": a1["logprobs"] == a2["logprobs"],
        "a2_counter_deltas": {
            k: after_a2[k] - before_a2.get(k, 0.0) for k in after_a2 if after_a2[k] != before_a2.get(k, 0.0)
        },
        "a1_counters": after_a1,
    }
    checks = {
        "A1 computed from scratch": a1["num_cached_tokens"] == 0,
        "A2 hit the offload tier for every full block": hit_tokens == full_blocks,
        "A2 tokens equal A1": result["tokens_equal"],
        "A2 logprobs equal A1": result["logprobs_equal"],
        "A3 equals A1": a3["token_ids"] == a1["token_ids"],
        "output depends on the first block's KV": a_changed["token_ids"] != a1["token_ids"],
        f"A2's hit is counted as source={source}": (
            result["a2_counter_deltas"].get(f"vllm:prompt_tokens_cached_by_source{{source={source}}}") == full_blocks
        ),
    }
    result["checks"] = checks
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
