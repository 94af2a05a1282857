"""Peers that are servers: started on the same GGUF file and measured over HTTP like inferd.

- ``llama.cpp-server``: llama-cpp-python's OpenAI-compatible server (``pip install
  'llama-cpp-python[server]'``). It serves one request at a time; concurrent clients queue.
- ``llama-server``: llama.cpp's own server binary, with continuous batching over ``-np``
  parallel slots, when one is on PATH (or named by ``$LLAMA_SERVER``).

Each is optional: when it is missing the report says so and the run goes on.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from inferd.bench.process import free_port

PARALLEL_SLOTS = 16  # llama-server's -np: room for the 16-way workload
CONTEXT_PER_SLOT = 4096


class PeerUnavailable(RuntimeError):
    """The peer is not installed here; the message says what would install it."""


def llama_cpp_python_server(gguf: Path, port: int, threads: int) -> list[str]:
    for module in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings"):
        if importlib.util.find_spec(module) is None:
            raise PeerUnavailable(
                f"{module} is missing: pip install 'llama-cpp-python[server]' (make bench does)"
            )
    return [
        sys.executable,
        *("-m", "llama_cpp.server", "--model", str(gguf)),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--n_threads", str(threads), "--n_ctx", str(CONTEXT_PER_SLOT)),
        # Otherwise each new request cuts off the stream in progress.
        *("--interrupt_requests", "False"),
    ]


def llama_server(gguf: Path, port: int, threads: int) -> list[str]:
    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        raise PeerUnavailable("no llama-server on PATH (or $LLAMA_SERVER)")
    return [
        binary,
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-np", str(PARALLEL_SLOTS)),
        *("-c", str(PARALLEL_SLOTS * CONTEXT_PER_SLOT), "--jinja"),
    ]


SERVER_PEERS: dict[str, Callable[[Path, int, int], list[str]]] = {
    "llama.cpp-server": llama_cpp_python_server,
    "llama-server": llama_server,
}


@contextmanager
def start_peer_server(
    name: str, gguf: Path, threads: int, log: Path, timeout: float = 300
) -> Iterator[str]:
    """Start the named peer on a free loopback port; yields its OpenAI base URL (with /v1)."""
    port = free_port()
    command = SERVER_PEERS[name](gguf, port, threads)
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_ready(api, proc, log, timeout)
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(api: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the peer exited early:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(api + "/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the peer did not become ready:\n{log.read_text()[-2000:]}")
