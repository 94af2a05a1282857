"""Run a real `inferd serve` subprocess on a free loopback port for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def api(self) -> str:
        return self.url + "/v1"

    def metric(self, name: str) -> float:
        body = httpx.get(self.url + "/metrics", timeout=10).text
        for line in body.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def live_server(
    args: Sequence[str], log: Path, startup_timeout: float = 180
) -> Iterator[LiveServer]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    server = LiveServer(f"http://127.0.0.1:{port}", proc, log)
    try:
        _wait_healthy(server, startup_timeout)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_healthy(server: LiveServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"inferd serve exited early:\n{server.log.read_text()[-3000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"inferd serve did not become healthy:\n{server.log.read_text()[-3000:]}")
