"""A test-only HTTP fault proxy in front of an S3 endpoint (stdlib only).

``FaultProxy(target)`` listens on a free port of 127.0.0.1 and forwards every request (method,
path and query, headers, body) to ``target`` over a keep-alive HTTP/1.1 connection, one per
client connection, and streams the answer back. The ``Host`` header is forwarded as the client
sent it, so an AWS SigV4 signature computed for the proxy's address still matches the request
the endpoint sees (``Expect``, which SigV4 never signs, is answered by the proxy and dropped).

``fail()`` queues faults for the requests that match; a fault is one of:

* ``"500"``, ``"503"`` (any 4xx/5xx code): that status with an S3-style XML error body
  (503 is ``SlowDown``, 500 ``InternalError``), without reaching the endpoint;
* ``"reset"``: the connection is closed with a TCP reset, nothing answered;
* ``"delay:SECONDS"``: the request waits, then is forwarded;
* ``"truncate"``: the endpoint's status, headers and the first half of its body, then the
  connection closes (the client sees fewer bytes than ``Content-Length``);
* ``"slow:BYTES_PER_SECOND"``: the endpoint's answer, its body sent at that rate on this
  connection (a piece every ``_TICK_S`` seconds: bytes keep flowing, the whole body takes
  its size over the rate);
* ``"stall"``: the endpoint's status, headers and the first half of its body, then nothing more
  while the connection stays open (until the client closes it or the proxy stops).
"""

from __future__ import annotations

import http.client
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FaultProxy"]

_CHUNK = 1 << 20
_TICK_S = 0.05  # a slow body's pieces are this far apart
# Headers that describe one hop, not the message: never forwarded as they came.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade", "expect"}
_ERROR_CODES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


@dataclass
class _Fault:
    """One queued fault: ``kind`` for the next ``times`` matching requests after ``after`` of them."""

    kind: str
    times: int
    match: str
    method: str
    after: int

    def matches(self, method: str, path: str) -> bool:
        return (not self.method or self.method == "*" or self.method == method) and self.match in path


def _check_kind(kind: str) -> None:
    """Refuse a fault kind the proxy cannot inject (at ``fail()``, not at the request)."""
    if kind in ("reset", "truncate", "stall"):
        return
    if kind.startswith("delay:"):
        float(kind.split(":", 1)[1])
        return
    if kind.startswith("slow:") and float(kind.split(":", 1)[1]) > 0:
        return
    if kind.isdigit() and 400 <= int(kind) <= 599:
        return
    raise ValueError(
        f"unknown fault kind {kind!r}: a 4xx/5xx code, 'reset', 'delay:SECONDS', 'truncate', "
        "'slow:BYTES_PER_SECOND' or 'stall'"
    )


def _error_body(status: int, path: str) -> bytes:
    """An S3 error document for ``status`` (the shape S3 and moto answer)."""
    code, message = _ERROR_CODES.get(
        status, (http.client.responses.get(status, "Error").replace(" ", ""), "")
    )
    resource = path.split("?", 1)[0]
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{resource}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()


