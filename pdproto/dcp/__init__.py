"""pdproto.dcp."""
