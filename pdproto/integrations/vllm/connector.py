"""``PdprotoConnector``: vLLM 0.33.0's ``KVConnectorBase_V1`` (and ``SupportsHMA``) over pdproto.

vLLM builds one instance per role (``KVConnectorFactory``, from ``kv_connector_module_path=
"pdproto.integrations.vllm"``): the SCHEDULER's decides which requests move and when their
blocks are free; each WORKER's moves the bytes (``worker.py``). The scheduler hands the
workers their work in the step's ``PdprotoMeta``; the workers report back through
``get_transfer_results``. The calls, in vLLM's order, are listed in docs/vllm.md.

Push model, as pdproto works: the producer's workers serve pdproto's handshake service over
their blocks; the consumer's workers register with every prefill rank a request names and
submit its blocks; the prefill writes them. Discovery is the request's ``kv_transfer_params``
(``params``), as with vLLM's own connectors: the router gives both sides one ``transfer_id``,
and the decode the prefill's ``remote_host``/``remote_port`` (and ``remote_tp_size``), which
the prefill also returns from ``request_finished`` for a router that sends the two in turn.
Facing an SGLang peer the router also gives SGLang's ``bootstrap_room``, which is then the room.
A prefill with ``sglang_bootstrap_port`` also serves SGLang decodes: SGLang's bootstrap server
and metadata rows (``sglang_peer.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdproto import v1
from pdproto.errors import ConfigError, Reason
from pdproto.transfer.address import advertise_host

from ..sglang.layout import host_port
from ..sglang.settings import BackendSettings
from . import layout
from .sglang_peer import BootstrapServer
from .worker import DecodeWorker, PrefillWorker, Recv, Send

if TYPE_CHECKING:  # the main virtualenv has no vLLM: the type gate checks against these stand-ins
    class KVConnectorBase_V1:
        """What the connector uses of vLLM's base class."""

        _vllm_config: Any

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            """Keeps the config (``_vllm_config``)."""

        def _get_connector_metadata(self) -> Any:
            """The step's bound metadata."""

    class KVConnectorMetadata:
        """vLLM's base of one step's connector metadata."""

    class SupportsHMA:
        """vLLM's marker base of connectors that serve its hybrid KV cache manager."""

    KVConnectorTransferResults: Any = None
else:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorTransferResults,
        SupportsHMA,
    )

log = logging.getLogger(__name__)

TIMEOUTS = {"lease_s": 30.0, "recv_timeout_s": 300.0}
"""``kv_connector_extra_config`` timeouts and their defaults (``Timeouts``)."""


@dataclass(frozen=True)
class Timeouts:
    """How long each side waits for the other."""

    lease_s: float
    """Prefill: how long a finished request's blocks wait for its decode's submit (vLLM's NIXL lease is 30 s
    too), and then for the transfer."""
    recv_timeout_s: float
    """Decode: how long a request waits for its bytes, prefill compute included (SGLang's own waiting
    timeout is 300 s); then each silent prefill rank is asked once more, and the request fails.
    Prefill: how long a decode's submit waits for the request to finish here."""

SGLANG_BOOTSTRAP = "sglang_bootstrap_port"
"""``kv_connector_extra_config`` key: a prefill serves SGLang decodes, its bootstrap server on this port."""

EXTRA_SETTINGS = {"engine": "PDPROTO_ENGINE", "port": "PDPROTO_PORT", "staging_mb": "PDPROTO_STAGING_MB",
                  "rpc_timeout_s": "PDPROTO_RPC_TIMEOUT_S"}
"""``kv_connector_extra_config`` keys and the pdproto setting each overrides (the rest come from the
environment, as for the SGLang backend: ``pdproto/integrations/sglang/settings.py``)."""


def settings_of(extra: Mapping[str, Any]) -> tuple[BackendSettings, Timeouts]:
    """The backend settings and the timeouts from ``kv_connector_extra_config`` over the environment."""
    unknown = sorted(set(extra) - set(EXTRA_SETTINGS) - set(TIMEOUTS) - {SGLANG_BOOTSTRAP})
    if unknown:
        raise ConfigError(f"kv_connector_extra_config has keys PdprotoConnector does not know: {unknown}; "
                          f"known: {sorted([*EXTRA_SETTINGS, *TIMEOUTS, SGLANG_BOOTSTRAP])}", reason=Reason.CONFIG_INVALID,
                          metadata={"setting": "kv_connector_extra_config", "value": ",".join(unknown)})
    env = {**os.environ, **{EXTRA_SETTINGS[k]: str(v) for k, v in extra.items() if k in EXTRA_SETTINGS}}
    seconds = {}
    for key, default in TIMEOUTS.items():
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600:
            raise ConfigError(f"kv_connector_extra_config {key}={value!r} is not valid: expected seconds in "
                              "(0, 3600]", reason=Reason.CONFIG_INVALID, metadata={"setting": key, "value": str(value)})
        seconds[key] = float(value)
    return BackendSettings.from_env(env), Timeouts(**seconds)


