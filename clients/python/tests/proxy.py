"""A loopback TCP proxy that loses answers: it cuts (resets) a connection instead of
forwarding a server→client chunk larger than a threshold, a given number of times across
every proxy sharing the `Cuts`. Requests always get through, so the server has acted.
`frozen`: it forwards nothing either way, as a replica stopped with SIGSTOP. `delay`: each
answer is held this long (s), as a network that delivers late."""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Optional


class Cuts:
    """How many large answers to lose, shared by several proxies."""

    def __init__(self, n: int, threshold: int) -> None:
        self.left = n
        self.done = 0
        self.threshold = threshold
        self._lock = threading.Lock()

    def take(self, size: int) -> bool:
        with self._lock:
            if size < self.threshold or self.left <= 0:
                return False
            self.left -= 1
            self.done += 1
            return True


class FaultProxy:
    """Forwards 127.0.0.1:`port` (0: an ephemeral one) to `target`, losing what `cuts` says."""

    def __init__(self, target: str, cuts: Cuts, port: int = 0) -> None:
        host, target_port = target.rsplit(":", 1)
        self.target = (host, int(target_port))
        self.cuts = cuts
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(64)
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self._closed = False
        self.frozen = False
        self.delay = 0.0
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.frozen:
                    continue
                if answers and self.delay:
                    time.sleep(self.delay)
                if answers and self.cuts.take(len(data)):
                    # Lose this answer: reset both sides, as a dying network would.
                    for s in (src, dst):
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        s.close()
                    return
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
