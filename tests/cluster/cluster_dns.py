"""Cluster DNS for the real node's pods (tests/cluster/real_node.py): A records read from the API, nothing else.

``python -m tests.cluster.cluster_dns --listen IP --kubeconfig-json STATE_JSON`` answers on UDP port 53 of ``IP`` (the
node's bridge gateway, which the kubelet hands to pods as ``--cluster-dns``):

- ``<service>.<namespace>.svc.cluster.local``: the ready addresses of the Service's Endpoints. PyTorchJob pods dial
  ``<job>-master-0``, one headless Service per pod. ClusterIP Services get their Endpoints' addresses too, not the
  ClusterIP: no kube-proxy runs here, so a ClusterIP would not route.
- ``<hostname>.<subdomain>.<namespace>.svc.cluster.local``: an Endpoints address that carries that hostname (pods
  with ``hostname`` and ``subdomain``, as JobSet makes them).

Everything else is NXDOMAIN at once (the machine is offline, and glibc walks the search list name by name); AAAA and
other types of a known name are empty answers. The records follow the API as CoreDNS's do: a list, then a watch from
its version, so a pod that starts after its Service's Endpoints became ready resolves it. (A re-list every second
left a window: under a loaded CI a probe pod ran within it and got NXDOMAIN.) A watch that ends goes on from the last
version seen; an expired version (410) or an error lists again.
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

DOMAIN = "cluster.local"
TTL_SECONDS = 5
#: The pause before listing again after an error.
RETRY_SECONDS = 1.0
#: How long one watch request lasts (the API's ``timeoutSeconds``); the next goes on from the last version seen.
WATCH_SECONDS = 300

_QTYPE_A = 1
_FLAG_QR = 0x8000
_FLAG_AA = 0x0400
_FLAG_RD = 0x0100
_FLAG_RA = 0x0080
_RCODE_FORMERR = 1
_RCODE_NXDOMAIN = 3
_RCODE_NOTIMP = 4


def records_from_endpoints(endpoints: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """``{fqdn (lower case, no trailing dot): [IPv4, ...]}`` for a list of Endpoints objects."""
    records: dict[str, list[str]] = {}
    for ep in endpoints:
        meta = ep.get("metadata") or {}
        base = f"{meta.get('name')}.{meta.get('namespace')}.svc.{DOMAIN}".lower()
        for subset in ep.get("subsets") or []:
            for address in subset.get("addresses") or []:
                ip = address.get("ip")
                if not ip:
                    continue
                records.setdefault(base, [])
                if ip not in records[base]:
                    records[base].append(ip)
                hostname = address.get("hostname")
                if hostname:
                    records.setdefault(f"{hostname}.{base}".lower(), []).append(ip)
    return records


def parse_query(packet: bytes) -> tuple[int, int, str, int, int, int]:
    """``(id, flags, name, qtype, qclass, end of the question)``; raises ValueError for anything malformed."""
    if len(packet) < 12:
        raise ValueError("short header")
    query_id, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError(f"{qdcount} questions")
    labels = []
    pos = 12
    while True:
        if pos >= len(packet):
            raise ValueError("name runs past the packet")
        length = packet[pos]
        pos += 1
        if length == 0:
            break
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(packet[pos : pos + length].decode("ascii", "replace"))
        pos += length
    if pos + 4 > len(packet):
        raise ValueError("question truncated")
    qtype, qclass = struct.unpack("!HH", packet[pos : pos + 4])
    return query_id, flags, ".".join(labels).lower(), qtype, qclass, pos + 4


def answer(packet: bytes, records: Mapping[str, list[str]]) -> bytes | None:
    """The response to one query packet (None: not even an id to answer to)."""
    try:
        query_id, flags, name, qtype, _qclass, end = parse_query(packet)
    except ValueError:
        if len(packet) < 2:
            return None
        return struct.pack("!HHHHHH", struct.unpack("!H", packet[:2])[0], _FLAG_QR | _RCODE_FORMERR, 0, 0, 0, 0)
    question = packet[12:end]
    reply_flags = _FLAG_QR | _FLAG_RA | (flags & _FLAG_RD)
    if flags & 0x7800:  # an opcode other than QUERY
        return struct.pack("!HHHHHH", query_id, reply_flags | _RCODE_NOTIMP, 1, 0, 0, 0) + question
    addresses = records.get(name.rstrip("."))
    if addresses is None:
        rcode = _RCODE_NXDOMAIN
        reply_flags |= _FLAG_AA if name.endswith(DOMAIN) else 0
        return struct.pack("!HHHHHH", query_id, reply_flags | rcode, 1, 0, 0, 0) + question
    reply_flags |= _FLAG_AA
    answers = b""
    count = 0
    if qtype == _QTYPE_A:
        for ip in addresses:
            # 0xC00C: a pointer to the name in the question, which starts at offset 12.
            answers += struct.pack("!HHHIH", 0xC00C, _QTYPE_A, 1, TTL_SECONDS, 4) + socket.inet_aton(ip)
            count += 1
    return struct.pack("!HHHHHH", query_id, reply_flags, 1, count, 0, 0) + question + answers


class WatchExpired(Exception):
    """The watch's version is gone (an ``ERROR`` event, 410 Gone): list again."""


