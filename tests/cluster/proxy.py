"""A fault-injecting HTTPS proxy in front of the local kube-apiserver.

Tests point a client at the proxy (``proxy.write_kubeconfig(...)``) and tell it what to break next::

    with FaultProxy.for_cluster(kube_cluster.info) as proxy:
        proxy.fail_next(2, status=429, retry_after=1)          # answered by the proxy with a Kubernetes Status
        proxy.drop_next(1)                                     # connection reset, no response
        proxy.stall_next(1, seconds=5)                         # forwarded after a delay
        proxy.cut_watch_next(1, after_events=2)                # watch stream broken off after 2 events
        proxy.expire_watch_next(1)                             # watch answered with an ERROR event, 410 Expired
        proxy.requests                                         # what arrived, and which fault each one got

Design, chosen for being hard to get wrong rather than fast:
- TLS is terminated with the apiserver's own generated certificate and key (``certs/apiserver.{crt,key}``, SAN
  127.0.0.1), so the cluster's kubeconfig CA verifies the proxy too; only the server URL differs.
- One request per client connection: the proxy reads the request head, rewrites ``Connection: close`` and then pipes
  bytes both ways. The apiserver then answers with ``Connection: close`` and closes after the response, so the proxy
  never has to parse response framing to find the next request; clients simply reconnect. Request bodies, chunked
  responses and upgrades pass through untouched.
- Only a cut watch parses the response: the chunked body is re-chunked event by event (watch events are
  newline-delimited JSON), so a cut after K events lands exactly on an event boundary.
- It runs on its own event loop in a daemon thread, so a synchronous test (the blocking ``kubernetes`` client) and an
  asyncio test can both use it from the same process. Faults are consumed in order of arrival of matching requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http
import json
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from tests.cluster.control_plane import ClusterInfo

FaultKind = Literal["status", "drop", "stall", "cut_watch", "expire_watch"]

# Go's strconv.ParseBool spellings: the sync client sends `watch=True`, others `watch=true` or `watch=1`.
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}

# Kubernetes StatusReason for the codes a test is likely to inject (metav1.StatusReason*).
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    502: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}

_MAX_HEAD = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class Match:
    """Which requests a fault applies to; ``None`` means "any"."""

    method: str | None = None
    path_contains: str | None = None
    #: The path (without the query) ends with this: ``/pods/x`` matches the pod, not ``/pods/x/log``.
    path_endswith: str | None = None
    watch: bool | None = None
    #: A query parameter and its value: ``("follow", "true")`` matches a followed log, not a read of it.
    query: tuple[str, str] | None = None

    def __call__(self, request: ProxiedRequest) -> bool:
        return (
            (self.query is None or self.query[1] in request.query.get(self.query[0], []))
            and (self.method is None or request.method == self.method.upper())
            and (self.path_contains is None or self.path_contains in request.path)
            and (self.path_endswith is None or request.path.endswith(self.path_endswith))
            and (self.watch is None or request.watch == self.watch)
        )


ANY = Match()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxiedRequest:
    """One request as the proxy saw it, and the fault it received (``None``: forwarded unchanged)."""

    method: str
    path: str
    query: dict[str, list[str]]
    watch: bool
    fault: FaultKind | None
    at: float


@dataclasses.dataclass(kw_only=True)
class _Rule:
    kind: FaultKind
    remaining: int
    match: Callable[[ProxiedRequest], bool]
    status: int = 503
    retry_after: int | None = None
    seconds: float = 0.0
    after_events: int | None = None
    after_bytes: int | None = None
    clean: bool = False


class FaultProxy:
    """HTTPS proxy on 127.0.0.1 that forwards to the apiserver unless told to misbehave for the next N requests."""

    def __init__(
        self,
        *,
        upstream_host: str,
        upstream_port: int,
        cert_file: Path,
        key_file: Path,
        ca_file: Path,
        port: int = 0,
    ) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._ca_file = Path(ca_file)
        self._server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._server_tls.load_cert_chain(str(cert_file), str(key_file))
        # Offer only HTTP/1.1: the proxy parses HTTP/1.1 and must not let kubectl (Go) negotiate h2.
        self._server_tls.set_alpn_protocols(["http/1.1"])
        self._client_tls = ssl.create_default_context(cafile=str(ca_file))
        self._client_tls.set_alpn_protocols(["http/1.1"])
        self._requested_port = port
        self._lock = threading.Lock()
        self._rules: list[_Rule] = []
        self._requests: list[ProxiedRequest] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    @classmethod
    def for_cluster(cls, info: ClusterInfo) -> FaultProxy:
        return cls(
            upstream_host="127.0.0.1",
            upstream_port=info.api_port,
            cert_file=info.cert_file,
            key_file=info.key_file,
            ca_file=info.ca_file,
        )

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        if self._thread is not None:
            return self
        ready = threading.Event()
        error: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._handle, "127.0.0.1", self._requested_port, ssl=self._server_tls, limit=_MAX_HEAD
                    )
                )
                self.port = self._server.sockets[0].getsockname()[1]
            except BaseException as e:  # reported to start()'s caller
                error.append(e)
                ready.set()
                loop.close()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"fault-proxy->{self._upstream[1]}", daemon=True)
        self._thread.start()
        ready.wait(10)
        if error:
            self._thread = None
            raise error[0]
        return self

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        thread.join(10)
        self._thread = self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- what to break -----------------------------------------------------------------------------------------

    def fail_next(self, n: int = 1, *, status: int = 503, retry_after: int | None = None, match: Match = ANY) -> None:
        """Answer the next ``n`` matching requests with ``status`` and a Kubernetes Status body, without forwarding.

        ``retry_after`` adds a ``Retry-After`` header and ``details.retryAfterSeconds`` (as the apiserver does for
        429 and some 503s).
        """
        self._add(_Rule(kind="status", remaining=n, match=match, status=status, retry_after=retry_after))

    def drop_next(self, n: int = 1, *, match: Match = ANY) -> None:
        """Reset the connection of the next ``n`` matching requests after reading the request, with no response."""
        self._add(_Rule(kind="drop", remaining=n, match=match))

    def stall_next(self, n: int = 1, *, seconds: float, match: Match = ANY) -> None:
        """Hold the next ``n`` matching requests for ``seconds`` before forwarding them (to trip client timeouts)."""
        self._add(_Rule(kind="stall", remaining=n, match=match, seconds=seconds))

    def cut_watch_next(
        self,
        n: int = 1,
        *,
        after_events: int | None = 1,
        after_bytes: int | None = None,
        clean: bool = False,
        match: Match = Match(watch=True),
    ) -> None:
        """Break off the next ``n`` matching (by default: watch) responses after ``after_events`` events or
        ``after_bytes`` body bytes, whichever comes first.

        ``clean=False`` resets the connection mid-stream (a network failure: the client sees an error);
        ``clean=True`` ends the chunked body properly (like an apiserver watch timeout: the stream just ends).
        """
        if after_events is None and after_bytes is None:
            raise ValueError("cut_watch_next needs after_events or after_bytes")
        self._add(
            _Rule(
                kind="cut_watch",
                remaining=n,
                match=match,
                after_events=after_events,
                after_bytes=after_bytes,
                clean=clean,
            )
        )

    def expire_watch_next(self, n: int = 1, *, match: Match = Match(watch=True)) -> None:
        """Answer the next ``n`` matching (by default: watch) requests as the watch cache answers a resourceVersion
        it no longer holds: HTTP 200 with one ``ERROR`` event carrying a 410 ``Expired`` Status, then end of stream.

        The real server does this only once its watch window has moved past the version, which for built-in
        resources needs minutes of churn (1.20 sizes the window dynamically); this makes the relist path testable.
        """
        self._add(_Rule(kind="expire_watch", remaining=n, match=match))

    def clear(self) -> None:
        """Forget pending faults and the request log."""
        with self._lock:
            self._rules.clear()
            self._requests.clear()

    @property
    def requests(self) -> list[ProxiedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def pending_faults(self) -> int:
        with self._lock:
            return sum(r.remaining for r in self._rules)

    def write_kubeconfig(
        self, path: Path, *, token: str, user: str = "via-proxy", namespace: str | None = None
    ) -> Path:
        """A kubeconfig that reaches the apiserver through this proxy (same CA, same token semantics)."""
        from tests.cluster.control_plane import write_kubeconfig

        return write_kubeconfig(
            Path(path), server=self.url, ca_file=self._ca_file, token=token, user=user, namespace=namespace
        )

    def _add(self, rule: _Rule) -> None:
        if rule.remaining < 1:
            raise ValueError(f"n must be >= 1, got {rule.remaining}")
        with self._lock:
            self._rules.append(rule)

    def _take(self, request: ProxiedRequest) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.remaining > 0 and rule.match(request):
                    rule.remaining -= 1
                    if rule.remaining == 0:
                        self._rules.remove(rule)
                    self._requests.append(dataclasses.replace(request, fault=rule.kind))
                    return rule
            self._requests.append(request)
            return None

    # -- the proxy ---------------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream_writer: asyncio.StreamWriter | None = None
        try:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ssl.SSLError):
                return
            request_line, headers = _parse_head(head)
            method, target, _version = request_line
            url = urlsplit(target)
            query = parse_qs(url.query)
            request = ProxiedRequest(
                method=method,
                path=url.path,
                query=query,
                watch=any(v in _TRUE for v in query.get("watch", [])),
                fault=None,
                at=time.time(),
            )
            rule = self._take(request)

            if rule is not None and rule.kind == "drop":
                writer.transport.abort()  # RST, no TLS close_notify: the client sees a reset/disconnect
                return
            if rule is not None and rule.kind == "status":
                await _discard_body(reader, headers)
                writer.write(_status_response(rule.status, rule.retry_after, url.path))
                await writer.drain()
                return
            if rule is not None and rule.kind == "expire_watch":
                await _discard_body(reader, headers)
                writer.write(_expired_watch_response(query.get("resourceVersion", ["0"])[0]))
                await writer.drain()
                return
            if rule is not None and rule.kind == "stall":
                await asyncio.sleep(rule.seconds)

            upstream_reader, upstream_writer = await asyncio.open_connection(
                *self._upstream, ssl=self._client_tls, server_hostname="127.0.0.1", limit=_MAX_HEAD
            )
            upstream_writer.write(_rewrite_head(request_line, headers))
            await upstream_writer.drain()

            to_upstream = asyncio.ensure_future(_pipe(reader, upstream_writer))
            if rule is not None and rule.kind == "cut_watch":
                to_client = asyncio.ensure_future(_pipe_cutting(upstream_reader, writer, rule))
            else:
                to_client = asyncio.ensure_future(_pipe(upstream_reader, writer))
            # Whichever side finishes first ends the exchange: the apiserver closing after its response (normal,
            # thanks to Connection: close), or the client going away (a watch it stopped reading).
            # (HTTP clients over TLS do not half-close, so EOF from the client means it is gone.)
            done, pending = await asyncio.wait({to_upstream, to_client}, return_when=asyncio.FIRST_COMPLETED)
            streaming = request.watch or any(v in _TRUE for v in query.get("follow", []))
            if to_upstream in done and not streaming:
                # The client left (e.g. its timeout fired during a stall), but the request is already on its way:
                # let the apiserver finish it, as it would behind a slow network. "Timed out" never means "not done".
                await asyncio.wait({to_client}, timeout=60)
            for task_ in pending:
                task_.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError, OSError):
            pass  # a test that breaks connections on purpose produces these on either side
        finally:
            for w in (writer, upstream_writer):
                if w is not None and not w.transport.is_closing():
                    w.close()
            self._tasks.discard(task)


def _parse_head(head: bytes) -> tuple[tuple[str, str, str], list[tuple[str, str]]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, version = lines[0].split(" ", 2)
    headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        headers.append((name.strip(), value.strip()))
    return (method.upper(), target, version), headers


def _header(headers: list[tuple[str, str]], name: str) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


def _rewrite_head(request_line: tuple[str, str, str], headers: list[tuple[str, str]]) -> bytes:
    upgrade = _header(headers, "upgrade") is not None
    out = [" ".join(request_line)]
    for key, value in headers:
        # Keep the client's Connection header only for upgrades (exec/attach/port-forward need "Upgrade").
        if not upgrade and key.lower() in ("connection", "keep-alive", "proxy-connection"):
            continue
        out.append(f"{key}: {value}")
    if not upgrade:
        out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")


async def _discard_body(reader: asyncio.StreamReader, headers: list[tuple[str, str]]) -> None:
    # Read a declared body before answering, so a client still sending it does not get a reset instead of our status.
    length = _header(headers, "content-length")
    if length and length.isdigit() and int(length) > 0:
        with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            await asyncio.wait_for(reader.readexactly(int(length)), timeout=10)


def _status(code: int, message: str) -> dict[str, object]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "InternalError" if code >= 500 else "BadRequest"),
        "code": code,
    }


def _expired_watch_response(resource_version: str) -> bytes:
    status = _status(410, f"too old resource version: {resource_version} (injected by the fault proxy)")
    event = json.dumps({"type": "ERROR", "object": status}).encode() + b"\n"
    head = (
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event)


def _rbac_details(path: str) -> dict[str, str]:
    """What the API server's authorizer puts in a 403's ``details``: the resource's group and plural (and name)."""
    parts = [p for p in path.split("/") if p]
    group = parts[1] if parts[:1] == ["apis"] and len(parts) > 1 else ""
    tail = parts[parts.index("namespaces") + 2 :] if "namespaces" in parts else parts[-2:]
    details = {"group": group, "kind": tail[0] if tail else ""}
    if len(tail) > 1:
        details["name"] = tail[1]
    return details


