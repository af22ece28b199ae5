"""Where checkpoints live: a local folder, or any fsspec URL (`s3://bucket/run`, `gs://...`).

A local folder is a `pathlib.Path` and keeps every guarantee the local file system gives
(rename, fsync, flock). A URL is a `RemotePath`: the few path operations the checkpoint code
uses (`/`, `name`, `is_file`, `iterdir`, `read_text`, ...), done by the URL's fsspec file
system. Object stores have no rename, so a save there is written in place into `step-<N>/`
and its commit marker, written last, is what makes it a checkpoint (see layout.py).

How a store is reached is fsspec's business, configured the way fsspec and the store's SDK
are: for S3, `AWS_ENDPOINT_URL` (an S3-compatible server), `AWS_ACCESS_KEY_ID` / a profile,
or fsspec's own config (`FSSPEC_S3_ENDPOINT_URL`, or `FSSPEC_S3='{"endpoint_url": ...}'`,
or a file in `~/.config/fsspec/`), which holds for every protocol.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from titan_core.messages import first_line
from titan_core.run_folder import RunFolderError

EXTRAS = {"s3": "s3", "s3a": "s3"}
"""Protocols whose file system titan-ckpt's extras install: `pip install titan-llm-ckpt[s3]`."""
LOCAL_PROTOCOLS = ("file", "local")


class StorageUnavailableError(ImportError):
    """A checkpoint URL names a storage whose fsspec file system is not installed."""


def is_url(path: str | os.PathLike | RemotePath) -> bool:
    """Whether `path` names remote storage (`proto://...`, not `file://`)."""
    if isinstance(path, RemotePath):
        return True
    if isinstance(path, Path):
        return False
    text = os.fspath(path)
    proto, sep, _ = text.partition("://")
    return bool(sep) and proto.isidentifier() and proto not in LOCAL_PROTOCOLS


def as_path(path: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """A `Path` for a local folder (a `file://` URL included), a `RemotePath` for a URL."""
    if isinstance(path, (Path, RemotePath)):
        return path
    text = os.fspath(path)
    if is_url(text):
        return RemotePath(text)
    for proto in LOCAL_PROTOCOLS:
        if text.startswith(f"{proto}://"):
            return Path(text[len(proto) + 3 :])
    return Path(text)


def join(folder: str, name: str) -> str:
    """`folder` under `base`: a URL or an absolute path stays as it is."""
    if is_url(name) or os.path.isabs(name):
        return name
    if is_url(folder):
        return folder.rstrip("/") + "/" + name
    return os.path.join(folder, name)


def filesystem(url: str) -> Any:
    """The fsspec file system for `url`, or StorageUnavailableError naming what to install."""
    proto = url.partition("://")[0]
    try:
        import fsspec  # noqa: PLC0415 - only URLs need it
    except ImportError as e:
        raise StorageUnavailableError(_install_hint(url, proto, "fsspec is not installed")) from e
    try:
        fs, _ = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise StorageUnavailableError(_install_hint(url, proto, str(e).splitlines()[0])) from e
    except ValueError as e:  # "Protocol not known"
        raise StorageUnavailableError(
            f"checkpoint folder {url}: fsspec knows no storage {proto!r} ({e}); use a local"
            " folder or a URL of a storage fsspec supports (s3://, gs://, az://, ...)"
        ) from e
    return fs


def _install_hint(url: str, proto: str, reason: str) -> str:
    extra = EXTRAS.get(proto)
    fix = (
        f"pip install 'titan-llm-ckpt[{extra}]'"
        if extra
        else f"install the fsspec implementation for {proto}:// (fsspec says: {reason})"
    )
    return f"{url} is on {proto}:// storage, which is not installed here\n{fix}"


STORE_MODULES = ("botocore", "aiobotocore", "s3fs", "gcsfs", "adlfs", "google", "azure")


def is_store_error(error: BaseException) -> bool:
    """An error raised by a store's client (no credentials, no such bucket, ...) rather than
    by titan-ckpt: shown as one line, not a traceback."""
    return type(error).__module__.split(".")[0] in STORE_MODULES


class RemotePath:
    """A file or folder at a URL, through its fsspec file system: the path operations the
    checkpoint code needs, with pathlib's names. Folders are prefixes on an object store:
    one exists once something is written under it. Listings are read fresh every time (other
    processes write here too)."""

    def __init__(self, url: str, fs: Any = None):
        self.url = url.rstrip("/")
        self.fs = fs if fs is not None else filesystem(self.url)
        self.path = self.fs._strip_protocol(self.url)

    # ------------------------------------------------------------------ names
    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.fs)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: RemotePath) -> bool:
        return self.url < other.url

    def __reduce__(self) -> tuple[Any, ...]:
        return (RemotePath, (self.url, self.fs))

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        name = self.name
        return name[name.rfind(".") :] if "." in name.lstrip(".") else ""

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.fs)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def resolve(self) -> RemotePath:
        return self

    absolute = resolve

    # ------------------------------------------------------------------ queries
    def _fresh(self) -> None:
        self.fs.invalidate_cache()

    def exists(self) -> bool:
        self._fresh()
        return self.fs.exists(self.path)

    def is_file(self) -> bool:
        self._fresh()
        return self.fs.isfile(self.path)

    def is_dir(self) -> bool:
        self._fresh()
        return self.fs.isdir(self.path)

    def iterdir(self) -> list[RemotePath]:
        self._fresh()
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        children = []
        for entry in entries:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if entry.rstrip("/") != self.path.rstrip("/"):
                children.append(self / name)
        return children

    def glob(self, pattern: str) -> list[RemotePath]:
        return [p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern)]

    def stat(self) -> SimpleNamespace:
        self._fresh()
        return SimpleNamespace(st_size=int(self.fs.size(self.path)))

    # ------------------------------------------------------------------ data
    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def read_range(self, start: int, length: int) -> bytes:
        return self.fs.cat_file(self.path, start=start, end=start + length)

    def write_text(self, text: str) -> None:
        """One object, whole or not at all (an object store's PUT)."""
        self.fs.pipe_file(self.path, text.encode())

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def rmtree(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path, recursive=True)
        self._fresh()


