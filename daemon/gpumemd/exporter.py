"""The metrics endpoint: ``GET /metrics`` in the Prometheus text format (0.0.4), or in
OpenMetrics to a scraper whose Accept header asks for ``application/openmetrics-text``;
served by a thread of its own; prometheus-client (the ``metrics`` extra) renders the
families.

The thread never touches the daemon's state. Per scrape it reads the latest snapshot
(metrics.py: a reference the daemon's thread replaces whole) and renders the families
it has not rendered before: a snapshot keeps the very objects of the families that did
not change, and prometheus-client takes a few microseconds per sample, which this
thread would spend holding the GIL the daemon's thread waits for. The process's own
figures (CPU, memory, open descriptors) are read fresh each time.

Anyone who reaches the port may connect, so no connection may hold up another: the
thread serves every connection at once from one selector, never blocking on one. A
connection has SCRAPE_TIMEOUT from its accept to send its request and read the whole
reply, whatever it trickles meanwhile; one request per connection (``Connection:
close``). At most MAX_CONNECTIONS are open: the next one closes the oldest.
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from gpumemd.metrics import Family, HistogramValue, Metrics, Snapshot

log = logging.getLogger("gpumemd.exporter")

SCRAPE_TIMEOUT = 10.0  # seconds from a connection's accept to the end of its reply
MAX_CONNECTIONS = 64
MAX_REQUEST = 8192  # bytes of request line and headers; a GET has no body
_POLL = 0.5  # seconds between looks at the stop flag while nothing happens
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 431: "Request Header Fields Too Large",
            500: "Internal Server Error"}


TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_EOF = b"# EOF\n"  # OpenMetrics' last line: once per exposition, after every family


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


def _exposition(registry: CollectorRegistry, content_type: str) -> bytes:
    """The registry's families in the format, without OpenMetrics' closing line."""
    if content_type == OPENMETRICS:
        text: bytes = openmetrics.generate_latest(registry)  # type: ignore[no-untyped-call]
        return text.removesuffix(_EOF)
    return generate_latest(registry)


def _render(family: Family, content_type: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_FamilyCollector(family))
    return _exposition(registry, content_type)


def negotiate(head: bytes) -> str:
    """The format a request's Accept header asks for: OpenMetrics if it names it at all
    (Prometheus lists it first, with a higher q, when it wants it), else text 0.0.4."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"accept":
            continue
        for media in value.split(b","):
            if media.split(b";", 1)[0].strip().lower() == b"application/openmetrics-text":
                return OPENMETRICS
    return TEXT


def _response(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclasses.dataclass(eq=False)
class _Connection:
    sock: socket.socket
    peer: str
    deadline: float
    request: bytearray = dataclasses.field(default_factory=bytearray)
    reply: memoryview | None = None  # what is left to send, once the request is in


class Exporter:
    """Binds at construction (an address in use is the caller's configuration error);
    serves from ``start`` until ``close``."""

    def __init__(self, address: str, port: int) -> None:
        self._listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((address, port))
            self._listener.listen(MAX_CONNECTIONS)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.address, self.port = address, int(self._listener.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._connections: dict[int, _Connection] = {}  # by fd, oldest first
        self._metrics: Metrics | None = None
        # Per format: the snapshot last rendered, its text, and each family's text by id()
        # (the family is kept with it, so its id is not reused).
        self._rendered: dict[str, tuple[Snapshot | None, bytes]] = {TEXT: (None, b""), OPENMETRICS: (None, b"")}
        self._families: dict[str, dict[int, tuple[Family, bytes]]] = {TEXT: {}, OPENMETRICS: {}}
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
            self._thread.join(2 * _POLL + 1.0)
        for conn in list(self._connections.values()):
            self._drop(conn)
        self._selector.close()
        self._listener.close()

    # ------------------------------------------------------------------ the loop

    def _serve(self) -> None:
        while not self._stop.is_set():
            first = next(iter(self._connections.values()), None)  # the first deadline
            wait = _POLL if first is None else min(_POLL, max(first.deadline - time.monotonic(), 0.0))
            for key, events in self._selector.select(wait):
                if key.fileobj is self._listener:
                    self._accept()
                    continue
                conn = self._connections.get(key.fd)
                if conn is None or conn is not key.data:  # dropped by what ran before it
                    continue
                try:
                    if events & selectors.EVENT_READ:
                        self._read(conn)
                    else:
                        self._write(conn)
                except OSError as exc:
                    log.debug("metrics connection from %s failed: %s", conn.peer, exc)
                    self._drop(conn)
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        for conn in list(self._connections.values()):
            if conn.deadline > now:  # deadlines come in accept order
                return
            log.debug("metrics connection from %s took more than %gs: closed", conn.peer, SCRAPE_TIMEOUT)
            self._drop(conn)

    def _accept(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of descriptors: the connection waits in the backlog
            log.warning("metrics endpoint cannot accept a connection: %s", exc)
            return
        if len(self._connections) >= MAX_CONNECTIONS:
            oldest = next(iter(self._connections.values()))
            log.debug("metrics connections at their limit of %d: the oldest, from %s, closed", MAX_CONNECTIONS, oldest.peer)
            self._drop(oldest)
        sock.setblocking(False)
        conn = _Connection(sock, str(peer[0]), time.monotonic() + SCRAPE_TIMEOUT)
        self._connections[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: _Connection) -> None:
        data = conn.sock.recv(MAX_REQUEST)
        if not data:
            self._drop(conn)
            return
        conn.request += data
        end = conn.request.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.request) > MAX_REQUEST:
                self._reply(conn, _response(431, b"request headers too large\n"))
            return
        self._reply(conn, self._answer(conn, bytes(conn.request[:end])))

    def _answer(self, conn: _Connection, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, b"not an HTTP request\n")
        method, target = parts[0], parts[1]
        log.debug("scrape from %s: %s %s", conn.peer, method.decode("latin-1"), target.decode("latin-1"))
        if target.split(b"?", 1)[0] != b"/metrics":
            return _response(404, b"gpumemd serves /metrics\n")
        if method != b"GET":
            return _response(405, b"GET /metrics\n")
        try:
            content_type = negotiate(head)
            return _response(200, self._render(content_type), content_type)
        except Exception:  # a scrape must never take the exporter down
            log.warning("metrics scrape from %s failed", conn.peer, exc_info=True)
            return _response(500, b"rendering the metrics failed; see gpumemd's log\n")

    def _reply(self, conn: _Connection, response: bytes) -> None:
        conn.reply = memoryview(response)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        assert conn.reply is not None
        sent = conn.sock.send(conn.reply)
        conn.reply = conn.reply[sent:]
        if not conn.reply:
            self._drop(conn)

    def _drop(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock.fileno(), None) is None:
            return
        self._selector.unregister(conn.sock)
        conn.sock.close()

    def _render(self, content_type: str) -> bytes:
        assert self._metrics is not None
        snapshot = self._metrics.snapshot  # one read of a reference replaced whole: no lock
        rendered = self._rendered[content_type]
        if snapshot is not rendered[0]:
            done = self._families[content_type]
            families = self._families[content_type] = {
                id(f): done.get(id(f)) or (f, _render(f, content_type)) for f in snapshot.families
            }
            rendered = self._rendered[content_type] = (snapshot, b"".join(text for _, text in families.values()))
        tail = _EOF if content_type == OPENMETRICS else b""
        return rendered[1] + _exposition(self._process, content_type) + tail
