"""A stand-in for the Kubernetes API server on 127.0.0.1, for tests that fake only the network.

The real ``kubernetes`` (urllib3) and ``kubernetes_asyncio`` (aiohttp) clients talk HTTP to it, so what they raise
on an error answer (``ApiException`` built from the response, headers included) is what they raise against a cluster.
Each request is answered by ``answer(method, path, query)``, and every request is recorded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: Mapping[str, str]
    #: The request's ``Content-Type``: a patch's says which kind of patch it is.
    content_type: str = ""


def json_answer(doc: Mapping[str, Any], status: int = 200, **headers: str) -> Answer:
    return Answer(status, json.dumps(doc).encode(), {"Content-Type": "application/json", **headers})


def status_answer(code: int, reason: str, message: str = "", *, retry_after: str | None = None) -> Answer:
    """An error as the API server writes it: a ``Status`` document, with a ``Retry-After`` header if given."""
    doc = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return json_answer({**doc, "message": message}, code, **headers)


def items(*objects: Mapping[str, Any]) -> Answer:
    return json_answer({"kind": "List", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": objects})


class FakeApi:
    def __init__(self, answer: Callable[[str, str, Mapping[str, str]], Answer]) -> None:
        self.answer = answer
        self.requests: list[Request] = []
        self.url = ""

    def paths(self) -> list[str]:
        return [request.path for request in self.requests]

    def kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig file for this server (a bearer token, plain HTTP)."""
        path = directory / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
                    "current-context": "fake",
                }
            )
        )
        return path


@contextmanager
def fake_api(answer: Callable[[str, str, Mapping[str, str]], Answer]) -> Iterator[FakeApi]:
    api = FakeApi(answer)

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            parts = urlsplit(self.path)
            query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
            api.requests.append(Request(self.command, parts.path, query, self.headers.get("Content-Type", "")))
            reply = api.answer(self.command, parts.path, query)
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        do_GET = do_POST = do_DELETE = do_PATCH = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the test output is not the place
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
