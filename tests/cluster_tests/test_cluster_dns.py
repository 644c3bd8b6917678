"""The real node's cluster DNS (tests/cluster/cluster_dns.py) without a cluster: records and wire format."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster import cluster_dns

ENDPOINTS: list[dict[str, Any]] = [
    {
        "metadata": {"name": "job-master-0", "namespace": "ns"},
        "subsets": [{"addresses": [{"ip": "10.200.0.5", "hostname": "job-master-0"}]}],
    },
    {"metadata": {"name": "empty", "namespace": "ns"}},
    {
        "metadata": {"name": "workers", "namespace": "ns"},
        "subsets": [{"addresses": [{"ip": "10.200.0.6"}, {"ip": "10.200.0.7", "hostname": "w1"}]}],
    },
]


def query(name: str, qtype: int = 1, query_id: int = 0x1234) -> bytes:
    qname = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0) + qname + struct.pack("!HH", qtype, 1)


def parse_reply(reply: bytes) -> tuple[int, int, list[str]]:
    """(id, rcode, A addresses) of a reply to one question."""
    query_id, flags, qdcount, ancount, _ns, _ar = struct.unpack("!HHHHHH", reply[:12])
    pos = 12
    if qdcount:
        while reply[pos]:
            pos += reply[pos] + 1
        pos += 5
    addresses = []
    for _ in range(ancount):
        _ptr, rtype, _cls, _ttl, length = struct.unpack("!HHHIH", reply[pos : pos + 12])
        pos += 12
        if rtype == 1:
            addresses.append(socket.inet_ntoa(reply[pos : pos + length]))
        pos += length
    return query_id, flags & 0xF, addresses


def test_records_from_endpoints() -> None:
    records = cluster_dns.records_from_endpoints(ENDPOINTS)
    assert records == {
        "job-master-0.ns.svc.cluster.local": ["10.200.0.5"],
        "job-master-0.job-master-0.ns.svc.cluster.local": ["10.200.0.5"],
        "workers.ns.svc.cluster.local": ["10.200.0.6", "10.200.0.7"],
        "w1.workers.ns.svc.cluster.local": ["10.200.0.7"],
    }


def test_answers_a_records_nxdomain_and_empty_aaaa() -> None:
    records = cluster_dns.records_from_endpoints(ENDPOINTS)
    reply = cluster_dns.answer(query("Workers.ns.svc.cluster.local"), records)
    assert reply is not None
    assert parse_reply(reply) == (0x1234, 0, ["10.200.0.6", "10.200.0.7"])

    reply = cluster_dns.answer(query("job-master-0.other.svc.cluster.local"), records)
    assert reply is not None and parse_reply(reply) == (0x1234, 3, [])  # NXDOMAIN: glibc moves on

    reply = cluster_dns.answer(query("w1.workers.ns.svc.cluster.local", qtype=28), records)
    assert reply is not None and parse_reply(reply) == (0x1234, 0, [])  # the name exists, it has no AAAA

    assert cluster_dns.answer(b"\x12", records) is None
    reply = cluster_dns.answer(b"\x12\x34\x01", records)
    assert reply is not None and parse_reply(reply)[1] == 1  # FORMERR


class FakeLister(cluster_dns.ApiLister):
    """Lists give ``lists`` in turn; each watch yields the events put in ``events`` until a None ends it."""

    def __init__(self, *lists: list[dict[str, Any]]) -> None:
        self.lists = list(lists)
        self.listed = 0
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def endpoints(self) -> tuple[list[dict[str, Any]], str]:
        items = self.lists[min(self.listed, len(self.lists) - 1)]
        self.listed += 1
        return items, str(self.listed)

    def watch(self, resource_version: str) -> Iterator[dict[str, Any]]:
        while (event := self.events.get()) is not None:
            yield event


def event(kind: str, ep: dict[str, Any], version: str) -> dict[str, Any]:
    return {"type": kind, "object": {**ep, "metadata": {**ep["metadata"], "resourceVersion": version}}}


def test_apply_event_adds_changes_and_deletes_and_an_error_asks_for_a_list() -> None:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    assert cluster_dns.apply_event(objects, event("ADDED", ENDPOINTS[0], "7")) == "7"
    assert cluster_dns.apply_event(objects, event("MODIFIED", ENDPOINTS[2], "8")) == "8"
    assert set(cluster_dns.records_from_endpoints(objects.values())) >= {
        "job-master-0.ns.svc.cluster.local",
        "workers.ns.svc.cluster.local",
    }
    assert cluster_dns.apply_event(objects, event("DELETED", ENDPOINTS[0], "9")) == "9"
    assert list(objects) == [("ns", "workers")]
    with pytest.raises(cluster_dns.WatchExpired, match="410 Expired"):
        cluster_dns.apply_event(objects, {"type": "ERROR", "object": {"code": 410, "reason": "Expired"}})


def test_follow_publishes_each_change_and_lists_again_after_an_expired_watch() -> None:
    lister = FakeLister([ENDPOINTS[0]], [ENDPOINTS[2]])
    published: queue.Queue[dict[str, list[str]]] = queue.Queue()
    threading.Thread(target=cluster_dns.follow, args=(lister, published.put), daemon=True).start()
    assert set(published.get(timeout=5)) == {
        "job-master-0.ns.svc.cluster.local",
        "job-master-0.job-master-0.ns.svc.cluster.local",
    }
    lister.events.put(event("DELETED", ENDPOINTS[0], "2"))
    assert published.get(timeout=5) == {}
    lister.events.put({"type": "ERROR", "object": {"code": 410, "reason": "Expired"}})
    # The second list: what the API holds now, whatever the watch said before.
    assert "workers.ns.svc.cluster.local" in published.get(timeout=5)
    assert lister.listed == 2


def test_serves_over_udp_what_the_watch_brings() -> None:
    lister = FakeLister([ENDPOINTS[0]])
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    threading.Thread(target=cluster_dns.serve, args=("127.0.0.1", port, lister), daemon=True).start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(0.5)

    def ask(name: str, want_addresses: bool) -> tuple[int, int, list[str]]:
        for _ in range(20):  # until the server is bound and has what it was given
            client.sendto(query(name), ("127.0.0.1", port))
            try:
                reply, _ = client.recvfrom(512)
            except TimeoutError:
                continue
            if bool(parse_reply(reply)[2]) == want_addresses:
                break
            time.sleep(0.05)
        return parse_reply(reply)

    assert ask("job-master-0.ns.svc.cluster.local", True) == (0x1234, 0, ["10.200.0.5"])
    assert ask("workers.ns.svc.cluster.local", False) == (0x1234, 3, [])
    # A Service that became ready after the list: served from the watch, with no second list.
    lister.events.put(event("ADDED", ENDPOINTS[2], "2"))
    assert ask("workers.ns.svc.cluster.local", True) == (0x1234, 0, ["10.200.0.6", "10.200.0.7"])
    assert lister.listed == 1
