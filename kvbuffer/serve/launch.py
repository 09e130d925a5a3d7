"""Start `kvbuffer serve` in a subprocess on a free loopback port and wait until it answers (for the
serving benchmark and the tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

STARTUP_TIMEOUT_S = 600  # a 9B-shaped model on a GPU allocates and captures its graphs first


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """args: `kvbuffer serve` options (host and port are chosen here)."""

    def __init__(self, *args: str, timeout: float = STARTUP_TIMEOUT_S):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvbuffer.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *args]
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvbuffer serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)  # also after an answer other than 200: poll, do not spin
        self.kill()
        raise RuntimeError(f"kvbuffer serve did not answer within {timeout:g} s:\n{self.output()}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        """Poll /health until no request is in flight (bounded); returns the last answer."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["in_flight"] == 0 and h["running"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (drains what is in flight), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
