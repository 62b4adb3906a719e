"""A ``mooncake_master`` on this machine's loopback, for tests, the example and the bench.

It owns one master process and the HTTP metadata server the clients find each other through: it
picks free ports on 127.0.0.1 (the master's RPC port and its metrics port, which otherwise listens
on 0.0.0.0:9003 and so clashes between two masters), starts the master, waits until it accepts
connections, and stops, kills, pauses or restarts it on the same ports (the fault tests). The
master listens on nothing else. Only the binary shipped by the ``mooncake-transfer-engine-non-cuda``
wheel is needed; the Mooncake client is imported by no process but a :class:`StoreNode`'s (one that
lends memory to the cluster and does nothing else: the bench's topology).

Why the metadata server is ours: the master's built-in one (``--enable_http_metadata_server``)
binds 0.0.0.0 whatever ``--http_metadata_server_host`` says (0.3.13.post1), and the package's
Python one needs aiohttp. The protocol is four verbs on ``/metadata?key=K`` (GET: the value or
404; PUT: store it, refusing a second ``rpc_meta`` key with 400; DELETE: remove it or 404), as in
Mooncake's ``http_metadata_server.py``; this file run as a script serves it (stdlib only). Like an
etcd beside the master in a real deployment, it outlives a master killed and restarted.

A production master is started by the operator, not by this module (see docs/distributed.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO, Self
from urllib.parse import parse_qs, urlsplit

LOOPBACK = "127.0.0.1"


def master_binary() -> str:
    """The path of ``mooncake_master``: the one inside the installed ``mooncake`` package, else the
    one beside this Python, else the one on PATH. Raises FileNotFoundError naming where it looked."""
    spec = importlib.util.find_spec("mooncake")
    candidates = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(location) / "mooncake_master" for location in spec.submodule_search_locations]
    candidates.append(Path(sys.executable).parent / "mooncake_master")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise FileNotFoundError("mooncake_master not found (install mooncake-transfer-engine-non-cuda); looked in "
                            + ", ".join(str(c) for c in candidates) + " and PATH")


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (another process may take it before use)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class MetadataServer:
    """Mooncake's HTTP metadata protocol on 127.0.0.1, in a process of its own (see the module
    docstring): the client's ``setup`` holds the GIL while it waits for the metadata server, so a
    thread of the calling process would never answer it. :meth:`start` picks a free port;
    :attr:`url` is what clients are given."""

    def __init__(self) -> None:
        self.port = 0
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}/metadata"

    def start(self, timeout: float = 20.0) -> None:
        # this file as a script: stdlib only, so it starts without importing uring_kv or torch
        self.process = subprocess.Popen([sys.executable, "-P", __file__, "--serve-metadata"], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.process.stdout is not None
        ready = threading.Timer(timeout, self.process.kill)
        ready.start()
        try:
            line = self.process.stdout.readline()
        finally:
            ready.cancel()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the metadata server did not start (it said {line!r})")
        self.port = int(line)

    def stop(self) -> None:
        """Stop it; idempotent."""
        process, self.process = self.process, None
        if process is not None:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stdout is not None:
                process.stdout.close()


def serve_metadata() -> None:
    """Serve the metadata protocol on 127.0.0.1 (a free port, printed on one line) until SIGTERM."""
    values: dict[str, bytes] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _key(self) -> str | None:
            url = urlsplit(self.path)
            key = (parse_qs(url.query).get("key") or [""])[0].strip()
            if url.path != "/metadata" or not key:
                self._reply(400, b"metadata key is required")
                return None
            return key

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if (key := self._key()) is not None:
                with lock:
                    value = values.get(key)
                if value is None:
                    self._reply(404, b"metadata not found")
                else:
                    self._reply(200, value)

        def do_PUT(self) -> None:
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if (key := self._key()) is not None:
                with lock:
                    duplicate = "rpc_meta" in key and key in values
                    if not duplicate:
                        values[key] = data
                if duplicate:
                    self._reply(400, b"Duplicate rpc_meta key not allowed")
                else:
                    self._reply(200, b"metadata updated")

        def do_DELETE(self) -> None:
            if (key := self._key()) is not None:
                with lock:
                    found = values.pop(key, None) is not None
                if found:
                    self._reply(200, b"metadata deleted")
                else:
                    self._reply(404, b"metadata not found")

        def log_message(self, format: str, *args: object) -> None:  # quiet: no line per request
            pass

    server = ThreadingHTTPServer((LOOPBACK, 0), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(server.server_address[1], flush=True)
    server.serve_forever()
    server.server_close()


class LocalMaster:
    """A ``mooncake_master`` on 127.0.0.1, on free ports, with a :class:`MetadataServer`.

    ``with LocalMaster() as master:`` starts it and stops it; :attr:`master_address` and
    :attr:`metadata_server` are what clients pass to ``setup``. ``extra_args`` go to the master
    as they are (e.g. ``["--default_kv_lease_ttl=100"]``). Its log goes to :attr:`log_path`."""

    def __init__(self, extra_args: list[str] | None = None, start_timeout: float = 20.0) -> None:
        self.binary = master_binary()
        self.extra_args = list(extra_args or [])
        self.start_timeout = start_timeout
        self.rpc_port = self.metrics_port = 0
        self.metadata = MetadataServer()
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="uring-kv-mooncake-master-")
        self.log_path = os.path.join(self._dir, "master.log")
        self._log: IO[bytes] | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The URL of the HTTP metadata server."""
        return self.metadata.url

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def start(self) -> None:
        """Start the metadata server, then the master on fresh free ports (a few tries: a port may be
        taken between the pick and the bind)."""
        self.metadata.start()
        for attempt in range(3):
            self.rpc_port, self.metrics_port = free_port(), free_port()
            try:
                self._launch()
                return
            except RuntimeError:
                if attempt == 2:
                    self.metadata.stop()
                    raise

    def restart(self) -> None:
        """Start it again on the same ports (after :meth:`kill` or :meth:`stop`): a new master that
        knows no segment and no object."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError("the master is still running")
        self._launch()

    def _launch(self) -> None:
        args = [self.binary, f"--rpc_address={LOOPBACK}", f"--rpc_port={self.rpc_port}", f"--metrics_host={LOOPBACK}",
                f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false", *self.extra_args]
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115  (kept open for the master's life)
        self.process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode} at start; "
                                   f"its log: {self.log_path}\n{self.log_tail()}")
            if _accepts(self.rpc_port):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master did not listen within {self.start_timeout} s; its log: {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds; then the metadata
        server. Idempotent."""
        self.stop_master(timeout)
        self.metadata.stop()

    def stop_master(self, timeout: float = 10.0) -> None:
        """Stop the master alone (SIGTERM, then SIGKILL after ``timeout`` seconds); idempotent."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)  # a paused master cannot act on SIGTERM
                process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL it and reap it (a crash: no clean shutdown)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def pause(self) -> None:
        """SIGSTOP: it keeps its sockets but answers nothing (a network partition, as clients see it)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


