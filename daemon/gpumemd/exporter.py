"""The metrics endpoint: ``GET /metrics`` in the Prometheus text format, served by a
thread of its own with prometheus-client (the ``metrics`` extra).

The thread never touches the daemon's state. Per scrape it reads the latest snapshot
(metrics.py: a reference the daemon's thread replaces whole) and renders the families
it has not rendered before: a snapshot keeps the very objects of the families that did
not change, and prometheus-client takes a few microseconds per sample, which this
thread would spend holding the GIL the daemon's thread waits for. The process's own
figures (CPU, memory, open descriptors) are read fresh each time. One scrape at a time, each bounded by a socket
timeout, so a scraper that stalls can hold up only the next scrape, never the daemon.
"""

from __future__ import annotations

import http.server
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from gpumemd.metrics import Family, HistogramValue, Metrics, Snapshot

log = logging.getLogger("gpumemd.exporter")

SCRAPE_TIMEOUT = 10.0  # seconds a scraper may take to send its request and read the reply
_POLL = 0.5  # seconds between looks at the stop flag while no scrape comes


def _le(bound: float) -> str:
    """A bucket's bound as its ``le`` label, as prometheus-client writes its own."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _metric(family: Family) -> Metric:
    labels = list(family.labels)
    if family.kind == "histogram":
        histogram = HistogramMetricFamily(family.name, family.help, labels=labels)
        for values, value in family.samples:
            assert isinstance(value, HistogramValue)
            running, buckets = 0, []
            for bound, count in zip((*value.bounds, float("inf")), value.counts):
                running += count
                buckets.append((_le(bound), running))
            histogram.add_metric(list(values), buckets, value.sum)
        return histogram
    metric: GaugeMetricFamily | CounterMetricFamily
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=labels)
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=labels)
    for values, value in family.samples:
        assert isinstance(value, (int, float))
        metric.add_metric(list(values), value)
    return metric


class _FamilyCollector(Collector):
    def __init__(self, family: Family) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield _metric(self.family)


def _render(family: Family) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_FamilyCollector(family))
    return generate_latest(registry)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HttpServer
    timeout = SCRAPE_TIMEOUT

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "gpumemd serves /metrics")
            return
        body = self.server.render()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("scrape from %s: " + format, self.client_address[0], *args)


class _HttpServer(socketserver.TCPServer):
    # Not http.server.HTTPServer: its bind looks the host's name up (getfqdn), a DNS
    # query the daemon's start would wait on.
    allow_reuse_address = True
    render: Callable[[], bytes]

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("metrics scrape from %s failed", client_address[0], exc_info=True)


class _HttpServer6(_HttpServer):
    address_family = socket.AF_INET6


class Exporter:
    """Binds at construction (an address in use is the caller's configuration error);
    serves from ``start`` until ``close``."""

    def __init__(self, address: str, port: int) -> None:
        cls = _HttpServer6 if ":" in address else _HttpServer
        self._httpd = cls((address, port), _Handler)
        self._httpd.timeout = _POLL
        self._httpd.render = self._render
        self.address, self.port = address, int(self._httpd.server_address[1])
        self._metrics: Metrics | None = None
        self._rendered: tuple[Snapshot | None, bytes] = (None, b"")
        self._families: dict[int, tuple[Family, bytes]] = {}  # by id(): the family is kept, so its id is not reused
        self._process = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self._process)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="gpumemd-metrics", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def start(self, metrics: Metrics) -> None:
        """Serve ``metrics.snapshot``, whichever one the daemon's thread last published."""
        self._metrics = metrics
        self._thread.start()
        log.info("serving metrics at %s", self.url)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(SCRAPE_TIMEOUT + 2 * _POLL)
        self._httpd.server_close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self._httpd.handle_request()  # returns after _POLL when no scrape comes

    def _render(self) -> bytes:
        assert self._metrics is not None
        snapshot = self._metrics.snapshot  # one read of a reference replaced whole: no lock
        if snapshot is not self._rendered[0]:
            done = self._families
            self._families = {id(f): done.get(id(f)) or (f, _render(f)) for f in snapshot.families}
            self._rendered = (snapshot, b"".join(text for _, text in self._families.values()))
        return self._rendered[1] + generate_latest(self._process)
