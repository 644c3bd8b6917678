"""The real node's cluster DNS (tests/cluster/cluster_dns.py) without a cluster: records and wire format."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

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


def test_serves_over_udp() -> None:
    class FakeLister(cluster_dns.ApiLister):
        def __init__(self) -> None:
            pass

        def endpoints(self) -> list[dict[str, Any]]:
            return ENDPOINTS

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    threading.Thread(target=cluster_dns.serve, args=("127.0.0.1", port, FakeLister()), daemon=True).start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(0.5)
    for _ in range(20):  # until the server is bound and has listed once
        client.sendto(query("job-master-0.ns.svc.cluster.local"), ("127.0.0.1", port))
        try:
            reply, _ = client.recvfrom(512)
        except TimeoutError:
            continue
        if parse_reply(reply)[2]:
            break
    assert parse_reply(reply) == (0x1234, 0, ["10.200.0.5"])
