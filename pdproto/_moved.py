"""Import paths the regroup of issue 32 moved, still importable, with a DeprecationWarning.

``import pdproto.topology`` and ``from pdproto.topology import negotiate`` keep working
through one minor release after the move; then the table below goes. A finder at the end
of ``sys.meta_path`` is asked only for names no other finder found, so it never shadows a
real module: for an old name in ``MOVED`` it makes a module that warns once, when it is
imported, and whose attributes are those of the new module (looked up, not copied). Nothing
inside the project imports an old path (``tests/test_moved_imports.py``). Core: no sockets,
threads or event loops.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from collections.abc import Mapping
from importlib.abc import Loader
from importlib.machinery import ModuleSpec
from typing import Any

MOVED: Mapping[str, str] = {
    "pdproto.topology": "pdproto.negotiation.topology",
    "pdproto.tpmap": "pdproto.negotiation.tpmap",
    "pdproto.shards": "pdproto.negotiation.shards",
    "pdproto.senders": "pdproto.negotiation.senders",
    "pdproto.extras": "pdproto.negotiation.extras",
    "pdproto.slots": "pdproto.negotiation.slots",
    "pdproto.reach": "pdproto.negotiation.reach",
    "pdproto.config": "pdproto.negotiation.config",
    "pdproto.registration": "pdproto.negotiation.registration",
    "pdproto.fanin": "pdproto.negotiation.fanin",
    "pdproto.transfer.mooncake": "pdproto.transfer.engines.mooncake",
    "pdproto.transfer.nixl": "pdproto.transfer.engines.nixl",
}
"""Old module -> the module its names live in now. (The client's private modules, ``client_rpc`` and
``client_session``, that no doc named as an import, have no row.)"""


class _Moved(types.ModuleType):
    """An old module: every attribute read comes from the new module."""

    _target: types.ModuleType
    __all__: list[str]

    def __getattr__(self, name: str) -> Any:
        if name != "_target" and hasattr(self._target, name):
            return getattr(self._target, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return dir(self._target)


class _Finder(Loader):
    """Finds and makes the module of an old name (``MOVED``); last in ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        """A spec for an old name; None for every other (the import fails as it would have)."""
        return ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        """A ``_Moved`` module for ``spec.name``."""
        return _Moved(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        """Import the new module, point the old one at it, and warn the importer."""
        new = MOVED[module.__name__]
        assert isinstance(module, _Moved)
        module._target = importlib.import_module(new)
        module.__all__ = list(getattr(module._target, "__all__", ()))
        warnings.warn(f"{module.__name__} moved to {new}; import it from there "
                      "(the old path goes after the next minor release)", DeprecationWarning,
                      stacklevel=2)  # warnings skips importlib's frames: this names the import statement


def install() -> None:
    """Append the finder to ``sys.meta_path`` once."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())


__all__ = ["MOVED", "install"]
