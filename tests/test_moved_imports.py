"""The import paths issue 32 moved still work for a minor release, warn, and nothing here uses them."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pdproto._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]


def _fresh(name: str) -> None:
    """Forget an old module, so that importing it runs the alias again."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and child in vars(sys.modules[parent]):
        delattr(sys.modules[parent], child)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_imports_with_a_warning_and_gives_the_new_objects(old: str) -> None:
    _fresh(old)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {MOVED[old]}")) as caught:
        exec(compile(f"import {old}", __file__, "exec"), {})
    # pytest.warns also catches warnings other threads raise meanwhile (a loop thread an earlier
    # test of this worker left running): only the move's own warnings must name the import.
    moved = [w for w in caught if f"{old} moved to" in str(w.message)]
    assert moved and all(w.filename == __file__ for w in moved), [w.filename for w in moved]
    alias = sys.modules[old]
    new = importlib.import_module(MOVED[old])
    names = set(getattr(new, "__all__", ()))
    assert names and set(alias.__all__) == names
    for name in names:
        assert getattr(alias, name) is getattr(new, name), name
    with pytest.raises(AttributeError, match="no attribute"):
        alias.no_such_name  # noqa: B018 - the lookup is the test


@pytest.mark.process
def test_from_imports_of_old_paths_work_in_a_fresh_interpreter() -> None:
    """What a user's code does, with warnings as errors off and on."""
    code = ("from pdproto.topology import negotiate\n"
            "from pdproto.fanin import FanInTracker\n"
            "from pdproto.transfer.nixl import NixlExecutor\n"
            "import pdproto.negotiation.topology, pdproto.negotiation.fanin, pdproto.transfer.engines.nixl as nixl\n"
            "assert negotiate is pdproto.negotiation.topology.negotiate\n"
            "assert FanInTracker is pdproto.negotiation.fanin.FanInTracker\n"
            "assert NixlExecutor is nixl.NixlExecutor\n")
    ok = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", code], capture_output=True,
                        text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    strict = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code], capture_output=True,
                            text=True, check=False)
    assert strict.returncode != 0 and "pdproto.topology moved to pdproto.negotiation.topology" in strict.stderr


def test_names_that_never_existed_still_fail_to_import() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("pdproto.no_such_module")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("pdproto.transfer.no_such_engine")


def test_nothing_in_the_project_uses_an_old_path() -> None:
    old = "|".join(re.escape(name) for name in MOVED)
    used = re.compile(rf"(?<![\w.])(?:{old})(?![\w])")
    skip = {ROOT / "pdproto" / "_moved.py", Path(__file__).resolve()}
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml",
             *(p for d in ("pdproto", "pdproto_server", "pdproto_demo", "tests", "bench", "scripts", "docs")
               for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".md", ".sh") and "__pycache__" not in p.parts)]
    assert len(files) > 100, "the scan found no files: it is broken"
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files if path not in skip
             for n, line in enumerate(path.read_text().splitlines(), 1) if used.search(line)]
    assert found == []
