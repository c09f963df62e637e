"""SGLang plugin entry point: makes ``--disaggregation-transfer-backend pdproto`` selectable.

SGLang 0.5.23 discovers ``register`` through the ``sglang.srt.plugins`` entry point
(pyproject.toml) and calls it from ``load_plugins()``, which every SGLang process runs
before it parses arguments or builds a scheduler (launch_server.py:79, cli/serve.py:207,
entrypoints/engine.py:286, managers/scheduler.py:6323). ``load_plugins`` then applies the
registered hooks (``HookRegistry.apply_hooks``), which also rebinds every module that took
the hooked name with ``from ... import``. Without the plugin nothing in SGLang changes.

SGLang knows its transfer backends by name in five places; each gets one hook:

* the ``--disaggregation-transfer-backend`` choices: extended with ``pdproto``;
* ``TransferBackend`` (an Enum, ``disaggregation/utils.py:681``): replaced by an Enum with
  the same members plus ``PDPROTO``, so ``TransferBackend("pdproto")`` resolves;
* ``get_kv_class`` (``disaggregation/utils.py:719``): wrapped so that ``pdproto`` maps each
  ``KVClassType`` to the classes in ``KV_CLASSES``; every other backend, and the shared
  ``KVArgs``, still come from SGLang's own function;
* the decode-DCP check in ``handle_pd_disaggregation`` (``arg_groups/pd_disaggregation_hook.py:82-96``),
  which names the backends it trusts: overridden through SGLang's resolution-hook
  registry so a ``pdproto`` decode with ``--dcp-size`` > 1 passes it, while every other
  decision of that step still applies;
* two checks in ``handle_model_specific_adjustments``, the step's only uses of the backend name
  but for Qwen4-Exp's ``== "mori"`` (``model_overrides/qwen4_exp.py:30``), which a stand-in does
  not change: the DSA cache layer split (``arg_groups/model_hook.py:393-408``) allows only
  ``mooncake`` (its all-CP-rank transfer, which pdproto serves: ``layout.Ranks.cp_layers``), and
  DeepSeek-V4.1's DSpark PD (``validate_deepseek_v41_features``, ``deepseek_v4_hook.py:355-382``)
  only ``mooncake`` or ``nixl`` (pdproto moves its pool: ``layout``'s module docstring). The step
  runs with the same stand-in for a ``pdproto`` prefill with ``--enable-dsa-cache-layer-split``
  and for a ``pdproto`` PD server of DeepSeek-V4.1 with a speculative algorithm; every other
  condition of both checks (static verify, DCP 1, CP 1 on decode, the model's other V4.1 rules)
  still applies.
"""

from __future__ import annotations

import importlib
import logging
from enum import Enum
from typing import Any, Callable

logger = logging.getLogger(__name__)

BACKEND = "pdproto"
"""The name operators pass to ``--disaggregation-transfer-backend``."""

KV_CLASSES: dict[str, str] = {
    "manager": "pdproto.integrations.sglang.manager:PdprotoKVManager",
    "sender": "pdproto.integrations.sglang.sender:PdprotoKVSender",
    "receiver": "pdproto.integrations.sglang.receiver:PdprotoKVReceiver",
    "bootstrap_server": "pdproto.integrations.sglang.bootstrap:PdprotoKVBootstrapServer",
}
"""``KVClassType`` value -> ``module:Class``, imported on first lookup. ``kvargs`` is absent
on purpose: every backend shares SGLang's own ``KVArgs`` (utils.py:722-726)."""

_TRANSFER_BACKEND = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
_PD_STEP = "handle_pd_disaggregation"
_MODEL_STEP = "handle_model_specific_adjustments"
# A backend SGLang's decode-DCP and layer-split checks name; see _as_stand_in.
_STAND_IN = "mooncake"

_registered = False


