"""A REAL S3-compatible server for tests: moto in server mode on 127.0.0.1, a free port, one bucket.

Not a mock object: the code under test talks HTTP to a server (``moto.server.ThreadedMotoServer``, a
thread of the test process, reachable from any process of the machine while the session lasts), through
s3fs / boto3 / pyarrow exactly as it would to S3 or MinIO, with the endpoint and credentials from the
standard environment variables.

Fixtures (import them into a ``conftest.py`` to use them in a test folder, as ``tests/vigil/conftest.py``
does: ``from tests.s3server import s3, s3_server  # noqa: F401``):

* ``s3_server`` (session): the running :class:`S3Server`: :attr:`~S3Server.endpoint_url`,
  :attr:`~S3Server.bucket` (created), :attr:`~S3Server.env` (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID=testing``,
  ``AWS_SECRET_ACCESS_KEY=testing``, ``AWS_DEFAULT_REGION=us-east-1``: hand it to the processes a test starts);
* ``s3`` (function): the same server with :attr:`~S3Server.env` set in this process for the test, and a
  fresh prefix of its own (:attr:`S3Prefix.uri`, e.g. ``s3://vigil-test/t-3f2a.../``), so tests never see
  each other's objects.

Needs ``moto[server]`` (the ``test`` extra) and loopback networking; nothing leaves the machine.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

BUCKET = "vigil-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
"""moto accepts any credentials; these are the values its documentation uses."""


@dataclass
class S3Server:
    """A running S3-compatible server and its bucket."""

    endpoint_url: str
    """``http://127.0.0.1:<port>``."""
    bucket: str
    env: dict[str, str]
    """The standard variables that point an AWS SDK (s3fs, boto3, pyarrow, Ray) at this server."""
    _server: Any = field(default=None, repr=False)

    def client(self) -> Any:
        """A boto3 S3 client of this server (to look at or change objects behind the code's back)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
                            region_name=self.env["AWS_DEFAULT_REGION"])

    def objects(self, prefix: str = "") -> list[str]:
        """Every object key of the bucket under ``prefix``, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@dataclass
class S3Prefix:
    """One test's part of the bucket."""

    server: S3Server
    prefix: str
    """The key prefix, without a leading or trailing ``/``."""

    @property
    def uri(self) -> str:
        """``s3://<bucket>/<prefix>``: a storage root for the code under test."""
        return f"s3://{self.server.bucket}/{self.prefix}"

    @property
    def env(self) -> dict[str, str]:
        return self.server.env

    def key(self, uri: str) -> str:
        """The object key of ``uri`` (a URI of this bucket)."""
        head = f"s3://{self.server.bucket}/"
        assert uri.startswith(head), uri
        return uri[len(head):]

    def objects(self) -> list[str]:
        """The key of every object under this prefix, relative to it, sorted."""
        return [k[len(self.prefix) + 1:] for k in self.server.objects(self.prefix + "/")]

    def client(self) -> Any:
        return self.server.client()


def start_s3_server(bucket: str = BUCKET, address: str = "127.0.0.1") -> S3Server:
    """Start moto's server on a free port of ``address`` (default loopback; a bridge's address serves network
    namespaces) and create ``bucket`` (stop it with :func:`stop_s3_server`)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=address, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    s3 = S3Server(endpoint_url=endpoint, bucket=bucket, env={"AWS_ENDPOINT_URL": endpoint, **CREDENTIALS},
                  _server=server)
    s3.client().create_bucket(Bucket=bucket)
    return s3


def stop_s3_server(s3: S3Server) -> None:
    s3._server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3-compatible server (module docstring)."""
    s3 = start_s3_server()
    try:
        yield s3
    finally:
        stop_s3_server(s3)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Prefix:
    """The server, its variables set in this process for the test, and a fresh prefix (module docstring)."""
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN"):  # the machine's own, if any
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    return S3Prefix(s3_server, f"t-{uuid.uuid4().hex[:12]}")


__all__ = ["BUCKET", "S3Prefix", "S3Server", "s3", "s3_server", "start_s3_server", "stop_s3_server"]
