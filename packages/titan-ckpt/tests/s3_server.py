"""A real S3-compatible server on the loopback for the remote-storage tests: moto's server
mode (`moto[server]`), reached through s3fs exactly as a job reaches S3, with its endpoint
given the way a user gives one (`AWS_ENDPOINT_URL`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

ENV = {
    "AWS_ACCESS_KEY_ID": "titan-test",
    "AWS_SECRET_ACCESS_KEY": "titan-test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "NO_PROXY": "127.0.0.1",
}


@contextlib.contextmanager
def s3_server(bucket: str = "titan") -> Iterator[str]:
    """Start the server on a free port of 127.0.0.1, point this process's (and its children's)
    S3 clients at it, create `bucket`; yields the endpoint URL."""
    import s3fs  # noqa: PLC0415
    from moto.server import ThreadedMotoServer  # noqa: PLC0415

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    s3fs.S3FileSystem.clear_instance_cache()  # instances made for another endpoint
    try:
        s3fs.S3FileSystem().mkdir(bucket)
        yield endpoint
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