class StoreNode:
    """A process that only lends memory to the cluster: a Mooncake client with a segment of
    ``segment_bytes`` and no other work (Mooncake ships a ``mooncake_client`` binary for this; a
    Python client keeps to the flags this module already passes). Values put by clients that lend
    none land here, and reads of them cross a process boundary over TCP, as they would between
    machines. ``with StoreNode(master, segment_bytes):`` starts it (once its segment is mounted)
    and stops it."""

    def __init__(self, master: LocalMaster, segment_bytes: int, start_timeout: float = 60.0) -> None:
        self.master, self.segment_bytes, self.start_timeout = master, segment_bytes, start_timeout
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Self:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": LOOPBACK}
        self.process = subprocess.Popen(
            [sys.executable, "-P", __file__, "--store-node", self.master.master_address, self.master.metadata_server,
             str(self.segment_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, env=env, start_new_session=True)
        assert self.process.stdout is not None
        ready = threading.Timer(self.start_timeout, self.process.kill)
        ready.start()
        try:
            line = self.process.stdout.readline().strip()
        finally:
            ready.cancel()
        if line != "ready":
            self.__exit__()
            raise RuntimeError(f"the store node did not start (it said {line!r})")
        return self

    def __exit__(self, *exc: object) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            assert process.stdin is not None
            process.stdin.close()  # it closes its client and exits
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def serve_segment(master_address: str, metadata_server: str, segment_bytes: int) -> None:
    """A store node's process: mount a segment, say ``ready``, hold it until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup(LOOPBACK, metadata_server, segment_bytes, 16 << 20, "tcp", "", master_address)
    if rc != 0:
        print(f"setup failed ({rc})", flush=True)
        sys.exit(1)
    print("ready", flush=True)
    sys.stdin.read()
    client.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-metadata"]:
        serve_metadata()
    elif sys.argv[1:2] == ["--store-node"] and len(sys.argv) == 5:
        serve_segment(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit("usage: mooncake_master.py --serve-metadata | --store-node MASTER METADATA SEGMENT_BYTES")
