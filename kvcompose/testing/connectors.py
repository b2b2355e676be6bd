"""Connectors for tests: ``record`` answers as scripted and records every engine call;
``faulty`` is a record connector that also raises, returns ``None``, stalls or fails loads on demand.

The kit's pytest plugin registers their connector types (:mod:`kvcompose.testing.types`) for
tests that use its fixtures, so a composition can say ``type: record`` or ``type: faulty``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
    SupportsHMA,
)


class FaultInjected(RuntimeError):
    """Raised by a ``faulty`` connector where the test asked for it."""


class RecordMetadata(KVConnectorMetadata):
    def __init__(self, name: str, step: int, loads: dict[str, list[int]] | None = None) -> None:
        self.name, self.step = name, step
        #: Loads assigned to this child since the last step: request id -> block ids (first group).
        self.loads = loads or {}


class RecordConnector(KVConnectorBase_V1, SupportsHMA):
    """Answers lookups from its options and records ``(method, args)`` for every call.

    Options (``kv_connector_extra_config``): ``name``, ``matched_tokens`` (int or None for
    "ask again"), ``is_async``, ``delay_free`` (return True from request_finished),
    ``params`` (kv_transfer_params to return), ``sleep_mode`` (what ``supports_sleep_mode``
    answers; default True). A test may also set ``results`` (a ``KVConnectorTransferResults``
    returned once by the next ``get_transfer_results``).
    """

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return bool(kv_transfer_config.kv_connector_extra_config.get("sleep_mode", True))

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
        self._block_size: int = vllm_config.cache_config.block_size
        self._starts: dict[str, int] = {}  # the num_computed_tokens each lookup was asked with
        self._new_loads: dict[str, list[int]] = {}
        #: Worker side: loads bound from metadata and not yet reported.
        self.loading: dict[str, list[int]] = {}

    def _rec(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))

    def called(self, method: str) -> list[tuple[Any, ...]]:
        return [a for m, a in self.calls if m == method]

    # scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._rec("get_num_new_matched_tokens", request.request_id, num_computed_tokens)
        self._starts[request.request_id] = num_computed_tokens
        n = self.matched_tokens
        return (n, self.is_async and bool(n)) if n is not None else (None, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._rec("update_state_after_alloc", request.request_id, num_external_tokens)
        start = self._starts.pop(request.request_id, 0)
        if num_external_tokens > 0:  # the blocks its tokens go to, as a range-aware connector loads
            first, end = start // self._block_size, -(-(start + num_external_tokens) // self._block_size)
            self._new_loads[request.request_id] = list(blocks.get_block_ids()[0][first:end])

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        self._steps += 1
        self._rec("build_connector_meta", self._steps)
        loads, self._new_loads = self._new_loads, {}
        return RecordMetadata(self.name, self._steps, loads)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._rec("request_finished", request.request_id)
        return self.delay_free, self.params

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._rec("request_finished_all_groups", request.request_id)
        return self.delay_free, self.params

    def update_connector_output(self, connector_output: Any) -> None:
        self._rec("update_connector_output", connector_output.kv_connector_worker_meta)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._rec("register_kv_caches", tuple(kv_caches))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._rec("handle_preemptions")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._rec("bind_connector_metadata", connector_metadata)
        if isinstance(connector_metadata, RecordMetadata):
            self.loading.update(connector_metadata.loads)
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

    def unregister_kv_caches(self) -> None:
        self._rec("unregister_kv_caches")

    def restore_kv_caches(self) -> None:
        self._rec("restore_kv_caches")

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


class FaultyConnector(RecordConnector):
    """A record connector with the faults of its ``faults`` option (see ``kvcompose.testing.types.Fault``).

    Each fault wraps the named call on this instance: ``raise`` raises :class:`FaultInjected`,
    ``none`` returns ``None`` (``(None, False)``, "ask again later", from a lookup), ``stall`` sleeps
    ``seconds`` then answers, ``fail-load`` makes
    ``get_transfer_results`` report the named requests' bound loads (all of them when no request
    is named) finished and failed, and ``get_block_ids_with_load_errors`` return their blocks.
    A fault with ``requests`` fires only for calls about those requests; one with ``after`` lets
    that many matching calls through first, one with ``times`` fires that many times and then
    behaves (together: healthy, failing for a while, healthy again). ``fired`` lists
    ``(call, action, request_id)`` for every fault that fired.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from kvcompose.testing.types import Fault

        raw = self._kv_transfer_config.kv_connector_extra_config.get("faults", [])
        self.faults: list[Fault] = [msgspec.convert(f, Fault) for f in raw]
        self.fired: list[tuple[str, str, str | None]] = []
        self._load_errors: set[int] = set()
        self._left = [f.times for f in self.faults]
        self._skip = [f.after for f in self.faults]
        for call in {f.call for f in self.faults}:
            setattr(self, call, self._wrap(call, getattr(self, call)))

    def _wrap(self, call: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        mine = [(i, f) for i, f in enumerate(self.faults) if f.call == call]

        def faulty(*args: Any, **kwargs: Any) -> Any:
            req = next((a.request_id for a in args if hasattr(a, "request_id")), None)
            for i, f in mine:
                if self._left[i] == 0 or (f.requests and f.action != "fail-load" and req not in f.requests):
                    continue
                if self._skip[i]:  # still healthy: the fault fires after `after` matching calls
                    self._skip[i] -= 1
                    continue
                if self._left[i] is not None:
                    self._left[i] -= 1
                if f.action == "fail-load":
                    return self._fail_loads(fn(*args, **kwargs), f.requests)
                self.fired.append((call, f.action, req))
                if f.action == "raise":
                    raise FaultInjected(
                        f"faulty connector {self.name!r}: injected failure in {call}"
                        + (f" for request {req}" if req else "")
                    )
                if f.action == "none":
                    # vLLM's "no answer yet" for a lookup is (None, False); elsewhere a bare None.
                    return (None, False) if call == "get_num_new_matched_tokens" else None
                time.sleep(f.seconds)  # stall
            return fn(*args, **kwargs)

        return faulty

    def _fail_loads(self, res: KVConnectorTransferResults, requests: list[str]) -> KVConnectorTransferResults:
        failing = [r for r in self.loading if not requests or r in requests]
        for r in failing:
            self.fired.append(("get_transfer_results", "fail-load", r))
            self._load_errors.update(self.loading.pop(r))
        return KVConnectorTransferResults(
            set(res.finished_sending), set(res.finished_recving) | set(failing), set(res.failed_recving) | set(failing)
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        super().get_block_ids_with_load_errors()
        errors, self._load_errors = self._load_errors, set()
        return errors
