"""pdproto_server: the prefill-side gRPC handshake service, CLI and demo."""
