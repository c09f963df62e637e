"""Fuzz harnesses (atheris + hypothesis)."""
