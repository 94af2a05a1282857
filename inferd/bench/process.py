"""Start `inferd serve` as a subprocess on a free loopback port and read its peak memory."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True, slots=True)
class ServerProcess:
    api: str
    process: subprocess.Popen[bytes]

    def peak_rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def start_server(
    model: Path, extra: Sequence[str], log: Path, timeout: float = 300
) -> Iterator[ServerProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "-m", str(model), "--port", str(port), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://127.0.0.1:{port}/v1", proc)
    try:
        _wait_ready(server, log, timeout)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(server: ServerProcess, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    health = server.api.removesuffix("/v1") + "/health"
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"inferd serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(health, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("inferd serve did not become healthy")
