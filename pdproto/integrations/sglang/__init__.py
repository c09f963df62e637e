"""SGLang 0.5.23 transfer backend ``pdproto``, loaded through SGLang's plugin entry point.

Importing this package imports nothing from SGLang; ``plugin.register`` does, when
SGLang's ``load_plugins()`` calls it. The backend's manager, sender and receiver are
placeholders until issue 13 is finished: selecting the backend works, moving KV does not.
"""

NOT_IMPLEMENTED = (
    "the SGLang transfer backend 'pdproto' is registered but not implemented yet: its "
    "KV manager, sender and receiver are placeholders (issue 13). Use "
    "--disaggregation-transfer-backend mooncake or nixl until it lands."
)
"""Why constructing a placeholder class fails."""
