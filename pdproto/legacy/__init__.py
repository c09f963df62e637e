"""pdproto.legacy."""
