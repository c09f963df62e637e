"""Shared test settings: hypothesis profiles, and the ``process`` marker enforced.

A test that starts a subprocess or a gRPC server must say so with
``@pytest.mark.process`` (or a module's ``pytestmark``): ``make test-fast`` deselects
those and runs the pure ones alone. An unmarked test that tries fails at once, naming
what it started, so the fast set stays pure as tests are added.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Generator
from typing import Any

import grpc
import grpc.aio
import pytest
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

# Every process a test starts shares this host: engines advertise loopback, so test traffic
# stays on 127.0.0.1 (by default they advertise this host's routable address). The
# multi-host tests drop it for the processes they start in their network namespaces.
os.environ.setdefault("PDPROTO_ADVERTISE_HOST", "127.0.0.1")

# tests/vllm runs in .venv-vllm (scripts/run_tests.sh), where vLLM 0.33.0 is installed; the main
# virtualenv has no vLLM (its pins conflict with SGLang's) and leaves the directory out.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm"]

_SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn",
                           "os.spawn", "os.system", "os.exec"})
_pure_test: str | None = None
"""The node id of the unmarked test now running (its setup, call or teardown), if any."""


def _refuse_spawns(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook: an unmarked test may not start a process."""
    if _pure_test is not None and event in _SPAWN_EVENTS:
        raise RuntimeError(f"{_pure_test} started a process ({event}) but is not marked "
                           "@pytest.mark.process")


sys.addaudithook(_refuse_spawns)


def _refusing(what: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        if _pure_test is not None:
            raise RuntimeError(f"{_pure_test} started a {what} but is not marked @pytest.mark.process")
        return real(*args, **kwargs)
    return refuse


# gRPC servers start in C, out of the audit hook's sight: refuse them at the Python door.
grpc.server = _refusing("gRPC server", grpc.server)
grpc.aio.server = _refusing("gRPC server", grpc.aio.server)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    """Guard setup, call and teardown (module fixtures start with a module's first test)."""
    global _pure_test
    _pure_test = None if item.get_closest_marker("process") else item.nodeid
    try:
        return (yield)
    finally:
        _pure_test = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` first, the rest in their usual order (the sort is stable).

    ``make test`` hands whole files to two workers in this order (``--no-loadscope-reorder``);
    a long file collected last (tests/sglang/ is) otherwise runs alone at the end while the
    other worker idles.
    """
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
