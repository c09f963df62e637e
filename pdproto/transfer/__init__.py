"""pdproto.transfer."""
