"""The decode compositions benchmark 5c compares (:data:`COMPOSITIONS`) and the prefill's."""

from __future__ import annotations

from kvcompose.examples import EXAMPLES

PREFILL_YAML = EXAMPLES / "pd-prefill.yaml"
#: The decode instance's host tier (as in examples/pd-decode.yaml): far more than the workload's
#: KV (8 conversations of at most 28 blocks of 32 KiB: about 7 MiB).
CPU_BYTES = 256 * 2**20

#: Name -> (children in YAML order, load rule). ``ranges`` is the subject.
COMPOSITIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "pd-first": (("pd", "host"), "first-wins"),
    "host-first": (("host", "pd"), "first-wins"),
    "ranges": (("host", "pd"), "ranges"),
}
SUBJECT = "ranges"

_CHILDREN = {
    "host": f"""\
  - name: host            # host-memory prefix tier
    type: cpu-offload
    options: {{cpu_bytes: {CPU_BYTES // 2**20}MiB}}
""",
    "pd": """\
  - name: pd              # P/D transfer over NIXL (port: overridden with a free one)
    type: nixl
    role: consumer
    options:
      backends: [UCX]
      side_channel_host: 127.0.0.1
      side_channel_port: 5601
      progress_delay_us: 100
      ucx_error_handling: none
""",
}


def decode_composition(name: str) -> str:
    """The decode instance's composition ``name`` (:data:`COMPOSITIONS`), modelled on
    ``examples/pd-decode.yaml``."""
    children, load = COMPOSITIONS[name]
    return (
        f"# {name}: decode instance, children {', '.join(children)}, load: {load}\n"
        "version: 1\nconnectors:\n"
        + "".join(_CHILDREN[c] for c in children)
        + f"rules: {{load: {load}, store: all, metadata: merge}}\n"
    )
