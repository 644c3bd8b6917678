"""A fault-injecting HTTP proxy in front of the real node's registry (tests/cluster/registry.py): what containerd
pulls through. ``python -m tests.cluster.registry_proxy --listen HOST:PORT --backend HOST:PORT --dir DIR``.

Tests say what to break in ``DIR/faults.json``, ``{"<repository>:<tag>": {"fault": "429" | "503" | "reset",
"pulls": N}}`` (:func:`tests.cluster.registry.inject`): the first N pulls of that tag get the fault, later ones go
through. The file is read again whenever it changed, and counts start at the first pull after a fault was set.

A *pull* is the requests for a tag's manifest that arrive within :data:`PULL_GAP` seconds of each other: containerd
1.6 repeats a 429 up to five times at once inside one pull, while the kubelet's own back-off between two pulls is
10 s or more. Requests by digest (the manifest, config and layers a resolved tag names) are never faulted. Every
manifest request by tag is logged to ``DIR/pulls.jsonl`` with the pull's number and its fault.

One request per connection, like tests/cluster/proxy.py: the head is read, ``Connection: close`` is set, and bytes
are piped both ways, so response framing is never parsed. A reset is a close with SO_LINGER 0 (a TCP RST).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

#: Requests for one tag's manifest closer together than this are one pull.
PULL_GAP = 3.0
_MANIFEST_BY_TAG = re.compile(r"^/v2/(?P<name>.+)/manifests/(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})$")
_STATUS = {"429": (429, "Too Many Requests", "TOOMANYREQUESTS"), "503": (503, "Service Unavailable", "UNAVAILABLE")}
_MAX_HEAD = 1 << 16


class Faults:
    def __init__(self, folder: Path) -> None:
        self.path = folder / "faults.json"
        self.log = folder / "pulls.jsonl"
        self._mtime: float | None = None
        self._faults: dict[str, dict[str, Any]] = {}
        #: Per tag: (pulls counted since its fault was set, the time of its last manifest request).
        self._pulls: dict[str, tuple[int, float]] = {}

    def _reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except OSError:
            mtime = None
        if mtime == self._mtime:
            return
        self._mtime = mtime
        try:
            faults = json.loads(self.path.read_text()) if mtime is not None else {}
        except (OSError, ValueError):
            return  # half written: read it again at the next request
        for key, fault in faults.items():
            if fault != self._faults.get(key):
                self._pulls.pop(key, None)  # a new fault counts its pulls from now
        self._faults = faults

    def on_manifest(self, name: str, tag: str, method: str) -> str | None:
        """The fault for this manifest request (None: forward it), logged."""
        self._reload()
        key = f"{name}:{tag}"
        now = time.monotonic()
        count, last = self._pulls.get(key, (0, -PULL_GAP))
        if now - last >= PULL_GAP:
            count += 1
        self._pulls[key] = (count, now)
        spec = self._faults.get(key) or {}
        fault = spec.get("fault") if count <= int(spec.get("pulls", 0)) else None
        record = {"time": time.time(), "name": name, "tag": tag, "method": method, "pull": count, "fault": fault}
        with open(self.log, "a") as out:
            out.write(json.dumps(record) + "\n")
        return fault


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _serve(
    faults: Faults, backend: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        writer.close()
        return
    lines = head.decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    path = rest.rpartition(" ")[0].split("?", 1)[0]
    manifest = _MANIFEST_BY_TAG.match(path)
    fault = faults.on_manifest(manifest["name"], manifest["tag"], method) if manifest else None
    if fault == "reset":
        _reset(writer)
        return
    if fault in _STATUS:
        code, text, error = _STATUS[fault]
        body = json.dumps({"errors": [{"code": error, "message": f"injected by {__name__}"}]}).encode()
        writer.write(
            f"HTTP/1.1 {code} {text}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: 1\r\nConnection: close\r\n\r\n".encode()
            + (b"" if method == "HEAD" else body)
        )
        with contextlib.suppress(ConnectionError, OSError):
            await writer.drain()
        writer.close()
        return
    try:
        up_reader, up_writer = await asyncio.open_connection(*backend)
    except OSError:
        _reset(writer)
        return
    kept = [line for line in lines[1:] if line and not line.lower().startswith(("connection:", "keep-alive:"))]
    up_writer.write("\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1"))
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    for w in (up_writer, writer):
        w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def _main(listen: tuple[str, int], backend: tuple[str, int], folder: Path) -> None:
    faults = Faults(folder)
    server = await asyncio.start_server(
        lambda r, w: _serve(faults, backend, r, w), *listen, limit=_MAX_HEAD, reuse_address=True
    )
    print(f"registry proxy on {listen[0]}:{listen[1]} -> {backend[0]}:{backend[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.registry_proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT containerd pulls from")
    parser.add_argument("--backend", required=True, help="HOST:PORT of the registry")
    parser.add_argument("--dir", required=True, type=Path, help="where faults.json is read and pulls.jsonl written")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(_main(_address(args.listen), _address(args.backend), args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
