"""The composite forwards every call of vLLM's connector API: the installed vLLM's and the next
one's, read from the 0.33 wheel's ``base.py`` (parsed, never imported; docs/versions.md).

``make test-vllm-next`` downloads the wheel into ``.venv-next/wheels`` (or set
``KVCOMPOSE_VLLM_NEXT_WHEEL``); without it the wheel's test is skipped.
"""

from __future__ import annotations

import inspect
import os
import zipfile
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvcompose.testing import inspector
from kvcompose.testing.versions import INSTALLED_LACKS
from kvcompose.versions import BASE_PY, ConnectorAPI, connector_api, installed_base_py, parse_connector_api
from kvcompose.vllm import surface
from kvcompose.vllm.connector import KVComposeConnector, forward_unknown_calls, forwarder

ROOT = Path(__file__).parents[2]

#: The call of vLLM's ``SupportsHMA`` interface (the composite is ``SupportsHMA``), beside
#: ``KVConnectorBase_V1``'s.
HMA_CALLS = frozenset({"request_finished_all_groups"})
#: Members of vLLM's MultiConnector beyond the connector API that the composite keeps, as a
#: drop-in for it.
MULTICONNECTOR_EXTRAS = frozenset({"sub_connectors"})


def next_wheel() -> Path | None:
    """The next vLLM's wheel: ``KVCOMPOSE_VLLM_NEXT_WHEEL``, else the one ``make test-vllm-next`` keeps."""
    given = os.environ.get("KVCOMPOSE_VLLM_NEXT_WHEEL")
    if given:
        return Path(given)
    found = sorted((ROOT / ".venv-next" / "wheels").glob("vllm-*.whl"))
    return found[-1] if found else None


def wheel_api(wheel: Path) -> ConnectorAPI:
    with zipfile.ZipFile(wheel) as zf:
        source = zf.read(f"vllm/{BASE_PY}").decode()
    return parse_connector_api(source, f"{wheel.name}:vllm/{BASE_PY}")


def forwarded_generically(cls: type) -> tuple[str, ...]:
    """The calls ``cls`` forwards only by the generic rule (:func:`forward_unknown_calls`)."""
    generic = forwarder("any").__code__
    return tuple(name for name, fn in vars(cls).items() if getattr(fn, "__code__", None) is generic)


def not_forwarded(api: ConnectorAPI) -> list[str]:
    """Names of ``api`` the composite does not define itself, or defines as another kind."""
    missing = []
    for name in sorted(api.all - surface.NOT_FORWARDED):
        mine = inspect.getattr_static(KVComposeConnector, name, None)
        if mine is None or mine is inspect.getattr_static(KVConnectorBase_V1, name, None):
            missing.append(f"{name} (not defined)")
        elif name in forwarded_generically(KVComposeConnector):
            missing.append(f"{name} (only by the generic rule)")
        elif surface_kind(mine) != api.kind(name):
            missing.append(f"{name} (a {surface_kind(mine)}, vLLM's is a {api.kind(name)})")
    return missing


def surface_kind(member: object) -> str:
    if isinstance(member, classmethod):
        return "classmethod"
    return "property" if isinstance(member, property) else "method"


def composite_members() -> dict[str, str]:
    """The public members the composite's own classes define (not vLLM's base classes), by kind."""
    vllm_classes = {c for c in KVComposeConnector.__mro__ if c.__module__.startswith("vllm.")}
    out = {}
    for cls in KVComposeConnector.__mro__:
        if cls in vllm_classes or cls is object:
            continue
        for name, member in vars(cls).items():
            if not name.startswith("_") and (callable(member) or isinstance(member, (classmethod, property))):
                out.setdefault(name, surface_kind(member))
    return out


def declared_api() -> dict[str, str]:
    """The calls of vLLM's connector API the composite defines, by kind."""
    return {name: kind for name, kind in composite_members().items() if name not in MULTICONNECTOR_EXTRAS}


def test_the_composite_and_the_installed_vllm_name_the_same_calls() -> None:
    """Each call of vLLM's connector API is defined once, of the kind vLLM's is, and the composite
    defines exactly those (and MultiConnector's ``sub_connectors``)."""
    mine = {name: kind for name, kind in declared_api().items() if name not in INSTALLED_LACKS}
    vllm = {name: kind for name, kind in surface.base_calls().items() if name not in surface.NOT_FORWARDED}
    assert mine == vllm | dict.fromkeys(HMA_CALLS, "method")
    assert MULTICONNECTOR_EXTRAS <= set(composite_members())
    assert forwarded_generically(KVComposeConnector) == ()


def test_the_composite_defines_the_next_vllms_connector_api() -> None:
    wheel = next_wheel()
    if wheel is None:
        pytest.skip("no next vLLM wheel: run `make test-vllm-next` (or set KVCOMPOSE_VLLM_NEXT_WHEEL)")
    api = wheel_api(wheel)
    vllm = {name: api.kind(name) for name in api.all - surface.NOT_FORWARDED}
    assert declared_api() == vllm | dict.fromkeys(HMA_CALLS, "method")


def test_the_parser_reads_the_installed_base_as_python_sees_it() -> None:
    base = installed_base_py()
    assert base is not None
    api = connector_api(base)
    assert {name: api.kind(name) for name in api.all} == surface.base_calls()


def test_the_composite_forwards_every_call_of_the_installed_vllm() -> None:
    base = installed_base_py()
    assert base is not None
    assert not_forwarded(connector_api(base)) == []


def test_the_composite_forwards_every_call_of_the_next_vllm() -> None:
    wheel = next_wheel()
    if wheel is None:
        pytest.skip("no next vLLM wheel: run `make test-vllm-next` (or set KVCOMPOSE_VLLM_NEXT_WHEEL)")
    api = wheel_api(wheel)
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"} <= api.all, wheel.name
    assert not_forwarded(api) == [], wheel.name
    print(f"{wheel.name}: {len(api.all)} public members of KVConnectorBase_V1, all forwarded")


def test_a_call_kvcompose_does_not_know_reaches_every_child_merged_by_type(kvcompose_worker) -> None:  # type: ignore[no-untyped-def]
    """A newer vLLM's base class with a call the composite does not define: forwarded to every
    child that has it, the answers merged by type (kvcompose.merge)."""

    class NewerBase(KVConnectorBase_V1):
        def pinned_blocks(self, request_id: str) -> set[int] | None:
            return None

    composite = forward_unknown_calls(type("Newer", (KVComposeConnector,), {}), base=NewerBase)
    assert forwarded_generically(composite) == ("pinned_blocks",)
    conn = kvcompose_worker(
        "version: 1\nconnectors: [{name: a, type: record}, {name: b, type: record}, {name: c, type: record}]\n",
        register=False,
    ).connector
    inspector.child(conn, "a").pinned_blocks = lambda request_id: {1, 2}
    inspector.child(conn, "b").pinned_blocks = lambda request_id: {3}
    # c has no such call (a class written for an older vLLM): it is passed over.
    conn.__class__ = composite  # the same instance, under the newer vLLM's class
    assert conn.pinned_blocks("r1") == {1, 2, 3}