def reach_problem(url: str, *, purpose: str) -> str | None:
    """Why the store holding `url` cannot be reached (listing the folder fails for another
    reason than its absence: no server at the endpoint, no credentials, access denied), in
    one message naming the URL, the store's reason and the fixes; None when it answers."""
    try:
        RemotePath(url, fs=_probing_filesystem(url)).iterdir()  # an absent folder: empty
    except StorageUnavailableError as e:
        return f"the {purpose} {url}: {e}"
    except Exception as e:  # noqa: BLE001 - any failure of the store is the finding
        return f"the {purpose} {url} cannot be reached: {first_line(e)}\n{_reach_fix(url)}"
    return None


PROBE_S3_CONFIG = {"connect_timeout": 10, "read_timeout": 30, "retries": {"max_attempts": 2}}
"""botocore's settings for the reachability probe: a store that does not answer is said in
seconds, not after botocore's five attempts with back-off (20 s for a closed port; minutes
for an address that drops packets, with its 60 s connection timeout)."""


def _probing_filesystem(url: str) -> Any:
    """The file system of `url` for one question, with short timeouts where the store's
    client takes them (S3); otherwise the run's own."""
    if EXTRAS.get(url.partition("://")[0]) != "s3":
        return filesystem(url)
    import fsspec  # noqa: PLC0415 - only URLs need it

    fs, _ = fsspec.core.url_to_fs(url, skip_instance_cache=True, config_kwargs=PROBE_S3_CONFIG)
    return fs


def _reach_fix(url: str) -> str:
    proto = url.partition("://")[0]
    if EXTRAS.get(proto) == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        where = (
            f"the endpoint (AWS_ENDPOINT_URL = {endpoint})"
            if endpoint
            else "the endpoint (AWS_ENDPOINT_URL is not set: AWS's own S3 is asked)"
        )
        return (
            f"check {where}, the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or"
            " AWS_PROFILE) and the network to it; or use a local folder"
        )
    return "check the URL, the credentials and the network to the store; or use a local folder"


def check_remote_writable(folder: RemotePath, *, purpose: str, hint: str = "") -> None:
    """Write and delete a small object under `folder`, so that a bucket that does not exist,
    missing credentials or a read-only store are reported at start-up, not at the first save.
    Raises titan_core's RunFolderError naming the URL and the store's reason."""
    probe = folder / f".titan-write-test-{os.getpid()}"
    try:
        probe.write_text("titan write test\n")
        probe.unlink(missing_ok=True)
    except Exception as e:  # noqa: BLE001 - any failure of the store is the finding
        raise RunFolderError(
            f"the {purpose} {folder} cannot be written: {first_line(e)}\n"
            + (hint or "check the URL, the bucket and the credentials")
        ) from e
