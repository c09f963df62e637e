"""Engine adapters: pdproto behind an inference engine's own extension points."""
