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
def serve_subprocess(
    args: Sequence[str], log: Path, timeout: float = 300
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`inferd serve ARGS` on a free loopback port, healthy before it is yielded, always stopped.

    Yields the base URL (without /v1) and the process; its output goes to ``log``.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, timeout)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def start_server(model: Path, extra: Sequence[str], log: Path) -> Iterator[ServerProcess]:
    with serve_subprocess(["-m", str(model), *extra], log) as (url, proc):
        yield ServerProcess(url + "/v1", proc)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"inferd serve exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"inferd serve did not become healthy:\n{log.read_text()[-3000:]}")
