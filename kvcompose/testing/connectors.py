"""Connector types for tests: ``record`` answers as scripted and records every engine call.

Register :mod:`kvcompose.testing.types` as a plugin (the test kit's conftest does) to use
``type: record`` in a composition.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)

#: Every RecordConnector instance, newest last, so a test can find the children it composed.
INSTANCES: list["RecordConnector"] = []


class RecordMetadata(KVConnectorMetadata):
    def __init__(self, name: str, step: int) -> None:
        self.name, self.step = name, step


class RecordConnector(KVConnectorBase_V1, SupportsHMA):
    """Answers lookups from its options and records ``(method, args)`` for every call.

    Options (``kv_connector_extra_config``): ``name``, ``matched_tokens`` (int or None for
    "ask again"), ``is_async``, ``delay_free`` (return True from request_finished),
    ``params`` (kv_transfer_params to return). A test may also set ``results`` (a
    ``KVConnectorTransferResults`` returned once by the next ``get_transfer_results``).
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.name: str = extra.get("name", "record")
        self.matched_tokens: int | None = extra.get("matched_tokens", 0)
        self.is_async: bool = extra.get("is_async", False)
        self.delay_free: bool = extra.get("delay_free", False)
        self.params: dict[str, Any] | None = extra.get("params")
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.results: KVConnectorTransferResults | None = None
        self._steps = 0
        INSTANCES.append(self)

    def _rec(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))

    def called(self, method: str) -> list[tuple[Any, ...]]:
        return [a for m, a in self.calls if m == method]

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._rec("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        n = self.matched_tokens
        return (n, self.is_async and bool(n)) if n is not None else (None, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._rec("update_state_after_alloc", request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._steps += 1
        self._rec("build_connector_meta", self._steps)
        return RecordMetadata(self.name, self._steps)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._rec("request_finished", request.request_id)
        return self.delay_free, self.params

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        self._rec("request_finished_all_groups", request.request_id)
        return self.delay_free, self.params

    def update_connector_output(self, connector_output: Any) -> None:
        self._rec("update_connector_output", connector_output.kv_connector_worker_meta)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._rec("register_kv_caches", tuple(kv_caches))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._rec("bind_connector_metadata", connector_metadata)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self._rec("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._rec("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._rec("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._rec("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self._rec("wait_for_save")

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._rec("set_host_xfer_buffer_ops", copy_operation)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._rec("get_transfer_results", set(finished_req_ids))
        res, self.results = self.results, None
        return res or KVConnectorTransferResults()

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._rec("get_block_ids_with_load_errors")
        return set()

    def get_kv_connector_stats(self) -> Any:
        self._rec("get_kv_connector_stats")
        return None

    def get_kv_connector_kv_cache_events(self) -> Any:
        self._rec("get_kv_connector_kv_cache_events")
        return None

    def build_connector_worker_meta(self) -> Any:
        self._rec("build_connector_worker_meta")
        return None
