"""Run a real `inferd serve` subprocess on a free loopback port for tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from inferd.bench.process import serve_subprocess


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


@contextmanager
def live_server(
    args: Sequence[str], log: Path, startup_timeout: float = 180
) -> Iterator[LiveServer]:
    with serve_subprocess(args, log, startup_timeout) as (url, proc):
        yield LiveServer(url, proc, log)


def lora_server_args(folder: Path, adapters: Iterable[str]) -> list[str]:
    """``inferd serve`` flags for the tiny float32 base in ``folder/base`` with the adapters
    ``folder/NAME``, one resident at a time, admin routes behind the key "admin-secret",
    runtime loads from under ``folder``."""
    args = ["-m", str(folder / "base"), "--dtype", "f32", "--max-seq-len", "128"]
    for name in adapters:
        args += ["--lora", f"{name}={folder / name}"]
    args += ["--lora-root", str(folder)]  # POST /v1/load_lora_adapter reads under it only
    return [*args, "--admin-key", "admin-secret", "--access-log-format", "off", "--max-loras", "1"]
