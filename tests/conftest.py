"""Shared test settings: hypothesis profiles sized for a noisy 2-core machine."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# No per-example deadline: these machines are shared and timing is noise, not signal.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=200,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
