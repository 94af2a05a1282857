"""How long slow clients hold connections to `inferd serve` with the default timeouts.

    .venv/bin/python benchmarks/slow_clients.py [CONNECTIONS]

Opens CONNECTIONS (default 200) connections on loopback: a half idle, a quarter that stop
halfway through a request head, a quarter that stop halfway through a body; then reports when
the server closed them (seconds after opening, per kind) and whether a normal request is still
answered. Before the head and body timeouts, all of them stayed open indefinitely.
"""

from __future__ import annotations

import selectors
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from inferd.bench.process import serve_subprocess
from inferd.store import DEFAULT_MODEL, ModelStore

BODY_HEAD = (
    "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"messages": ['
)


def main(connections: int) -> None:
    model = ModelStore().entry_path(DEFAULT_MODEL)
    assert model is not None, f"`inferd pull {DEFAULT_MODEL}` first"
    log = Path(tempfile.mkdtemp()) / "serve.log"
    with serve_subprocess(["-m", str(model), "--access-log-format", "off"], log) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        kinds = ["idle"] * (connections // 2)
        kinds += ["head"] * (connections // 4)
        kinds += ["body"] * (connections - len(kinds))
        selector = selectors.DefaultSelector()
        opened = time.monotonic()
        for kind in kinds:
            sock = socket.create_connection(("127.0.0.1", port))
            if kind == "head":
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            elif kind == "body":
                sock.sendall(BODY_HEAD.format(port=port).encode())
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, kind)
        closed: dict[str, list[float]] = {"idle": [], "head": [], "body": []}
        deadline = opened + 300
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    closed[key.data].append(time.monotonic() - opened)
                    selector.unregister(sock)
                    sock.close()
        left = len(selector.get_map())
        for kind, times in closed.items():
            if times:
                print(f"{kind:5} {len(times):4} closed, the last after {max(times):5.1f}s")
        print(f"still open after 300 s: {left}")
        ok = httpx.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        print(f"a normal request afterwards: {ok.status_code}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
