"""Fault injection, version skew, limits and load scenarios."""
