"""Start `kvbuffer serve` on the demo model in a subprocess, on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

STARTUP_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvbuffer.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--device", "cpu", "--log-level", "warning", *args]
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the server
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvbuffer serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvbuffer serve did not answer within {STARTUP_TIMEOUT_S} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait_idle(self, timeout: float = 30) -> dict:
        """Poll /health until nothing is in flight and every request slot is free (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["in_flight"] == 0 and h["running"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
                return h
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
