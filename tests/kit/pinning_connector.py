"""A connector with the defect ``lookup-is-side-effect-free`` exists to catch: a hit pins its
entry for the request that looked it up, and only an allocation releases the pin, so an
abandoned lookup (an aborted request) keeps the entry from every later request."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector


class PinningExampleConnector(ExampleConnector):
    """vLLM's ExampleConnector whose hits are pinned at lookup, per prompt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pins: dict[tuple[int, ...], str] = {}

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        key = tuple(request.prompt_token_ids)
        if self._pins.get(key, request.request_id) != request.request_id:
            return 0, False  # pinned by another request
        tokens, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens:
            self._pins[key] = request.request_id
        return tokens, is_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._pins.pop(tuple(request.prompt_token_ids), None)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
