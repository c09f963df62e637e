"""The pdproto KV manager for SGLang (placeholder until issue 13 is finished)."""

from __future__ import annotations

from sglang.srt.disaggregation.common.conn import CommonKVManager

from pdproto.integrations.sglang import NOT_IMPLEMENTED


class PdprotoKVManager(CommonKVManager):  # type: ignore[misc]
    """Placeholder: one per scheduler rank in SGLang, in both modes; not implemented yet.

    It derives from ``CommonKVManager`` because ``decode.py`` and ``prefill.py`` call
    members only that class has (see docs/sglang-notes.md).
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError(NOT_IMPLEMENTED)
