"""Whether a function does nothing: what the test kit checks a plugin's ``empty_calls`` against.

The composite does not call a child's hook that its plugin declares empty
(``ConnectorType.empty_calls``) or that it inherits from vLLM where vLLM's default does nothing
(``kvcompose.vllm.calls.INHERITED_DEFAULT_DOES_NOTHING``). The engine trusts those declarations;
a plugin's test pins them with :func:`check_empty_calls`.
"""

from __future__ import annotations

import dis
from collections.abc import Callable
from typing import Any

#: The instructions of a function that does nothing and answers ``None`` (``pass``, ``...``, a
#: docstring alone or a bare ``return``), as CPython 3.11 and 3.12+ compile it.
_EMPTY_BODIES = ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])
_NOT_BODY = frozenset({"RESUME", "NOP", "CACHE"})


def has_empty_body(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` (a function or bound method) does nothing but answer ``None``."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:  # a builtin, a partial, a mock: it may do something
        return False
    body = [(ins.opname, ins.argval) for ins in dis.get_instructions(code) if ins.opname not in _NOT_BODY]
    return body in _EMPTY_BODIES


def check_empty_calls(connector_type: type, connector_class: type) -> None:
    """Raise ``AssertionError`` naming each call in ``connector_type.empty_calls`` whose
    implementation in ``connector_class`` does something or answers something."""
    wrong = sorted(
        name for name in connector_type.empty_calls if not has_empty_body(getattr(connector_class, name, None))
    )
    assert not wrong, f"{connector_class.__qualname__}: {wrong} are declared empty but have a body"
