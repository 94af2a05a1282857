"""inferd as a Ray Serve application on a local Ray cluster on loopback: two replicas of the
default model behind Serve's HTTP proxy, driven with the openai SDK and raw HTTP.

One cluster for the file (starting Ray and loading two replicas is most of its time); the
replica kill runs last, as it changes the cluster."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray  # the test extra installs inferd[ray]
from ray import serve

from inferd.config import EngineConfig
from inferd.ray import build_deployment
from inferd.ray.args import Scale
from inferd.ray.deployment import APP_NAME, REPLICA_DEPLOYMENT
from inferd.server.crosssite import HostAllowList
from inferd.server.options import ServerOptions
from inferd.serving.spec import ModelSpec

REPLICA = "x-inferd-replica"
TIMEOUT = 180.0  # a busy two-core machine: generous, never a speed assertion
SYSTEM = (
    "You are the help desk of the Lighthouse Museum. Visitors ask about opening hours, the "
    "lens room, the keeper's cottage, the tide tables, the gift shop and the ferry. Answer in "
    "one short sentence, politely, and never invent prices. "
) * 6  # ~1.5k characters: several routing blocks and several KV blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Serve's proxy URL with the application running (both replicas healthy)."""
    port = _free_port()
    # address="local": a cluster of our own, never another process's
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = EngineConfig(max_model_len=2048, kv_cache_tokens=8192, max_num_seqs=8)
        # the Host allow-list `inferd serve` always sets (the ingress checks it, not the replicas)
        options = ServerOptions(allowed_hosts=HostAllowList.for_server("127.0.0.1", port))
        app = build_deployment(
            ModelSpec(model_id=str(smollm2_gguf)),
            engine,
            options,
            scale=Scale(replicas=2),
            num_cpus=0.5,
        )
        serve.run(app, name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(url: str, content: str, *, system: str | None = None, **extra: Any) -> httpx.Response:
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    headers = extra.pop("headers", {})
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response


def _metric_samples(url: str, name: str) -> dict[str, float]:
    """replica -> value of ``name`` from the aggregated /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = out.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_chat_and_stream_through_the_proxy(cluster: str) -> None:
    from openai import OpenAI

    with OpenAI(base_url=f"{cluster}/v1", api_key="none", timeout=TIMEOUT) as client:
        raw = client.chat.completions.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8
        )
        reply = raw.parse()
        assert reply.choices[0].message.content
        assert raw.headers.get(REPLICA)  # the replica that answered says so
        stream = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=12,
            stream=True,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        assert any(c.choices and c.choices[0].finish_reason for c in chunks)
    # Anthropic's route and stream, through the same proxy
    from anthropic import Anthropic

    with Anthropic(base_url=cluster, api_key="none", timeout=TIMEOUT) as claude:
        message = claude.messages.create(
            model="default", max_tokens=8, messages=[{"role": "user", "content": "Say hi."}]
        )
        assert message.content[0].type == "text" and message.content[0].text
        with claude.messages.stream(
            model="default", max_tokens=8, messages=[{"role": "user", "content": "Say hi."}]
        ) as events:
            assert events.get_final_text()
    # a body past the limit is refused at the ingress, in the caller's envelope
    big = httpx.post(
        f"{cluster}/v1/chat/completions",
        content=b"{" + b" " * (17 * 2**20) + b"}",
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


def test_models_and_metrics_aggregate_the_replicas(cluster: str) -> None:
    models = httpx.get(f"{cluster}/v1/models", timeout=TIMEOUT).json()
    assert len(models["data"]) == 1  # one model, served by both replicas
    card = models["data"][0]
    assert card["status"] == "loaded"
    assert len({r["replica"] for r in card["replicas"]}) == 2
    running = _metric_samples(cluster, "inferd_kv_blocks_total")
    assert len(running) == 2 and all(v > 0 for v in running.values())  # a pool each
    ready = httpx.get(f"{cluster}/ready", timeout=TIMEOUT)
    assert ready.status_code == 200 and ready.json()["ready_replicas"] == 2


def test_a_session_sticks_to_one_replica(cluster: str) -> None:
    by_header = {
        _chat(cluster, f"Question {i}?", headers={"x-session-id": "alice"}).headers[REPLICA]
        for i in range(5)
    }
    assert len(by_header) == 1
    by_user = {_chat(cluster, f"Another {i}?", user="bob").headers[REPLICA] for i in range(5)}
    assert len(by_user) == 1


def test_a_shared_prefix_goes_to_the_replica_holding_it(cluster: str) -> None:
    questions = ["When do you open?", "Is the lens room open?", "Where is the ferry?", "Gifts?"]
    replicas = [_chat(cluster, q, system=SYSTEM).headers[REPLICA] for q in questions]
    assert len(set(replicas)) == 1, replicas
    # ... and it paid: that replica served the later prompts' prefix from its cache
    hits = _metric_samples(cluster, "inferd_prefix_cache_hits_total")
    assert hits[replicas[0]] > 0
    routed = httpx.get(f"{cluster}/metrics", timeout=TIMEOUT).text
    assert 'inferd_ray_routed_total{reason="prefix"}' in routed


def test_a_killed_replica_ends_its_stream_with_an_error_and_the_rest_carry_on(
    cluster: str,
) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count from one to one thousand in words."}],
        "max_tokens": 1500,
        "ignore_eos": True,  # long enough to be killed mid-way, whatever the model says
        "stream": True,
    }
    events: list[str] = []
    with httpx.stream(
        "POST", f"{cluster}/v1/chat/completions", json=body, timeout=TIMEOUT
    ) as response:
        assert response.status_code == 200
        victim = response.headers[REPLICA]
        lines = response.iter_lines()
        for line in lines:  # the stream is under way ...
            if line.startswith("data: ") and '"content"' in line:
                break
        actor = ray.get_actor(
            f"SERVE_REPLICA::{APP_NAME}#{REPLICA_DEPLOYMENT}#{victim}", namespace="serve"
        )
        ray.kill(actor, no_restart=False)  # ... when its replica dies
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"  # never a silent cut
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_failed"
    # new requests reach the survivor (and, once Serve has restarted it, the new replica)
    for i in range(3):
        assert _chat(cluster, f"Still there {i}?").json()["choices"][0]["message"]["content"]
    ready = httpx.get(f"{cluster}/ready", timeout=TIMEOUT)
    assert ready.status_code == 200 and ready.json()["ready_replicas"] >= 1
    # Serve restarts the dead replica: /ready counts two again, neither of them the victim
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        answer = httpx.get(f"{cluster}/ready", timeout=TIMEOUT).json()
        if answer["ready_replicas"] == 2:
            break
        time.sleep(2)
    assert answer["ready_replicas"] == 2, answer
    assert victim not in answer["replicas"]
