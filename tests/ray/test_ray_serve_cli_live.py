"""`inferd serve --ray --replicas 2`, the README's command, as a real subprocess on a free
loopback port: ready once it says it listens, the model listed and answering the official openai
SDK, a foreign Host refused by the ingress, and on SIGTERM its local Ray cluster gone with it.

`inferd serve` always sets a Host allow-list; build_deployment's callers in
test_ray_serve_live.py need not, so only this path showed the replicas refusing their own
ingress (421 on every /ready fan-out, /ready never 200)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.server.live import live_server

TIMEOUT = 180.0  # a busy two-core machine: generous, never a speed assertion
STARTUP = 600.0  # a Ray cluster and two replicas loading the model on two cores
REPLICA = "x-inferd-replica"


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
    return fields[0], int(fields[1]), fields[19]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _descendants(root: int) -> dict[int, str]:
    """Every process under ``root`` (its Ray cluster: GCS, raylet, Serve's actors), pid -> start
    time, so a pid reused later is not taken for one of them."""
    stats = {int(p.name): _stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    children: dict[int, list[int]] = {}
    for pid, stat in stats.items():
        if stat is not None:
            children.setdefault(stat[1], []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        stat = stats[pid]
        if stat is not None:
            found[pid] = stat[2]
            todo += children.get(pid, [])
    return found


def _alive(pid: int, start: str) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[2] == start and stat[0] not in ("Z", "X")


@pytest.mark.usefixtures("smollm2_gguf")  # the default model the command serves, pulled
def test_serve_ray_replicas_answer_and_stop_with_their_cluster(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with live_server(["--ray", "--replicas", "2"], log, startup_timeout=STARTUP) as server:
        port = server.url.rsplit(":", 1)[1]
        cluster = _descendants(server.process.pid)
        names = [_cmdline(pid) for pid in cluster]
        assert any("raylet" in n for n in names), names  # a cluster of its own ...
        assert sum("inferd_replica" in n for n in names) == 2, names  # ... with two replicas

        # "listening" comes after serve.run, which returns once both replicas have loaded
        ready = httpx.get(f"{server.url}/ready", timeout=TIMEOUT)
        assert ready.status_code == 200, ready.text
        assert ready.json()["ready_replicas"] == 2, ready.text
        models = httpx.get(f"{server.api}/models", timeout=TIMEOUT).json()
        assert [card["id"] for card in models["data"]] == ["smollm2"], models
        assert len(models["data"][0]["replicas"]) == 2

        with OpenAI(base_url=server.api, api_key="none", max_retries=0, timeout=TIMEOUT) as sdk:
            raw = sdk.chat.completions.with_raw_response.create(  # the default sampling
                model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
            )
            assert raw.parse().choices[0].message.content
            assert raw.headers.get(REPLICA)

        # the ingress checks the client's Host: a rebound page's name never reaches a replica
        foreign = {"host": f"evil.example:{port}"}
        refused = [
            httpx.get(f"{server.api}/models", headers=foreign, timeout=TIMEOUT),
            httpx.get(f"{server.url}/ready", headers=foreign, timeout=TIMEOUT),
            httpx.post(
                f"{server.api}/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                headers=foreign,
                timeout=TIMEOUT,
            ),
        ]
        for answer in refused:
            assert answer.status_code == 421, answer.text
            assert answer.json()["error"]["code"] == "host_not_allowed"
            assert REPLICA not in answer.headers
        # ... while the loopback names on its port are its own
        own = httpx.get(
            f"{server.api}/models", headers={"host": f"localhost:{port}"}, timeout=TIMEOUT
        )
        assert own.status_code == 200

        server.process.terminate()  # SIGTERM: serve.delete, serve.shutdown, ray.shutdown
        assert server.process.wait(TIMEOUT) == 0, log.read_text()[-3000:]
    deadline = time.monotonic() + TIMEOUT  # actors exit on their own once their raylet is gone
    left = dict(cluster)
    while left and time.monotonic() < deadline:
        left = {pid: start for pid, start in left.items() if _alive(pid, start)}
        time.sleep(0.5)
    assert not left, [_cmdline(pid) for pid in left]
