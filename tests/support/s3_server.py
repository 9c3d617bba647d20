"""A real S3-compatible server on localhost for the tests and benchmarks: moto's standalone server in its own
process (what s3fs's own tests use), behind a TCP proxy that can cut responses mid-body (as a dropped
connection does), leave requests unanswered (as a stalled endpoint does) or run an action before forwarding
one; and a server that accepts connections and never answers at all."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from typing import Callable, Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class CuttingProxy:
    """Forwards 127.0.0.1:port to the server. cut(pattern, times): the next `times` responses to requests whose
    first line holds `pattern` stop after their headers and part of their body, and the connection closes.
    stall(pattern): requests whose first line holds it are never answered (until stall("")).
    before(marker, action): action() runs before the next request whose head (first line and headers) holds
    `marker` is forwarded, once."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pattern, self._cuts_left, self.cuts_made = b"", 0, 0
        self._stalled, self.stalls_made = b"", 0
        self._before: tuple[bytes, Callable[[], None]] | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, pattern: str, times: int) -> None:
        with self._lock:
            self._pattern, self._cuts_left, self.cuts_made = pattern.encode(), times, 0

    def stall(self, pattern: str) -> None:
        with self._lock:
            self._stalled, self.stalls_made = pattern.encode(), 0

    def before(self, marker: str, action: Callable[[], None]) -> None:
        with self._lock:
            self._before = (marker.encode(), action)

    def _claim_stall(self, request_line: bytes) -> bool:
        with self._lock:
            if self._stalled and self._stalled in request_line:
                self.stalls_made += 1
                return True
            return False

    def _claim_action(self, head: bytes) -> Callable[[], None] | None:
        with self._lock:
            if self._before is None or self._before[0] not in head:
                return None
            action, self._before = self._before[1], None
            return action

    def _claim_cut(self, request_line: bytes) -> bool:
        with self._lock:
            if self._cuts_left and self._pattern in request_line:
                self._cuts_left -= 1
                self.cuts_made += 1
                return True
            return False

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        last_request = [b""]

        def requests_in() -> None:
            stalled = False
            try:
                while data := client.recv(1 << 16):
                    if data[:8].split(b" ")[0] in (b"GET", b"PUT", b"HEAD", b"POST", b"DELETE"):
                        last_request[0] = data.split(b"\r\n", 1)[0]
                        stalled = self._claim_stall(last_request[0])
                        if action := self._claim_action(data.split(b"\r\n\r\n", 1)[0]):
                            action()
                    if not stalled:  # a stalled request (and what follows on its connection) never reaches the server
                        upstream.sendall(data)
            except OSError:
                pass
            finally:
                upstream.close()

        threading.Thread(target=requests_in, daemon=True).start()
        cutting = False
        try:
            while data := upstream.recv(1 << 16):
                if not cutting and data.startswith(b"HTTP/"):
                    cutting = self._claim_cut(last_request[0])
                if cutting:  # forward the headers and half of the body bytes that came with them, then the line goes dead
                    headers_end = 0
                    if data.startswith(b"HTTP/"):
                        found = data.find(b"\r\n\r\n")
                        headers_end = len(data) if found < 0 else found + 4
                    if len(data) - headers_end >= 2:
                        client.sendall(data[: headers_end + (len(data) - headers_end) // 2])
                        break
                client.sendall(data)
        except OSError:
            pass
        finally:
            for end in (client, upstream):  # shutdown, not only close: the other thread's recv still holds the socket
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                end.close()


class SilentServer:
    """Accepts connections on 127.0.0.1:port and never answers, as a stalled proxy or server does; counts the
    requests it was sent (their first lines, in `requests`)."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.requests: list[bytes] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self._listener.accept()
            threading.Thread(target=self._listen, args=(client,), daemon=True).start()

    def _listen(self, client: socket.socket) -> None:
        with client:
            try:
                while data := client.recv(1 << 16):
                    if data[:8].split(b" ")[0] in (b"GET", b"PUT", b"HEAD", b"POST", b"DELETE"):
                        self.requests.append(data.split(b"\r\n", 1)[0])
            except OSError:
                pass


@contextmanager
def s3_server() -> Iterator[CuttingProxy]:
    """moto's S3 server in a process, behind a CuttingProxy; the environment (AWS_ENDPOINT_URL_S3, test
    credentials) points the standard AWS configuration at it while the block runs."""
    server_port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(server_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    saved = {name: os.environ.get(name) for name in (*CREDENTIALS, "AWS_ENDPOINT_URL_S3")}
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{server_port}/moto-api/", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto's S3 server did not start (pip install 'moto[s3]' flask flask-cors)") from None
                time.sleep(0.1)
        proxy = CuttingProxy(server_port)
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL_S3=f"http://127.0.0.1:{proxy.port}")
        yield proxy
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.terminate()
        server.wait(timeout=30)


def make_bucket(name: str) -> None:
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
