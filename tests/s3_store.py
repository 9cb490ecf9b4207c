"""A real S3-compatible server for tests: moto's server mode on loopback, started by the test itself.

Programs reach it the standard way (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), through s3fs; the test
looks at the stored objects with boto3. moto keeps its objects in this process, so a server stopped and started again
on the same port still holds them (a store that was down, not one that lost its data).
"""

from __future__ import annotations

import logging
import secrets
from collections import defaultdict

import pytest

from tests.runs import free_port

moto_server = pytest.importorskip("moto.server", reason="the mirror tests need moto[server] (pip install -e .[dev])")
pytest.importorskip("s3fs", reason="the mirror tests need s3fs (pip install -e .[s3])")


logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the server's line per request


class S3Store:
    """One moto server on 127.0.0.1 and one fresh bucket in it."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.running = True
        self.env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
            "AWS_ACCESS_KEY_ID": "perdure-test",
            "AWS_SECRET_ACCESS_KEY": "perdure-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        self.bucket = f"perdure-{secrets.token_hex(4)}"
        self.client().create_bucket(Bucket=self.bucket)
        self.url = f"s3://{self.bucket}/mirror"

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.env["AWS_ENDPOINT_URL"],
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )

    def keys(self) -> list[str]:
        """Every object key in the bucket."""
        keys, pages = [], self.client().get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return keys

    def checkpoints(self) -> dict[str, set[str]]:
        """{checkpoint name: the names of its objects} for every `.../checkpoints/ckpt-*/...` key."""
        found: dict[str, set[str]] = defaultdict(set)
        for key in self.keys():
            parts = key.split("/")
            if len(parts) >= 3 and parts[-3] == "checkpoints" and parts[-2].startswith("ckpt-"):
                found[parts[-2]].add(parts[-1])
        return dict(found)

    def complete(self) -> list[str]:
        return sorted(name for name, files in self.checkpoints().items() if "manifest.json" in files)

    def partial(self) -> list[str]:
        return sorted(name for name, files in self.checkpoints().items() if "manifest.json" not in files)

    def key_of(self, checkpoint: str, name: str) -> str:
        return next(key for key in self.keys() if key.endswith(f"/checkpoints/{checkpoint}/{name}"))

    def pointer(self, name: str) -> str:
        """What the mirror's pointer `name` (latest, best) holds."""
        key = next(key for key in self.keys() if key.endswith(f"/checkpoints/{name}"))
        return self.get(key).decode().strip()

    def get(self, key: str) -> bytes:
        return self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=self.bucket, Key=key, Body=data)

    def stop(self) -> None:
        if self.running:  # a second shutdown of a stopped server would wait forever
            self.server.stop()
            self.running = False

    def restart(self) -> None:
        """Serve again on the same port, with the objects stored before."""
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.running = True
