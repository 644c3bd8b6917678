"""An S3-compatible server on this machine for the storage tests: moto in server mode, on a free port.

Import the fixture into a test module (``from tests.s3_server import s3  # noqa: F401``). The server is a thread of
the test process; the runners and the pods of the simulated kubelet (local processes) reach it over TCP with the
credentials and endpoint in :attr:`S3Server.env`, as pods would get theirs from a Secret. ``AWS_ENDPOINT_URL`` is
read by botocore, so s3fs needs no endpoint argument.
"""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to use the server: test credentials (moto accepts any) and its endpoint."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
        }

    def connection_json(self) -> str:
        """An Airflow ``aws`` connection to the server, for ``AIRFLOW_CONN_<ID>``."""
        return json.dumps(
            {
                "conn_type": "aws",
                "login": "testing",
                "password": "testing",
                "extra": {"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            }
        )

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def _free_port(address: str) -> int:
    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve_s3(address: str = "127.0.0.1") -> Iterator[S3Server]:
    """A started server on ``address`` with one fresh bucket; stopped on exit. Pods on the real node reach this
    machine only at their bridge's gateway (``real_node_cluster.layout.gateway``), not at its loopback."""
    from moto.server import ThreadedMotoServer

    port = _free_port(address)
    server = ThreadedMotoServer(ip_address=address, port=port, verbose=False)
    server.start()
    try:
        info = S3Server(endpoint=f"http://{address}:{port}", bucket=f"torchelastic-{uuid.uuid4().hex[:8]}")
        info.client().create_bucket(Bucket=info.bucket)
        yield info
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    with serve_s3() as server:
        yield server


def use_server_env(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put ``server``'s credentials and endpoint in this process's environment (so in local runners' too).

    fsspec keeps one S3 file system per set of arguments, and ours pass none: the endpoint is read from the
    environment once, when the file system is made. A test process that saw another server earlier (the real node's,
    on the node's gateway) would keep talking to it, so the cache is emptied here."""
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    _forget_s3_file_systems()


def _forget_s3_file_systems() -> None:
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The server's credentials and endpoint in this process's environment (so in local runners' too)."""
    use_server_env(s3, monkeypatch)
    yield s3
    _forget_s3_file_systems()
