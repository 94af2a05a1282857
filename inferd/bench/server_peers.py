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
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from inferd.bench.process import free_port, run_server

# llama-server's -np: 16 slots (what the 1- and 16-stream workloads have always run against),
# or a workload's streams where it has more: the 64-stream one gets a server of its own.
PARALLEL_SLOTS = 16
CONTEXT_PER_SLOT = 4096


class PeerUnavailable(RuntimeError):
    """The peer is not installed here; the message says what would install it."""


def llama_cpp_python_server(gguf: Path, port: int, threads: int, slots: int) -> list[str]:
    del slots  # one request at a time
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


def llama_server(gguf: Path, port: int, threads: int, slots: int) -> list[str]:
    binary = os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    if not binary:
        raise PeerUnavailable("no llama-server on PATH (or $LLAMA_SERVER)")
    return [
        binary,
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-np", str(slots)),
        *("-c", str(slots * CONTEXT_PER_SLOT), "--jinja"),
    ]


SERVER_PEERS: dict[str, Callable[[Path, int, int, int], list[str]]] = {
    "llama.cpp-server": llama_cpp_python_server,
    "llama-server": llama_server,
}


@contextmanager
def start_peer_server(
    name: str,
    gguf: Path,
    threads: int,
    log: Path,
    timeout: float = 300,
    extra: Sequence[str] = (),
    slots: int = PARALLEL_SLOTS,
) -> Iterator[str]:
    """Start the named peer on a free loopback port; yields its OpenAI base URL (with /v1).
    ``extra``: more command-line flags for the peer; ``slots``: streams it serves at once."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/v1"
    command = [*SERVER_PEERS[name](gguf, port, threads, slots), *extra]
    with run_server(command, api + "/models", log, timeout, name):
        yield api
