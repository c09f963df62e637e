"""The engine executors (Mooncake, NIXL) and what they share (see README.md here).

Nothing is imported here: ``pdproto.transfer.create_executor`` imports an engine's module
only when its backend is created, so a missing engine package costs nothing until then.
"""