def apply_event(objects: dict[tuple[str, str], dict[str, Any]], event: Mapping[str, Any]) -> str:
    """Apply one watch event to ``objects`` (Endpoints by namespace and name); the version to watch on from."""
    kind = event.get("type")
    obj = event.get("object") or {}
    if kind == "ERROR":
        raise WatchExpired(f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
    meta = obj.get("metadata") or {}
    key = (str(meta.get("namespace")), str(meta.get("name")))
    if kind in ("ADDED", "MODIFIED"):
        objects[key] = obj
    elif kind == "DELETED":
        objects.pop(key, None)
    return str(meta.get("resourceVersion") or "")


class ApiLister:
    """Lists and watches Endpoints with the admin identity of a cluster's state.json (urllib; no client library)."""

    def __init__(self, api_url: str, token: str, ca_file: str) -> None:
        self.api_url = api_url
        self.token = token
        self.tls = ssl.create_default_context(cafile=ca_file)

    def _open(self, query: str, timeout: float) -> Any:
        request = urllib.request.Request(
            f"{self.api_url}/api/v1/endpoints{query}", headers={"Authorization": f"Bearer {self.token}"}
        )
        return urllib.request.urlopen(request, timeout=timeout, context=self.tls)

    def endpoints(self) -> tuple[list[dict[str, Any]], str]:
        """Every Endpoints object, and the list's resourceVersion."""
        with self._open("", 5) as resp:
            doc = json.loads(resp.read())
            return doc.get("items") or [], str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def watch(self, resource_version: str) -> Iterator[dict[str, Any]]:
        """The events after ``resource_version``, one JSON object per line, until the API ends the request."""
        query = f"?watch=1&resourceVersion={resource_version}&timeoutSeconds={WATCH_SECONDS}"
        with self._open(query, WATCH_SECONDS + 30) as resp:
            for line in resp:
                if line.strip():
                    yield json.loads(line)


def follow(lister: ApiLister, publish: Callable[[dict[str, list[str]]], None]) -> None:
    """List, then watch from the list's version, publishing the records after each change; never returns."""
    while True:
        try:
            items, version = lister.endpoints()
            objects = {(str(ep["metadata"].get("namespace")), str(ep["metadata"].get("name"))): ep for ep in items}
            publish(records_from_endpoints(objects.values()))
            while True:
                started, events = time.monotonic(), 0
                for event in lister.watch(version):
                    version = apply_event(objects, event) or version
                    publish(records_from_endpoints(objects.values()))
                    events += 1
                if not events and time.monotonic() - started < RETRY_SECONDS:
                    time.sleep(RETRY_SECONDS)  # a watch that ends at once, again and again, must not spin
        except (OSError, ValueError, KeyError, WatchExpired) as e:
            print(
                f"[cluster-dns] listing or watching endpoints failed, listing again: {e}", file=sys.stderr, flush=True
            )
            time.sleep(RETRY_SECONDS)


def serve(listen: str, port: int, lister: ApiLister) -> None:
    records: dict[str, list[str]] = {}
    lock = threading.Lock()

    def publish(fresh: dict[str, list[str]]) -> None:
        nonlocal records
        with lock:
            records = fresh

    threading.Thread(target=follow, args=(lister, publish), name="cluster-dns-follow", daemon=True).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((listen, port))
    print(f"[cluster-dns] serving {DOMAIN} on {listen}:{port}/udp", file=sys.stderr, flush=True)
    while True:
        packet, peer = sock.recvfrom(4096)
        with lock:
            current = records
        reply = answer(packet, current)
        if reply is not None:
            sock.sendto(reply, peer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.cluster_dns", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="IPv4 address to answer on (the node's bridge gateway)")
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--api-url", required=True)
    parser.add_argument("--token-file", required=True, help="a file holding the bearer token to list Endpoints with")
    parser.add_argument("--ca-file", required=True)
    args = parser.parse_args(argv)
    with open(args.token_file) as f:
        token = f.read().strip()
    serve(args.listen, args.port, ApiLister(args.api_url, token, args.ca_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
