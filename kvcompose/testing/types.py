"""Plugin module: the test kit's connector types (``record``)."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from kvcompose import hookimpl
from kvcompose.catalog import ConnectorType, Options
from kvcompose.compose import Child


class RecordOptions(Options):
    matched_tokens: int | None = 0
    is_async: bool = False
    delay_free: bool = False
    params: dict[str, Any] | None = None


class RecordType(ConnectorType):
    name = "record"
    summary = "test double: answers as scripted, records every engine call"
    options: ClassVar[type[Options]] = RecordOptions

    def vllm_config(self, child: Child) -> dict[str, Any]:
        o = child.options
        assert isinstance(o, RecordOptions)
        extra = {"name": child.name, **{k: v for k, v in msgspec.to_builtins(o).items()
                                        if k in ("matched_tokens", "is_async", "delay_free", "params")}}
        return {"kv_connector": "RecordConnector", "kv_connector_module_path": "kvcompose.testing.connectors",
                "kv_connector_extra_config": extra}

    def describe(self, child: Child) -> str:
        return f"records calls; answers {child.options.matched_tokens} matched tokens"  # type: ignore[attr-defined]


class RecordPDType(RecordType):
    name = "record-pd"
    summary = "test double of a P/D transport: owns the NIXL-style kv_transfer_params keys"
    owns_handshake = True
    owns_host_buffer_ops = True
    param_keys = frozenset({"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                            "remote_host", "remote_port"})


@hookimpl
def kvcompose_connector_types() -> list[ConnectorType]:
    return [RecordType(), RecordPDType()]