class _Handler(BaseHTTPRequestHandler):
    """Forwards one client connection's requests, injecting the proxy's queued faults."""

    protocol_version = "HTTP/1.1"
    server: _Server
    _upstream: http.client.HTTPConnection | None = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """Quiet: the proxy's own ``log`` records every request."""

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, False)
            self._drop_upstream()

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = do_OPTIONS = do_GET

    def _handle(self) -> None:
        try:
            self._dispatch()
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up mid-answer (its own timeout, a cancelled request): not the
            # proxy's failure, and the upstream answer is left half read.
            self._drop_upstream()
            self.close_connection = True

    def _dispatch(self) -> None:
        owner = self.server.owner
        body = self._read_body()
        fault = owner._next_fault(self.command, self.path)
        if fault is None:
            self._forward(body, record=True)
            return
        owner._record(self.command, self.path, fault.kind)
        if fault.kind == "reset":
            self._reset()
        elif fault.kind in ("truncate", "stall"):
            self._forward(body, cut=fault.kind)
        elif fault.kind.startswith("slow:"):
            self._forward(body, rate=float(fault.kind.split(":", 1)[1]))
        elif fault.kind.startswith("delay:"):
            time.sleep(float(fault.kind.split(":", 1)[1]))
            self._forward(body)
        else:
            self._answer_error(int(fault.kind))

    def _read_body(self) -> bytes:
        """The request body as it came (chunked framing kept, to be forwarded as is)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked_raw()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _read_chunked_raw(self) -> bytes:
        parts: list[bytes] = []
        while True:
            line = self.rfile.readline()
            parts.append(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = self.rfile.readline()
                    parts.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return b"".join(parts)
            parts.append(self.rfile.read(size + 2))

    def _connection(self) -> http.client.HTTPConnection:
        if self._upstream is None:
            host, port = self.server.owner._target
            self._upstream = http.client.HTTPConnection(host, port, timeout=120)
        return self._upstream

    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _send_upstream(self, body: bytes) -> http.client.HTTPResponse:
        """Send the request upstream; one retry on a fresh connection if the kept-alive one died."""
        for attempt in (0, 1):
            conn = self._connection()
            try:
                conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        conn.putheader(name, value)
                conn.endheaders(body if body else None)
                return conn.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self._drop_upstream()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _forward(self, body: bytes, record: bool = False, cut: str = "", rate: float = 0.0) -> None:
        """Forward the request and stream the answer back.

        With ``record``, the endpoint's status goes to the proxy's log before the client can
        see the answer (a client that reads the log after its response finds its request).
        ``cut`` (``"truncate"``, ``"stall"``): only the first half of the body is sent, then the
        connection closes or hangs; ``rate``: the body goes at that many bytes per second.
        """
        try:
            response = self._send_upstream(body)
        except OSError:
            self._drop_upstream()
            response = None
        if record:
            self.server.owner._record(self.command, self.path, response.status if response else 502)
        if response is None:
            self._answer_error(502)
            return
        length_header = response.getheader("Content-Length")
        chunked = length_header is None and self.command != "HEAD" and response.status not in (204, 304)
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "transfer-encoding":
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        if cut:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command == "HEAD" or response.status in (204, 304):
            response.read()
        elif cut:
            self._copy_half(response, int(length_header) if length_header else None)
            self._drop_upstream()
            self.close_connection = True
            if cut == "stall":
                self._hang()
        else:
            self._copy(response, chunked, rate)
        if response.will_close:
            self._drop_upstream()

    def _copy(self, response: http.client.HTTPResponse, chunked: bool, rate: float = 0.0) -> None:
        """The body as it comes; at ``rate`` bytes per second when given (a piece per tick)."""
        piece = max(1, int(rate * _TICK_S)) if rate else _CHUNK
        while block := response.read(piece):
            if rate:
                time.sleep(_TICK_S)
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
            else:
                self.wfile.write(block)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _copy_half(self, response: http.client.HTTPResponse, length: int | None) -> None:
        """The first half of the body (of ``Content-Length``, or of all of it when unknown)."""
        if length is None:
            data = response.read()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data) // 2, data[: len(data) // 2]))
            return
        left = length // 2
        while left > 0 and (block := response.read(min(_CHUNK, left))):
            self.wfile.write(block)
            left -= len(block)

    def _hang(self) -> None:
        """Hold the connection open, sending nothing, until the client closes it or the proxy stops."""
        while not self.server.owner._stopping.is_set():
            ready, _, _ = select.select([self.connection], [], [], _TICK_S)
            try:
                if ready and not self.connection.recv(1 << 16):
                    return
            except OSError:
                return

    def _answer_error(self, status: int) -> None:
        payload = _error_body(status, self.path)
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        if status == 503:
            self.send_header("Retry-After", "0")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _reset(self) -> None:
        """Close the client connection with a TCP RST (SO_LINGER 0), answering nothing."""
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self._drop_upstream()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: FaultProxy


class FaultProxy:
    """A fault-injecting HTTP proxy on 127.0.0.1 in front of ``target``.

    Attributes:
        url: the proxy's address, ``http://127.0.0.1:PORT``; point the client's endpoint here.

    Example:
        >>> with FaultProxy(s3.url) as proxy:
        ...     proxy.fail("503", times=2, match="model.safetensors")
        ...     store = S3Store("bkt", **{**s3.storage_options, "endpoint": proxy.url})
    """

    def __init__(self, target: str) -> None:
        """Start forwarding to ``target`` (``http://host:port``)."""
        parts = urlsplit(target)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"FaultProxy forwards to an http://host:port endpoint, not {target!r}")
        self._target = (parts.hostname, parts.port or 80)
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._requests = 0
        self._injected = 0
        self._log: list[tuple[str, str, int | str]] = []
        self._clients: set[socket.socket] = set()
        self._stopping = threading.Event()  # a stalled answer hangs until the proxy stops
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="FaultProxy", daemon=True
        )
        self._thread.start()
        self._stopped = False
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def fail(self, kind: str, times: int = 1, match: str = "", method: str = "GET", after: int = 0) -> None:
        """Queue ``kind`` for the next ``times`` requests matching ``method`` and ``match``.

        Args:
            kind: ``"500"``/``"503"`` (any 4xx/5xx), ``"reset"``, ``"delay:SECONDS"``, ``"truncate"``,
                ``"slow:BYTES_PER_SECOND"``, ``"stall"``.
            times: how many matching requests get the fault.
            match: a substring of the request's path and query ("" matches every path).
            method: the HTTP method it applies to ("" or "*": any).
            after: let this many matching requests through first.
        """
        _check_kind(kind)
        if times < 1 or after < 0:
            raise ValueError(f"times >= 1 and after >= 0, not times={times} after={after}")
        with self._lock:
            self._faults.append(_Fault(kind, times, match, method.upper(), after))

    def clear(self) -> None:
        """Drop every queued fault (counters and log stay)."""
        with self._lock:
            self._faults.clear()

    @property
    def requests(self) -> int:
        """Requests seen, faulted or not."""
        with self._lock:
            return self._requests

    @property
    def faults(self) -> int:
        """Faults injected."""
        with self._lock:
            return self._injected

    @property
    def log(self) -> list[tuple[str, str, int | str]]:
        """(method, path, the endpoint's status or the fault's kind) per request, in arrival order."""
        with self._lock:
            return list(self._log)

    def _next_fault(self, method: str, path: str) -> _Fault | None:
        """The fault this request gets, if any: the first queued one past its ``after``.

        Every matching fault still letting requests through counts this one; a fault is used up
        after ``times`` requests.
        """
        with self._lock:
            self._requests += 1
            chosen: _Fault | None = None
            for fault in self._faults:
                if not fault.matches(method, path):
                    continue
                if fault.after > 0:
                    fault.after -= 1
                elif chosen is None:
                    chosen = fault
            if chosen is not None:
                chosen.times -= 1
                if chosen.times == 0:
                    self._faults.remove(chosen)
                self._injected += 1
            return chosen

    def _record(self, method: str, path: str, outcome: int | str) -> None:
        with self._lock:
            self._log.append((method, path, outcome))

    def _track(self, conn: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._clients.add(conn)
            else:
                self._clients.discard(conn)

    def stop(self) -> None:
        """Stop listening and close every client connection (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            clients = list(self._clients)
        for conn in clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
