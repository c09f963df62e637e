"""Golden SGLang 0.5.23 legacy frames and their generator (see README.md)."""
