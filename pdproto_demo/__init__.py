"""pdproto_demo: the demo, the synthetic prefill and the decode peer, beside the service (see README.md here)."""
