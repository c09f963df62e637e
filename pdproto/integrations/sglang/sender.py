"""The pdproto KV sender for SGLang (placeholder until issue 13 is finished)."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVSender

from pdproto.integrations.sglang import NOT_IMPLEMENTED


class PdprotoKVSender(CommonKVSender):  # type: ignore[misc]
    """Placeholder: one per request on a prefill rank; not implemented yet."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(NOT_IMPLEMENTED)
