"""pdproto tests."""
