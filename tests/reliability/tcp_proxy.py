"""A TCP proxy on loopback whose connections a test can cut (fault injection for Postgres/S3)."""

from __future__ import annotations

import socket
import threading
import time


class TcpProxy:
    """Forwards 127.0.0.1:<port> to `upstream`. `cut()` resets every open connection and refuses
    new ones until `restore()`; `cut_after(n)` resets a connection once it has sent n bytes
    upstream (a cut in the middle of a request body); `blackhole()` keeps every connection open
    and accepts new ones but forwards nothing either way (the bytes wait) until `restore()`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.down = False
        self.limit: int | None = None
        self.cuts = 0
        self.held = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.down:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
                server.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._conns |= {client, server}
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                while self.held.is_set() and not self._closed and not self.down:
                    time.sleep(0.01)
                if not data or self.down:
                    break
                if upstream and self.limit is not None and sent + len(data) > self.limit:
                    dst.sendall(data[: max(0, self.limit - sent)])
                    self.cut()
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _reset(s)
            with self._lock:
                self._conns -= {src, dst}

    def cut(self) -> None:
        self.down = True
        self.cuts += 1
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            _reset(s)

    def cut_after(self, nbytes: int) -> None:
        self.limit = nbytes

    def blackhole(self) -> None:
        self.held.set()

    def restore(self) -> None:
        self.limit = None
        self.down = False
        self.held.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.sock.close()


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
