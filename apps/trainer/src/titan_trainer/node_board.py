"""The board on which the nodes of a multi-node job meet: the head node (node rank 0) serves it,
every node reports there. It holds who arrived (the roll call), each node's last heartbeat,
whether the job is ending and who has finished; `launch.py` decides from it.

It is served with the standard library's XML-RPC (no torch: a launcher starts in milliseconds,
and it is never tied up in the ranks' own store). Every call opens its own connection with a
timeout, so that a call over a link that is down fails after that timeout instead of blocking
for as long as the link stays down (what torch's TCPStore client does, and why torchrun's agent
on a cut-off node never ended).
"""

from __future__ import annotations

import http.client
import socketserver
import threading
import time
import xmlrpc.client
from xmlrpc.server import SimpleXMLRPCRequestHandler, SimpleXMLRPCServer


class Board:
    """The head node's record of the job. Its public methods are what the nodes call."""

    def __init__(self, nnodes: int) -> None:
        self.nnodes = nnodes
        self.hosts: dict[int, str] = {}
        self.last_beat: dict[int, float] = {}
        self.finished: dict[int, int] = {}
        self.verdict = ""  # "", then "go" or "missing"
        self.ending = ""  # why the job ends on every node, once it does
        self._lock = threading.Lock()

    def arrive(self, rank: int, host: str) -> bool:
        with self._lock:
            self.hosts[rank] = host
            self.last_beat[rank] = time.monotonic()
        return True

    def get_verdict(self) -> str:
        return self.verdict

    def beat(self, rank: int) -> str:
        """A node is alive; the answer is why the job ends, or "" while it goes on."""
        with self._lock:
            self.last_beat[rank] = time.monotonic()
        return self.ending

    def finish(self, rank: int, code: int) -> bool:
        with self._lock:
            self.finished[rank] = code
        return True

    def silent(self, after: float) -> tuple[int, float] | None:
        """The first node that has not finished and has not beaten for `after` seconds, and
        for how long it has been silent."""
        now = time.monotonic()
        with self._lock:
            for rank in range(self.nnodes):
                if rank in self.finished:
                    continue
                quiet = now - self.last_beat.get(rank, now)
                if quiet >= after:
                    return rank, quiet
        return None


class _Handler(SimpleXMLRPCRequestHandler):
    timeout = 10  # a client cut off mid-request frees its thread after this long
    rpc_paths = ("/",)


class _Server(socketserver.ThreadingMixIn, SimpleXMLRPCServer):
    daemon_threads = True
    allow_reuse_address = True


def serve(board: Board, port: int) -> _Server:
    """Serve `board` on every address of this host at `port`, in a thread."""
    server = _Server(("", port), _Handler, logRequests=False, allow_none=True)
    server.register_instance(board)
    threading.Thread(target=server.serve_forever, name="titan-board", daemon=True).start()
    return server


class _Transport(xmlrpc.client.Transport):
    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.timeout = timeout

    def make_connection(self, host):
        # A fresh connection per call: one left open across a cut link would hang on reuse.
        self._connection = (None, None)
        connection = super().make_connection(host)
        connection.timeout = self.timeout
        return connection


class BoardClient:
    """A node's line to the head's board: every call gives up after `timeout` seconds and
    raises OSError (or a protocol error) then."""

    def __init__(self, address: str, port: int, timeout: float) -> None:
        host = f"[{address}]" if ":" in address else address
        self.url = f"http://{host}:{port}/"
        self.timeout = timeout

    def call(self, name: str, *args, timeout: float | None = None):
        proxy = xmlrpc.client.ServerProxy(
            self.url, transport=_Transport(timeout or self.timeout), allow_none=True
        )
        try:
            return getattr(proxy, name)(*args)
        except (xmlrpc.client.Error, http.client.HTTPException) as e:
            raise OSError(str(e)) from e
        finally:
            proxy("close")()
