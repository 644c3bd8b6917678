"""List + watch of one resource kind over plain HTTP, shared by the simulated operator and kubelet.

What a client-go informer does, minimally: list, then watch from the list's resourceVersion, relist on 410 Gone
(as an HTTP status or as an ERROR event) and after connection errors. Objects stay plain dicts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


def iter_watch_lines(resp: Any) -> Iterator[bytes]:
    """Lines of a streaming watch response, as each chunk arrives."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


class ListWatch:
    """List, then watch from the list's resourceVersion; relist on 410 Gone (HTTP or ERROR event) and after errors.

    Objects are plain dicts (the models drop unknown fields and reject incomplete objects).
    """

    def __init__(
        self,
        name: str,
        list_fn: Callable[..., Any],
        on_event: Callable[[str, dict[str, Any]], None],
        on_relist: Callable[[list[dict[str, Any]]], None],
        **list_kwargs: Any,
    ) -> None:
        self.name = name
        self.list_fn = list_fn
        self.on_event = on_event
        self.on_relist = on_relist
        self.list_kwargs = list_kwargs
        self.synced = threading.Event()

    def run(self, stop: threading.Event) -> None:
        rv: str | None = None
        while not stop.is_set():
            try:
                if rv is None:
                    resp = self.list_fn(_preload_content=False, **self.list_kwargs)
                    body = json.loads(resp.data)
                    rv = body["metadata"]["resourceVersion"]
                    self.on_relist(body.get("items") or [])
                    self.synced.set()
                resp = self.list_fn(
                    watch=True,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=55,
                    _preload_content=False,
                    _request_timeout=(10, 75),
                    **self.list_kwargs,
                )
                try:
                    for line in iter_watch_lines(resp):
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            if obj.get("code") == 410:
                                log.info("%s watch expired (410); relisting", self.name)
                                rv = None
                                break
                            raise RuntimeError(f"watch error: {obj}")
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if event.get("type") != "BOOKMARK":
                            self.on_event(event["type"], obj)
                        if stop.is_set():
                            return
                finally:
                    resp.release_conn()
            except ApiException as err:
                if err.status == 410:
                    log.info("%s watch expired (410); relisting", self.name)
                    rv = None
                    continue
                log.warning("%s watch failed: %s %s; retrying", self.name, err.status, err.reason)
                stop.wait(1.0)
            except Exception as err:  # connection reset, timeouts, apiserver restart
                log.warning("%s watch failed: %s; retrying", self.name, err)
                stop.wait(1.0)
