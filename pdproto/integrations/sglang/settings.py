"""What an operator sets for the pdproto backend besides SGLang's own flags: environment variables.

SGLang's argument parser is closed to plugins (they may only add a backend name to
``--disaggregation-transfer-backend``), and SGLang configures its own transfer backends
through ``SGLANG_*``/``MOONCAKE_*`` environment variables; pdproto's settings follow that
habit, each with a default that works for a single-host CPU test. Both sides read them in
every scheduler process:

===================================  ==========================================================
``PDPROTO_ENGINE``                   transfer engine: ``mooncake`` (default) or ``nixl``
``PDPROTO_TOKEN`` / ``PDPROTO_TOKEN_FILE``  shared token the prefill requires and the decode proves (never sends)
``PDPROTO_OPERATOR_TOKEN_FILE``      prefill: a second token, for ``pdproto status`` only: it shows every
                                     peer's room ids and engine identity (docs/security.md)
``PDPROTO_ALLOW_UNAUTHENTICATED``    ``1``: a prefill serves without a token on a non-loopback address
``PDPROTO_TLS_CERT`` / ``PDPROTO_TLS_KEY``  prefill: PEM files that turn TLS on
``PDPROTO_TLS_ROOT``                 decode: PEM root certificate (TLS to every prefill rank)
``PDPROTO_PORT``                     prefill: gRPC port base; the rank on GPU g listens on port + g
                                     (0, the default: any free port; ``/route`` publishes it)
``PDPROTO_STAGING_MB``               packing region per rank, in MiB (default 64; 0: per-row)
``PDPROTO_RPC_TIMEOUT_S``            deadline of one Register/Submit/Abort call (default 10)
``PDPROTO_LEGACY``                   prefill: ``1`` serves unmodified SGLang decodes (their Mooncake or NIXL
                                     frames, as ``PDPROTO_ENGINE``) on the rank port (mixed fleets,
                                     docs/migration.md); off (the default) they are answered Failed, naming
                                     this variable
===================================  ==========================================================

On/off variables read ``1``, ``true``, ``yes`` or ``on`` as on and ``0``, ``false``, ``no``,
``off`` or unset as off, in any case; any other value is refused.

Mooncake's own transport settings stay Mooncake's (``MOONCAKE_PROTOCOL``, ``MC_*``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pdproto import backends
from pdproto.errors import ConfigError, Reason


@dataclass(frozen=True)
class BackendSettings:
    """The pdproto backend's settings (module docstring), read once per SGLang scheduler process."""

    engine: str = "mooncake"
    """Transfer engine name (``pdproto.backends``)."""
    token: str | None = None
    """Shared token (proven, never sent: docs/security.md); None: no authentication (loopback only, unless allowed)."""
    operator_token: str | None = None
    """Prefill: the operator's token (``Describe`` only), which may not be ``token``."""
    allow_unauthenticated: bool = False
    """Serve without a token on a non-loopback address (trusted networks only)."""
    tls_cert: bytes | None = None
    """Prefill: PEM certificate chain."""
    tls_key: bytes | None = None
    """Prefill: PEM private key."""
    tls_root: bytes | None = None
    """Decode: PEM root certificate the prefill ranks' certificates chain to."""
    port: int = 0
    """Prefill: gRPC port base (the rank on GPU g listens on port + g); 0: any free port."""
    staging_mb: int = 64
    """Packing region per rank in MiB; 0 disables packing."""
    rpc_timeout_s: float = 10.0
    """Deadline of one unary call (Register, SubmitTransfer, Abort)."""
    legacy: bool = False
    """Prefill: serve SGLang 0.5.23's own decodes on the rank port (``pdproto_server/legacy.py``)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> BackendSettings:
        """Read the settings; a bad value raises ``ConfigError`` (CONFIG_INVALID) naming the variable."""
        env = os.environ if env is None else env
        engine = env.get("PDPROTO_ENGINE", cls.engine)
        # Single-host engines copy only into memory they allocated; SGLang's pools are its own.
        known = [spec.name for spec in backends.ALL if not spec.single_host]
        if engine not in known:
            raise _bad("PDPROTO_ENGINE", engine, f"one of {', '.join(known)}")
        token = env.get("PDPROTO_TOKEN") or None
        token_file = env.get("PDPROTO_TOKEN_FILE")
        if token_file:
            token = _read(token_file, "PDPROTO_TOKEN_FILE").decode().strip() or None
        operator_file = env.get("PDPROTO_OPERATOR_TOKEN_FILE")
        operator = None
        if operator_file:
            operator = _read(operator_file, "PDPROTO_OPERATOR_TOKEN_FILE").decode().strip() or None
        if operator is not None and operator == token:
            raise _bad("PDPROTO_OPERATOR_TOKEN_FILE", operator_file or "", "a token other than PDPROTO_TOKEN's "
                       "(with the same one every decode could read every peer's room ids)")
        return cls(
            engine=engine, token=token, operator_token=operator,
            allow_unauthenticated=_flag(env, "PDPROTO_ALLOW_UNAUTHENTICATED"),
            tls_cert=_read(env["PDPROTO_TLS_CERT"], "PDPROTO_TLS_CERT") if env.get("PDPROTO_TLS_CERT") else None,
            tls_key=_read(env["PDPROTO_TLS_KEY"], "PDPROTO_TLS_KEY") if env.get("PDPROTO_TLS_KEY") else None,
            tls_root=_read(env["PDPROTO_TLS_ROOT"], "PDPROTO_TLS_ROOT") if env.get("PDPROTO_TLS_ROOT") else None,
            port=_number(env, "PDPROTO_PORT", cls.port, int, 0, 65535),
            staging_mb=_number(env, "PDPROTO_STAGING_MB", cls.staging_mb, int, 0, 1 << 20),
            rpc_timeout_s=_number(env, "PDPROTO_RPC_TIMEOUT_S", cls.rpc_timeout_s, float, 0.1, 3600.0),
            legacy=_flag(env, "PDPROTO_LEGACY"))


def _bad(name: str, value: str, wanted: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is not valid: expected {wanted}", reason=Reason.CONFIG_INVALID,
                       metadata={"setting": name, "value": value})


def _read(path: str, name: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise _bad(name, path, f"a readable file ({exc.strerror})") from exc


_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})


def _flag(env: Mapping[str, str], name: str) -> bool:
    """An on/off variable: 1, true, yes or on, and 0, false, no, off or unset, in any case."""
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        # A typo read as "off" would quietly leave a security or transport choice unmade.
        raise _bad(name, raw, "1, true, yes or on; 0, false, no or off")
    return False


_N = TypeVar("_N", int, float)


def _number(env: Mapping[str, str], name: str, default: _N, kind: Callable[[str], _N], low: _N, high: _N) -> _N:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise _bad(name, raw, f"a number in {low:g}..{high:g}") from None
    if not low <= value <= high:
        raise _bad(name, raw, f"a number in {low:g}..{high:g}")
    return value


__all__ = ["BackendSettings"]
