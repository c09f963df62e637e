"""tests/vllm: vLLM's model inspection done once per test process, before any test runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    """Inspect the rig's model classes outside every test.

    vLLM inspects an architecture in a subprocess the first time a ``ModelConfig`` names it, then
    keeps the answer under ``VLLM_CACHE_ROOT``. On a fresh machine the first test to build a config
    would start that process, and a test not marked ``process`` may not (``tests/conftest.py``):
    whether it failed depended on which test a worker ran first.
    """
    from tests.vllm import _rig

    with tempfile.TemporaryDirectory() as root:
        for name, config in (("mla", _rig.MODEL), ("mha", _rig.MHA_MODEL)):
            _rig.model_config(_rig.model_dir(Path(root) / name, config))
