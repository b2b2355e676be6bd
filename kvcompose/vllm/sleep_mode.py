"""``kvcompose check``'s sleep-mode line: whether vLLM's ``--enable-sleep-mode`` works with a composition.

vLLM 0.33 asks the connector class ``supports_sleep_mode(kv_transfer_config)`` at engine start
and refuses sleep mode when it answers False; the composite answers True when every child's
class does, as vLLM's MultiConnector does (:mod:`kvcompose.vllm.children`). ``check`` asks the
same classes, so it says before the engine starts which child stands in the way.

vLLM is imported only when its connector API has sleep mode (read from its ``base.py``,
:func:`kvcompose.versions.connector_api`), and then in a child process (``python -m
kvcompose.vllm.sleep_mode``): vLLM and torch log to stdout and stderr as they import, and ``check``'s
output is the plan alone. On vLLM 0.32 ``check`` stays as fast as before. A ``vllm`` child whose
module ``check`` does not import (:func:`kvcompose.generic.unverified`) is not asked either.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping

from kvcompose.catalog import Plan
from kvcompose.versions import VLLM, connector_api, installed_base_py, providers, runtime_version

#: How long asking the classes may take (a cold vLLM import on a loaded 2-core host: ~20 s).
ASK_TIMEOUT_S = 120


def installed_sleep_api() -> bool | None:
    """Whether the installed vLLM's connector API has sleep mode (None: vLLM is not installed)."""
    base = installed_base_py()
    return None if base is None else connector_api(base).sleep_mode


def describe(plan: Plan, answers: Mapping[str, bool], unknown: Mapping[str, str] | None = None) -> str:
    """The line for the children's answers (child name -> supports sleep mode); ``unknown``:
    children not asked, and why."""
    unknown = unknown or {}
    lacking = [c for c in plan.children if c.name not in unknown and not answers.get(c.name, False)]
    if lacking:
        names = ", ".join(f"{c.name} ({c.type.name})" for c in lacking)
        verb = "does" if len(lacking) == 1 else "do"
        return f"sleep mode: not supported: {names} {verb} not support it; vLLM refuses --enable-sleep-mode"
    if unknown:
        asked = ", ".join(f"{name}: {why}" for name, why in unknown.items())
        return f"sleep mode: supported by every child asked; not asked: {asked}"
    return "sleep mode: supported (every child supports it: " + ", ".join(plan.names) + ")"


def ask_children(plan: Plan, skip: tuple[str, ...] = ()) -> dict[str, bool]:
    """Each child's answer (but ``skip``'s), from its vLLM connector class, asked in a child process."""
    request = json.dumps({c.name: c.vllm_config() for c in plan.children if c.name not in skip})
    proc = subprocess.run(
        [sys.executable, "-m", "kvcompose.vllm.sleep_mode"],
        input=request,
        capture_output=True,
        text=True,
        timeout=ASK_TIMEOUT_S,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"asking the children's classes failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sleep_mode_line(plan: Plan) -> str:
    """``kvcompose check``'s sleep-mode line for ``plan`` on the installed vLLM."""
    api = installed_sleep_api()
    if api is None:
        return "sleep mode: unknown (vLLM is not installed)"
    if not api:
        version = runtime_version(VLLM.import_name, providers())
        return f"sleep mode: not in the connector API of vLLM {version} (0.33 added it)"
    from kvcompose.generic import unverified

    left, why = unverified(plan)
    unknown = {c.name: why for c in left}
    try:
        answers = ask_children(plan, tuple(unknown))
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        return f"sleep mode: unknown ({exc})"
    return describe(plan, answers, unknown)


def _main() -> None:
    """``python -m kvcompose.vllm.sleep_mode``: for the children's vLLM configs on stdin (name ->
    config), each class's answer, as JSON on stdout."""
    request = json.load(sys.stdin)
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvcompose.vllm.surface import sleep_mode

    answers = {}
    for name, config in request.items():
        ktc = KVTransferConfig(**config)
        answers[name] = sleep_mode(KVConnectorFactory.get_connector_class(ktc), ktc)
    print(json.dumps(answers))


if __name__ == "__main__":
    _main()