def register() -> None:
    """Entry point SGLang calls from ``load_plugins()``; registering twice is a no-op."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.disaggregation import utils as disagg_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    original: type[Enum] = disagg_utils.TransferBackend
    if BACKEND not in {member.value for member in original}:
        HookRegistry.register(_TRANSFER_BACKEND, extend_transfer_backend(original), HookType.REPLACE)
    HookRegistry.register(_GET_KV_CLASS, get_kv_class_hook, HookType.AROUND)
    register_resolution_hook(_PD_STEP)(pd_disaggregation_step)
    register_resolution_hook(_MODEL_STEP)(model_step)
    _registered = True
    logger.info("pdproto: registered SGLang transfer backend %r", BACKEND)


def extend_transfer_backend(original: type[Enum]) -> type[Enum]:
    """``original``'s members plus ``PDPROTO``, under the same module and name.

    SGLang compares members by identity (``transfer_backend == TransferBackend.MOONCAKE``),
    so the whole class is replaced (``HookType.REPLACE``) rather than given a stray member;
    every module then holds the new class, and every member is created from it.
    """
    members = {member.name: member.value for member in original}
    members["PDPROTO"] = BACKEND
    extended = Enum(  # type: ignore[misc]
        original.__name__, members, module=original.__module__, qualname=original.__qualname__
    )
    extended.__doc__ = original.__doc__
    return extended


def is_pdproto(transfer_backend: object) -> bool:
    """Whether ``transfer_backend`` (a ``TransferBackend`` member or its value) names pdproto."""
    return getattr(transfer_backend, "value", transfer_backend) == BACKEND


def resolve_kv_class(class_type_value: str) -> type | None:
    """pdproto's class for one ``KVClassType`` value, or None for a type it has no class for."""
    target = KV_CLASSES.get(class_type_value)
    if target is None:
        return None
    module_name, _, class_name = target.partition(":")
    cls: type = getattr(importlib.import_module(module_name), class_name)
    return cls


def get_kv_class_hook(
    original: Callable[[Any, Any], type | None], transfer_backend: Any, class_type: Any
) -> type | None:
    """AROUND hook on ``get_kv_class``: pdproto's classes for pdproto, SGLang's otherwise."""
    class_type_value = getattr(class_type, "value", class_type)
    if not is_pdproto(transfer_backend) or class_type_value == "kvargs":
        return original(transfer_backend, class_type)
    return resolve_kv_class(class_type_value)


def pd_disaggregation_step(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution hook around SGLang's ``handle_pd_disaggregation``.

    The step rejects a decode with ``dcp_size > 1`` unless the backend is one it names
    (pd_disaggregation_hook.py:82-96). pdproto plans the dense-to-DCP relayout itself, so
    for that one case the step runs with a DCP-capable backend name declared for its
    duration, and pdproto's name is declared again afterwards (SGLang's declarations are
    last-writer-wins). Everything else the step decides (radix cache, extra slots,
    role-switch and allocation-policy checks) applies unchanged; outside that case the
    step runs untouched.
    """
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.environ import envs

    cfg = resolving_view(server_args)
    if not (
        is_pdproto(cfg.disaggregation_transfer_backend)
        and cfg.disaggregation_mode == "decode"
        and cfg.dcp_size > 1
    ):
        previous(server_args)
        return
    if envs.SGLANG_DISAGG_STAGING_BUFFER.get():
        # The step would reject this after the DCP check; the stand-in name must not hide it.
        raise ValueError(
            "SGLANG_DISAGG_STAGING_BUFFER requires disaggregation_transfer_backend="
            f"'mooncake' or 'nixl', got '{BACKEND}'."
        )
    _as_stand_in(server_args, previous)


def model_step(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Resolution hook around SGLang's ``handle_model_specific_adjustments``: a ``pdproto`` prefill with the
    DSA cache layer split, or a ``pdproto`` DeepSeek-V4.1 PD server with speculation (DSpark), passes the
    step's checks of the backend name (module docstring); otherwise untouched."""
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view
    from sglang.srt.connector import ConnectorType
    from sglang.srt.utils.common import parse_connector_type

    cfg = resolving_view(server_args)
    if is_pdproto(cfg.disaggregation_transfer_backend) and (cfg.enable_dsa_cache_layer_split or (
            cfg.disaggregation_mode != "null" and cfg.speculative_algorithm is not None
            # An instance connector has no config to read (the step itself returns early for it).
            and parse_connector_type(cfg.model_path) != ConnectorType.INSTANCE
            and model_config_of(server_args).hf_config.model_type == "deepseek_v41")):
        _as_stand_in(server_args, previous)
    else:
        previous(server_args)


def _as_stand_in(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Run a resolution step with ``_STAND_IN`` declared as the backend, then pdproto's name again (SGLang's
    declarations are last-writer-wins)."""
    from sglang.srt.arg_groups.overrides import declare_resolution

    declare_resolution(server_args, "pdproto plugin", disaggregation_transfer_backend=_STAND_IN)
    try:
        previous(server_args)
    finally:
        declare_resolution(server_args, "pdproto plugin", disaggregation_transfer_backend=BACKEND)
