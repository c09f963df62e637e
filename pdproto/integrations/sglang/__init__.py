"""SGLang 0.5.23 transfer backend ``pdproto``, loaded through SGLang's plugin entry point.

``--disaggregation-transfer-backend pdproto`` makes SGLang's schedulers use this package's
manager, sender, receiver and bootstrap server: prefill ranks serve pdproto's handshake
service (negotiation, DCP relayout planning, transfers of KV, aux and state) and register
its gRPC endpoint with SGLang's bootstrap server; decode ranks find them through
``/route`` and register, submit and watch over gRPC. Importing this package imports
nothing from SGLang; ``plugin.register`` does, when SGLang's ``load_plugins()`` calls it.
See README.md here and docs/sglang.md.
"""
