"""The pdproto KV receiver for SGLang (placeholder until issue 13 is finished)."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVReceiver

from pdproto.integrations.sglang import NOT_IMPLEMENTED


class PdprotoKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """Placeholder: one per request on a decode rank; not implemented yet."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(NOT_IMPLEMENTED)
