"""Prometheus text exposition of engine gauges and counters, per model."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from inferd.server.state import ServerState

# (metric name, EngineStats field, type, help)
_ENGINE_SERIES = (
    ("inferd_requests_running", "running", "gauge", "Requests being computed."),
    ("inferd_requests_waiting", "waiting", "gauge", "Requests queued for admission."),
    ("inferd_kv_blocks_used", "kv_blocks_used", "gauge", "KV-cache blocks held by requests."),
    ("inferd_kv_blocks_total", "kv_blocks_total", "gauge", "KV-cache blocks in the pool."),
    ("inferd_preemptions_total", "preemptions", "counter", "Requests preempted for KV space."),
    ("inferd_prompt_tokens_total", "prompt_tokens", "counter", "Prompt tokens admitted."),
    ("inferd_generation_tokens_total", "generated_tokens", "counter", "Tokens generated."),
    ("inferd_engine_steps_total", "steps", "counter", "Engine steps run."),
)


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.inferd
    stats = {name: m.engine.stats() for name, m in state.models.items()}
    lines = []
    for metric, field, kind, help_text in _ENGINE_SERIES:
        lines.append(f"# HELP {metric} {help_text}")
        lines.append(f"# TYPE {metric} {kind}")
        for model, s in stats.items():
            lines.append(f'{metric}{{model="{_escape(model)}"}} {getattr(s, field)}')
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
