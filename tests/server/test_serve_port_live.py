"""`inferd serve` says "listening" only once it holds its port, and the helper that starts it
(benchmarks and tests alike) waits for that line: a port taken between choosing it and binding
it ends that server with uvicorn's error, and the helper starts it again on another port,
instead of taking whatever answers on the port for ours."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

import inferd.bench.process as process


def test_a_taken_port_is_retried_on_another(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        chosen: list[int] = []
        real = process.free_port

        def first_the_taken_one() -> int:
            chosen.append(port if not chosen else real())
            return chosen[-1]

        monkeypatch.setattr(process, "free_port", first_the_taken_one)
        log = tmp_path / "serve.log"
        with process.serve_subprocess(["-m", str(smollm2_gguf)], log) as (url, proc):
            assert chosen[0] == port and len(chosen) == 2
            assert url == f"http://127.0.0.1:{chosen[1]}"
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert f"inferd  listening  {url}/v1" in log.read_text()
            assert proc.poll() is None
