"""Start `inferd serve` as a subprocess on a free loopback port and read its peak memory."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
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


PORT_ATTEMPTS = 3  # a free port can be taken by another process before the server binds it


@contextmanager
def serve_subprocess(
    args: Sequence[str], log: Path, timeout: float = 300
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`inferd serve ARGS` on a free loopback port, healthy before it is yielded, always stopped.

    Ready means its own "listening" line (printed once it holds the socket) and a healthy
    /health: another server that took the port in between answers /health too. A server that
    found its port taken is started again on another. Yields the base URL (without /v1) and
    the process; its output goes to ``log``.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "inferd", "serve", "--port", str(port), *args]
        with ExitStack() as stack:
            try:
                proc = stack.enter_context(
                    run_server(
                        cmd,
                        url + "/health",
                        log,
                        timeout,
                        "inferd serve",
                        ready_line=f"listening  {url}/v1",
                    )
                )
            except RuntimeError as exc:
                if attempt < PORT_ATTEMPTS and "address already in use" in str(exc):
                    continue
                raise
            yield url, proc
            return


@contextmanager
def start_server(model: Path, extra: Sequence[str], log: Path) -> Iterator[ServerProcess]:
    with serve_subprocess(["-m", str(model), *extra], log) as (url, proc):
        yield ServerProcess(url + "/v1", proc)


@contextmanager
def run_server(
    command: Sequence[str],
    ready_url: str,
    log: Path,
    timeout: float,
    what: str,
    ready_line: str | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (output to ``log``) until the block ends; ready when ``ready_url`` is 200
    (and ``ready_line`` is in its output, where given)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(ready_url, proc, log, timeout, what, ready_line)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(
    url: str,
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout: float,
    what: str,
    ready_line: str | None,
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited early:\n{log.read_text()[-3000:]}")
        if ready_line is not None and ready_line not in log.read_text(errors="replace"):
            time.sleep(0.3)
            continue
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{what} did not become ready:\n{log.read_text()[-3000:]}")