def _status_response(code: int, retry_after: int | None, path: str = "") -> bytes:
    status = _status(code, f"injected by the fault proxy: {code}")
    reason = str(status["reason"])
    if code == 403:
        # An injected 403 stands for RBAC refusing the identity, so it carries RBAC's details (an admission
        # webhook's denial, also 403, has none: the provider tells them apart by that).
        status["details"] = _rbac_details(path)
    if retry_after is not None:
        status["details"] = {"retryAfterSeconds": retry_after}
    body = json.dumps(status).encode()
    try:
        phrase = http.HTTPStatus(code).phrase
    except ValueError:
        phrase = reason
    lines = [
        f"HTTP/1.1 {code} {phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Cache-Control: no-cache, private",
        "Connection: close",
    ]
    if retry_after is not None:
        lines.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(65536)
        if not data:
            return
        writer.write(data)
        await writer.drain()


async def _pipe_cutting(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rule: _Rule) -> None:
    """Forward a response, breaking its chunked body off after ``rule.after_events`` events / ``after_bytes`` bytes."""
    head = await reader.readuntil(b"\r\n\r\n")
    writer.write(head)
    await writer.drain()
    status_line, headers = _parse_head(head)
    chunked = (_header(headers, "transfer-encoding") or "").lower() == "chunked"
    if status_line[1] != "200" or not chunked:
        await _pipe(reader, writer)  # an error answer (e.g. 410) or a non-streaming body: nothing to cut
        return

    events = sent = 0

    def reached() -> bool:
        return (rule.after_events is not None and events >= rule.after_events) or (
            rule.after_bytes is not None and sent >= rule.after_bytes
        )

    buffered = b""
    while not reached():
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:  # the server ended the stream itself before the cut
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return
        buffered += await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after the chunk data
        # Forward whole events only (up to the cut), re-chunked by us, so the cut lands on an event boundary.
        out = b""
        while not reached():
            newline = buffered.find(b"\n")
            if newline == -1:
                break
            piece, buffered = buffered[: newline + 1], buffered[newline + 1 :]
            if rule.after_bytes is not None and sent + len(piece) > rule.after_bytes:
                piece, buffered = piece[: rule.after_bytes - sent], b""
            out += piece
            sent += len(piece)
            events += piece.endswith(b"\n")
        if out:
            writer.write(b"%x\r\n%s\r\n" % (len(out), out))
            await writer.drain()
    if rule.clean:
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
    else:
        writer.transport.abort()
