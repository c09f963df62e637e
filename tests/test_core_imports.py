"""The pure core loads no gRPC, event loop, threads, sockets or engines (DESIGN section 2).

The core is a set of packages, not of name prefixes: ``pdproto.negotiation``,
``pdproto.dcp``, ``pdproto.legacy`` and ``pdproto.v1`` (its lazily loaded gRPC stubs
aside), and the modules directly in ``pdproto`` but those in ``EDGE_MODULES``. Every
other package under ``pdproto`` is a named edge, and a package that is neither fails the
test, so a new one is placed on purpose. Each core module is imported alone in a fresh interpreter. A probe installed first sees
every import statement (``builtins.__import__``) and every first load (a meta-path
finder), so it catches a forbidden module whether the core imports it directly, through
a third-party package, or after something else already loaded it.

One narrow exception: protobuf itself (``google.protobuf.descriptor`` and
``descriptor_pool``) imports threading for module-level locks, so threading is in
``sys.modules`` after any ``*_pb2`` import. Protobuf's modules may import it; nothing else
may, and no pdproto module may either.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pdproto

FORBIDDEN = ("grpc", "asyncio", "threading", "socket", "concurrent.futures", "zmq", "torch", "mooncake", "nixl",
             "nixl_cu12")
# (importing package, forbidden module) pairs that are not ours to change.
ALLOWED = {("google.protobuf", "threading")}
PURE_PACKAGES = ("pdproto.negotiation", "pdproto.dcp", "pdproto.legacy", "pdproto.v1")
"""Packages whose every module is core (``pdproto.v1``'s ``*_pb2_grpc`` stubs aside: they are gRPC)."""
EDGE_PACKAGES = ("pdproto.rpc", "pdproto.client", "pdproto.transfer", "pdproto.integrations")
"""Packages that talk to gRPC, sockets or engines by design (integrations run inside an engine)."""
EDGE_MODULES: tuple[str, ...] = ()
"""Modules directly in ``pdproto`` that are edges (sockets, threads); none today."""

PROBE = textwrap.dedent(
    """
    import builtins, importlib, json, sys

    FORBIDDEN = {forbidden!r}
    found = []

    def forbidden(name, fromlist=()):
        names = [name] + [f"{{name}}.{{f}}" for f in fromlist or () if isinstance(f, str)]
        return sorted({{f for f in FORBIDDEN for n in names if n == f or n.startswith(f + ".")}})

    def importer_of(frame):
        # The first frame outside importlib's machinery and this probe is the importer.
        while frame is not None and frame.f_globals.get("__name__", "").startswith(
                ("importlib", "_frozen_importlib", "__main__")):
            frame = frame.f_back
        return frame.f_globals.get("__name__", "?") if frame is not None else "?"

    real_import = builtins.__import__

    def probe_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0:
            for mod in forbidden(name, fromlist):
                found.append(((globals or {{}}).get("__name__", "?"), mod))
        return real_import(name, globals, locals, fromlist, level)

    class Finder:
        def find_spec(self, fullname, path=None, target=None):
            for mod in forbidden(fullname):
                found.append((importer_of(sys._getframe(1)), mod))
            return None

    for name in FORBIDDEN:
        assert name not in sys.modules, f"{{name}} loaded before the probe"
    builtins.__import__ = probe_import
    sys.meta_path.insert(0, Finder())
    importlib.import_module(sys.argv[1])
    loaded = sorted(m for m in FORBIDDEN if m in sys.modules)
    print(json.dumps({{"found": sorted(set(map(tuple, found))), "loaded": loaded}}))
    """
).format(forbidden=FORBIDDEN)


def _in(name: str, packages: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``packages`` or inside one of them."""
    return any(name == p or name.startswith(p + ".") for p in packages)


def core_modules() -> list[str]:
    """``pdproto``, its top-level modules but the edge ones, and every module of the pure packages."""
    names = ["pdproto"]
    for info in pkgutil.walk_packages(pdproto.__path__, "pdproto."):
        top_level = info.name.count(".") == 1 and not info.ispkg
        if (top_level and info.name not in EDGE_MODULES) or \
                (_in(info.name, PURE_PACKAGES) and not info.name.endswith("_pb2_grpc")):
            names.append(info.name)
    return sorted(names)


def test_every_package_is_core_or_a_named_edge() -> None:
    packages = [i.name for i in pkgutil.iter_modules(pdproto.__path__, "pdproto.") if i.ispkg]
    assert sorted(packages) == sorted(PURE_PACKAGES + EDGE_PACKAGES), packages


def probe(module: str, *, path: Path | None = None) -> tuple[set[tuple[str, str]], list[str]]:
    """Import ``module`` in a fresh interpreter: (importer, forbidden module) pairs, and
    which forbidden modules ended up loaded."""
    env = None if path is None else {**os.environ, "PYTHONPATH": str(path)}
    run = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True, text=True,
                         check=False, env=env)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.splitlines()[-1])
    return {(a, b) for a, b in out["found"]}, out["loaded"]


def allowed(importer: str, mod: str) -> bool:
    """Whether ``importer`` is a package we let import ``mod`` (see the module docstring)."""
    return any(mod == m and (importer == pkg or importer.startswith(pkg + ".")) for pkg, m in ALLOWED)


def violations(found: set[tuple[str, str]], loaded: list[str]) -> list[str]:
    """What a core module must not do, as readable lines (imports inside a forbidden
    package, e.g. grpc importing asyncio, are left out: the way in is what matters)."""
    inside = {i for i, _ in found if any(i == f or i.startswith(f + ".") for f in FORBIDDEN)}
    bad = [f"{importer} imports {mod}" for importer, mod in sorted(found)
           if importer not in inside and not allowed(importer, mod)]
    explained = {mod for importer, mod in found if allowed(importer, mod)}
    bad += [f"{mod} is loaded, by no allowed importer" for mod in loaded if mod not in explained]
    return bad


def test_the_core_list_covers_the_named_packages() -> None:
    names = core_modules()
    for must in ("pdproto.errors", "pdproto.wire", "pdproto.negotiation.topology", "pdproto.negotiation.config",
                 "pdproto.dcp.plan", "pdproto.legacy.mooncake", "pdproto.v1",
                 "pdproto.v1.handshake_service_pb2", "pdproto.v1.common_pb2"):
        assert must in names
    assert not [n for n in names if _in(n, EDGE_PACKAGES + EDGE_MODULES)]
    assert "pdproto.session" in names and "pdproto.backends" in names and "pdproto._moved" in names


@pytest.mark.process
@pytest.mark.parametrize("module", core_modules())
def test_core_module_loads_no_grpc_asyncio_threads_or_sockets(module: str) -> None:
    found, loaded = probe(module)
    assert not violations(found, loaded), f"importing {module}: {violations(found, loaded)}"


# The probe itself must bite: bad modules in a scratch directory, each hiding a forbidden
# import a different way, and the line the probe must report for each.
BAD_MODULES = {
    "direct_grpc": ("import grpc\n", "direct_grpc imports grpc"),
    # threading is already loaded (by protobuf) when this runs: only the import hook sees it.
    "late_threading": ("import pdproto.v1\nimport threading\n", "late_threading imports threading"),
    "via_importlib": ("import importlib\nimportlib.import_module('concurrent.futures')\n",
                      "via_importlib imports concurrent.futures"),
    "from_import": ("from concurrent import futures\n", "from_import imports concurrent.futures"),
    "through_a_library": ("import grpc_status.rpc_status\n", "grpc_status.rpc_status imports grpc"),
    "lazy_stub": ("import pdproto.v1\npdproto.v1.HandshakeServiceStub\n",
                  "pdproto.v1.handshake_service_pb2_grpc imports grpc"),
    "uses_logging": ("import logging\n", "logging imports threading"),
}


@pytest.mark.process
@pytest.mark.parametrize("name", sorted(BAD_MODULES))
def test_the_probe_catches_a_forbidden_import(tmp_path: Path, name: str) -> None:
    source, expected = BAD_MODULES[name]
    (tmp_path / f"{name}.py").write_text(source)
    assert expected in violations(*probe(name, path=tmp_path))



SERVER_PACKAGE = "pdproto_server"
SERVER_IMPORTERS = ("pdproto.integrations",)
"""The only part of ``pdproto`` that may import the prefill service: an engine adapter embeds it."""


def server_imports(root: Path, package: str) -> list[str]:
    """``module: line`` for every import of ``pdproto_server`` in ``root`` (a package named ``package``)."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        module = ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            if any(n == SERVER_PACKAGE or n.startswith(SERVER_PACKAGE + ".") for n in names):
                found.append(f"{module}:{node.lineno}")
    return found


def test_only_the_engine_adapters_import_the_prefill_service(tmp_path: Path) -> None:
    """DESIGN section 2: ``pdproto`` never imports ``pdproto_server``, except the integrations."""
    found = server_imports(Path(pdproto.__path__[0]), "pdproto")
    assert [f for f in found if not _in(f.split(":")[0], SERVER_IMPORTERS)] == []
    assert any(f.startswith("pdproto.integrations.sglang.") for f in found)  # the scan sees them
    (tmp_path / "bad.py").write_text("from pdproto_server.engine import PrefillEngine\n")
    assert server_imports(tmp_path, "pdproto") == ["pdproto.bad:1"]