@dataclass
class PdprotoMeta(KVConnectorMetadata):
    """One step's work for the workers: requests to hold for their decode, to receive, to stop receiving."""

    sends: list[Send] = field(default_factory=list)
    recvs: list[Recv] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    """Decode requests vLLM finished (aborted) while their bytes were on the way."""


def _transfer_id(request: Any, params: Mapping[str, Any]) -> str:
    return str(params.get("transfer_id") or request.request_id)


def _room(request: Any, params: Mapping[str, Any]) -> int:
    """The request's pdproto room: an SGLang peer's ``bootstrap_room`` as is (its senders and receivers use
    that room), else one derived from the ``transfer_id`` both engines were given."""
    if params.get("bootstrap_room") is None:
        return layout.room_of(_transfer_id(request, params))
    room = params["bootstrap_room"]
    if isinstance(room, bool) or not isinstance(room, int | str) or not str(room).isdigit() \
            or int(room) >= 1 << 63:
        raise ConfigError(f"kv_transfer_params bootstrap_room={room!r} is not valid: expected SGLang's room, an "
                          "integer in [0, 2**63)", reason=Reason.CONFIG_INVALID,
                          metadata={"setting": "kv_transfer_params.bootstrap_room", "value": str(room)})
    return int(room)


def _prefill_addresses(params: Mapping[str, Any]) -> tuple[str, ...]:
    """host:port of every prefill rank the request names (rank r listens on ``remote_port + r``)."""
    try:
        host, port, tp = str(params["remote_host"]), int(params["remote_port"]), int(params.get("remote_tp_size", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"kv_transfer_params of a remote prefill need remote_host and remote_port: {exc!r}",
                          reason=Reason.CONFIG_INVALID, metadata={"setting": "kv_transfer_params"}) from exc
    return tuple(host_port(host, port + r) for r in range(max(tp, 1)))


class PdprotoConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over pdproto (module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ("kv_producer", "kv_consumer"):
            raise ConfigError(f"PdprotoConnector serves kv_role kv_producer (prefill) or kv_consumer (decode), not "
                              f"{transfer.kv_role}", reason=Reason.CONFIG_INVALID,
                              metadata={"setting": "kv_role", "value": str(transfer.kv_role)})
        self.producer = transfer.kv_role == "kv_producer"
        self.engine_id = str(transfer.engine_id)
        self.settings, self.timeouts = settings_of(dict(transfer.kv_connector_extra_config or {}))
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("PdprotoConnector does not serve pipeline parallelism yet (--pipeline-parallel-size "
                              f"{parallel.pipeline_parallel_size})", reason=Reason.CONFIG_INVALID,
                              metadata={"setting": "pipeline_parallel_size"})
        self.dcp_size = int(parallel.decode_context_parallel_size)
        self.tp_size = int(parallel.tensor_parallel_size)
        layout.refuse_interleave(int(parallel.cp_kv_cache_interleave_size), self.dcp_size)
        if self.producer and not self.settings.port:
            raise ConfigError("a PdprotoConnector prefill needs a port its decodes can be told: set "
                              "kv_connector_extra_config port (or PDPROTO_PORT); TP rank r listens on port + r",
                              reason=Reason.CONFIG_INVALID, metadata={"setting": "port"})
        self.cache = None if kv_cache_config is None else layout.check_served(kv_cache_config)
        total_heads = vllm_config.model_config.get_total_num_kv_heads() if vllm_config.model_config else 0
        if self.cache is not None and self.cache.kind != v1.ATTENTION_KIND_MLA and total_heads < self.tp_size:
            raise ConfigError(f"PdprotoConnector does not move MHA caches whose {total_heads} KV heads are replicated "
                              f"over TP {self.tp_size} (pdproto's head slicing needs each rank to hold its own heads)",
                              reason=Reason.CONFIG_INVALID,
                              metadata={"setting": "tensor_parallel_size", "value": str(self.tp_size)})
        if self.cache is not None and self.cache.kind != v1.ATTENTION_KIND_MLA and self.dcp_size > 1:
            raise ConfigError(f"PdprotoConnector moves DCP (here {self.dcp_size}) for MLA caches only: pdproto shards "
                              "a token's one latent row, not MHA heads", reason=Reason.CONFIG_INVALID,
                              metadata={"setting": "decode_context_parallel_size", "value": str(self.dcp_size)})
        self.host = advertise_host()
        self.sglang_port = _sglang_port(transfer.kv_connector_extra_config or {}, self.producer)
        self.bootstrap = None
        """SGLang's bootstrap server for this prefill (the scheduler's connector runs it)."""
        if self.sglang_port is not None and getattr(role, "name", "") == "SCHEDULER":
            self.bootstrap = BootstrapServer(self.sglang_port, rank_host=self.host, pdproto_port=self.settings.port,
                                             tp_size=self.tp_size)
        # Scheduler side.
        self._meta = PdprotoMeta()
        self._holding: set[str] = set()
        """Prefill: requests whose blocks wait for finished_sending."""
        self._receiving: set[str] = set()
        """Decode: requests handed to the workers and not yet reported received."""
        # Worker side.
        self._worker: PrefillWorker | DecodeWorker | None = None
        self._finished: set[str] = set()

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: sleep mode frees the KV cache a transfer engine has registered (vLLM refuses the pair)."""
        return False

    # -- scheduler side ---------------------------------------------------------------------

    @property
    def _backoff(self) -> int:
        """Prompt tokens the prefill leaves to the decode: with Mamba state the last one (vLLM's P/D convention,
        ``nixl/base_scheduler.py`` ``_prefill_backoff``): the prefill hands over the state after N-1 tokens and
        the decode computes token N from it."""
        return 1 if self.cache is not None and self.cache.mamba else 0

    def on_new_request(self, request: Any) -> None:
        """Prefill of a hybrid model: drop the prompt's last token (``_backoff``), once, as vLLM's NixlConnector
        does (``_truncate_request_for_prefill``); the decode recomputes it from the state after the others."""
        params = request.kv_transfer_params
        if not (self.producer and self._backoff and params and params.get("do_remote_decode")) \
                or params.get("_p_side_truncated") or request.num_prompt_tokens <= self._backoff \
                or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-self._backoff:]
        del request._all_token_ids[-self._backoff:]
        request.num_prompt_tokens -= self._backoff
        request.max_tokens = 1
        params["_p_side_truncated"] = True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Decode: the prompt tokens after the local prefix (and before the ``_backoff``), loaded asynchronously;
        otherwise none."""
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = self._loaded(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _loaded(self, request: Any) -> int:
        """Decode: the prompt tokens that come from the prefill (all but the ``_backoff``)."""
        prompt = len(request.prompt_token_ids or ())
        return prompt - self._backoff if prompt > self._backoff else prompt

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: the request's blocks after its prefix go to the workers, to submit (once)."""
        params = request.kv_transfer_params
        if self.producer or not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # a re-entry (preemption) must not submit again
        if num_external_tokens <= 0:
            return
        prefix = self._loaded(request) - num_external_tokens
        block = self._vllm_config.cache_config.block_size * self.dcp_size
        ids, state = self._blocks(blocks.get_block_ids())
        self._meta.recvs.append(Recv(request.request_id, _room(request, params),
                                     _prefill_addresses(params), ids[prefix // block:], prefix, state))
        self._receiving.add(request.request_id)

    def _blocks(self, block_ids: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A request's attention blocks, and per Mamba group its running-state block, from its ids per group."""
        if self.cache is None:
            return tuple(block_ids[0]), ()
        return (tuple(block_ids[self.cache.group]),
                tuple(g.state_block(block_ids[g.index]) for g in self.cache.mamba if block_ids[g.index]))

    def build_connector_meta(self, scheduler_output: Any) -> PdprotoMeta:
        """The work gathered since the last step."""
        meta, self._meta = self._meta, PdprotoMeta()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Without HMA: ``request_finished_all_groups`` with the one group."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: hold a finished request's blocks for its decode; the params a decode needs. Decode: a
        request aborted while its bytes were on the way is aborted on its prefill ranks (vLLM itself keeps
        its blocks until the receive is reported ended)."""
        params = request.kv_transfer_params
        if request.request_id in self._receiving:
            self._meta.cancels.append(request.request_id)
            return False, None
        if not self.producer or not params or not params.get("do_remote_decode"):
            return False, None
        blocks, state = self._blocks(block_ids)
        if request.status.name not in ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED") or not blocks:
            return False, None
        transfer_id = _transfer_id(request, params)
        tokens = int(request.num_computed_tokens)
        room = _room(request, params)
        first = request.output_token_ids[0] if request.output_token_ids else None
        self._meta.sends.append(Send(request.request_id, room, blocks, tokens, self.timeouts.lease_s, state=state,
                                     first_token=first))
        self._holding.add(request.request_id)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer_id,
                      "remote_host": self.host, "remote_port": self.settings.port, "remote_tp_size": self.tp_size,
                      "remote_num_tokens": tokens, "remote_block_size": self._vllm_config.cache_config.block_size,
                      **({} if params.get("bootstrap_room") is None else {"bootstrap_room": room})}

    def update_connector_output(self, connector_output: Any) -> None:
        """Prefill: requests whose blocks vLLM freed are no longer held; decode: received ones no longer pending."""
        self._holding -= set(connector_output.finished_sending or ())
        self._receiving -= set(connector_output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        """Keep vLLM stepping while a prefill request's blocks are held (its workers report them freed)."""
        return bool(self._holding)

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register vLLM's KV cache with a transfer engine; start the service (prefill) or the peer (decode)."""
        if self.cache is None:
            raise ConfigError("PdprotoConnector needs the KV cache config (vLLM >= 0.33 passes it)",
                              reason=Reason.CONFIG_INVALID, metadata={"setting": "kv_cache_config"})
        ranks = _worker_ranks()
        first = next(iter(kv_caches.values()))
        on_device = first.device.type != "cpu"
        gpu_id = int(first.device.index or 0) if on_device else 0
        if self.producer:
            self._worker = PrefillWorker(self.settings, self.cache, kv_caches, ranks, on_device=on_device,
                                         gpu_id=gpu_id, port=self.settings.port + ranks.tp[1],
                                         match_timeout_s=self.timeouts.recv_timeout_s,
                                         sglang_rows=self.sglang_port is not None)
        else:
            self._worker = DecodeWorker(self.settings, self.cache, kv_caches, ranks, on_device=on_device,
                                        gpu_id=gpu_id, engine_id=self.engine_id,
                                        timeout_s=self.timeouts.recv_timeout_s)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's requests to the worker: submit the receives, hold the sends."""
        meta = self._get_connector_metadata()
        if isinstance(self._worker, DecodeWorker) and (meta.recvs or meta.cancels):
            self._worker.receive(meta.recvs)
            self._worker.cancel(meta.cancels)
        elif isinstance(self._worker, PrefillWorker) and meta.sends:
            self._worker.hold(meta.sends)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: whole requests load before they run (asynchronously)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: the prefill writes whole requests once they finished."""

    def wait_for_save(self) -> None:
        """Nothing: sends are asynchronous; their blocks stay held until ``finished_sending``."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """This step's finished sends (blocks free again), receives, and failed receives."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done = self._worker.step()
        return KVConnectorTransferResults(finished_sending=done.sent, finished_recving=done.received,
                                          failed_recving=done.failed)

    def shutdown(self) -> None:
        """Stop the worker's service or peer and release its engine; stop the SGLang bootstrap server."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.close()
        bootstrap, self.bootstrap = self.bootstrap, None
        if bootstrap is not None:
            bootstrap.close()


def _sglang_port(extra: Mapping[str, Any], producer: bool) -> int | None:
    """``sglang_bootstrap_port``: where a prefill answers SGLang decodes; None when not set."""
    port = extra.get(SGLANG_BOOTSTRAP)
    if port is None:
        return None
    if not producer or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"kv_connector_extra_config {SGLANG_BOOTSTRAP}={port!r} is not valid: "
                          + ("only a prefill (kv_producer) serves SGLang decodes" if not producer
                             else "expected a TCP port"), reason=Reason.CONFIG_INVALID,
                          metadata={"setting": SGLANG_BOOTSTRAP, "value": str(port)})
    return port


def _worker_ranks() -> layout.Ranks:
    """This worker's TP, DCP and PP ranks from vLLM's process groups (one rank each when none were set up)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return layout.Ranks()
    tp, dcp, pp = ps.get_tp_group(), ps.get_dcp_group(), ps.get_pp_group()
    return layout.Ranks(tp=(tp.world_size, tp.rank_in_group), dcp=(dcp.world_size, dcp.rank_in_group),
                        pp=(pp.world_size, pp.rank_in_group))


__all__ = ["EXTRA_SETTINGS", "SGLANG_BOOTSTRAP", "TIMEOUTS", "PdprotoConnector", "PdprotoMeta", "Timeouts", "settings_of"]
