"""Prometheus metrics of the handshake service (one registry per service instance)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Negotiation is pure Python over small messages: tens of microseconds to milliseconds.
_NEGOTIATION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


@dataclass
class ServiceMetrics:
    """Counters and histograms the service updates; ``registry`` is what gets exported."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.registrations = Counter(
            "pdproto_registrations", "Register calls by outcome (accepted or the rejection reason).",
            ["outcome"], registry=r)
        self.peers = Gauge("pdproto_peers", "Currently registered decode peers.", registry=r)
        self.outcomes: dict[str, int] = {}
        """Finished requests by outcome since start (what ``pdproto_requests`` exports)."""
        self.open_requests: Callable[[], int] = lambda: 0
        """Open transfer requests now (what ``pdproto_requests_inflight`` exports; the runner sets it)."""
        r.register(_PerRequest(self))
        self.negotiation_seconds = Histogram(
            "pdproto_negotiation_seconds",
            "Time spent in topology negotiation per Register.",
            buckets=_NEGOTIATION_BUCKETS, registry=r)
        self.bytes_moved = Counter("pdproto_kv_bytes", "KV bytes written into decode memory.", registry=r)
        self.descriptors = Counter(
            "pdproto_transfer_descriptors", "Transfer descriptors issued to the executor.", registry=r)
        self.chunks = Counter("pdproto_chunks", "KV chunks transferred (per destination peer).", registry=r)
        self.inline_jobs = Counter(
            "pdproto_inline_jobs",
            "KV chunks packed inline and sent as one engine call (at most --inline-bytes; the rest pipeline).",
            registry=r)
        self.pack_fallbacks = Counter(
            "pdproto_pack_fallbacks",
            "Jobs that asked for packing but ran with per-row descriptors (staging too small).",
            registry=r)
        self.aux_bytes = Counter("pdproto_aux_bytes", "Aux (metadata) bytes written into decode memory.",
                                 registry=r)
        self.state_bytes = Counter("pdproto_state_bytes", "State bytes written into decode memory.", registry=r)
        self.extra_descriptors = Counter(
            "pdproto_extra_descriptors", "Transfer descriptors issued for aux and state, by kind.", ["kind"],
            registry=r)
        self.state_items = Counter(
            "pdproto_state_items",
            "State items (one slot or page of one tensor) written, by how TP splits the tensor: whole"
            " (equal TP sizes), sliced (this rank's part), replicated (whole on every prefill rank and"
            " written by one of them per destination).", ["split"], registry=r)
        self.notifications = Counter(
            "pdproto_chunk_notifications", "Per-chunk completion notifications delivered through the engine.",
            registry=r)
        self.session_streams = Gauge("pdproto_session_streams", "Session streams being served.", registry=r)
        self.snapshots_refused = Counter(
            "pdproto_snapshots_refused",
            "Status streams (WatchStatus, new or resumed sessions) and Describe calls refused because their peer"
            " asked for more statuses than --snapshot-rate allows (TOO_MANY_STREAMS, with the seconds to wait).",
            registry=r)
        self.legacy_peers = Gauge("pdproto_legacy_peers", "Registered decode peers that speak SGLang's Mooncake "
                                  "frames (the legacy listener).", registry=r)
        self.legacy_frames = Counter(
            "pdproto_legacy_frames", "SGLang Mooncake messages the legacy listener received, by kind and outcome "
            "(ACCEPTED, or the reason it refused them).", ["kind", "outcome"], registry=r)
        self._registration_children: dict[str, Any] = {}

    def finished(self, outcome: str) -> None:
        """Count one finished request ("SUCCESS" or its failure reason)."""
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def registered(self, outcome: str) -> None:
        """Count one Register call ("ACCEPTED" or the rejection reason); the labelled child is looked up once."""
        children = self._registration_children
        child = children.get(outcome)
        if child is None:
            child = children[outcome] = self.registrations.labels(outcome=outcome)
        child.inc()


class _PerRequest(Collector):
    """``pdproto_requests`` and ``pdproto_requests_inflight``, read from plain counts when scraped.

    Both change on every request, on the event loop; a prometheus_client child takes a lock
    per change, about 5 % of the server's CPU per request at 32 peers (docs/perf-log.md).
    A scrape (another thread) copies the dict in one C call under the GIL.
    """

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        """The two families, as of now."""
        done = CounterMetricFamily("pdproto_requests", "Finished transfer requests by outcome (SUCCESS or the"
                                   " failure reason).", labels=["outcome"])
        for outcome, count in list(self.metrics.outcomes.items()):
            done.add_metric([outcome], count)
        yield done
        yield GaugeMetricFamily("pdproto_requests_inflight", "Open transfer requests.",
                                value=self.metrics.open_requests())


def serve_metrics(metrics: ServiceMetrics, port: int, host: str = "127.0.0.1") -> int:
    """Expose the registry over HTTP on host:port (0 picks a port); returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    bound: int = server.server_address[1]
    return bound


__all__ = ["ServiceMetrics", "serve_metrics"]
