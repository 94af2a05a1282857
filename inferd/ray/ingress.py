"""InferdIngress: the Serve deployment behind Serve's HTTP proxy. It reads each request once,
works out its ``RouteHint`` (session key, prompt-prefix digests) and hands it to the inferd
replicas through a deployment handle whose ``PrefixAwareRouter`` picks the replica.

- Streams (SSE) are relayed event by event. A replica that dies mid-stream ends the stream with
  an error event (and ``data: [DONE]`` on OpenAI-style streams), never a silent cut; one that
  dies before answering is retried once on another replica (nothing was sent yet).
- Other responses are buffered whole, so a failed replica gives a 503 envelope, not half a body.
- ``/v1/models``, ``/metrics`` and ``/ready`` ask every live replica and merge the answers
  (cards list their replicas; metric samples gain a ``replica`` label; ready while any replica
  is). ``/health`` is the ingress's own.
- Other routes (lifecycle, responses store) act on the one replica they are routed to.
- The client's ``Host`` is checked here, before anything else (421 ``host_not_allowed``), against
  the allow-list `inferd serve` builds; the replicas' apps have none, as the requests they see
  come from this ingress (its own fan-out carries no Host at all).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from inferd.ray.routing import RouteHint, live_replicas, route_hint, router_state
from inferd.server import sse
from inferd.server.crosssite import HostAllowList, host_refusal
from inferd.server.envelope import error_response, stream_error_event
from inferd.server.forward import ForwardedRequest, ResponseHead

log = logging.getLogger("inferd.ray")

FAN_OUT_TIMEOUT = 30.0  # seconds one replica may take to answer /v1/models, /metrics, /ready
AGGREGATED = {"/v1/models", "/models", "/metrics", "/ready"}
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}

Answer = tuple[ResponseHead, bytes]


class InferdIngress:
    def __init__(
        self,
        replicas: Any,
        max_body_bytes: int | None = None,
        allowed_hosts: HostAllowList | None = None,
    ) -> None:
        self.handle = replicas.options(stream=True)  # replica.forward yields the response
        self.deployment = str(replicas.deployment_name)
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts  # None: no Host check (as build_app's)

    async def __call__(self, request: Request) -> Response:
        if self.allowed_hosts is not None:
            refusal = host_refusal(request.scope, self.allowed_hosts)
            if refusal is not None:
                return refusal
        path = request.url.path
        if request.method == "GET" and path == "/health":
            return JSONResponse({"status": "ok"})
        if request.method == "GET" and path in AGGREGATED:
            return await self._aggregate(request, path)
        body = await self._body(request)
        if body is None:
            msg = f"request body over {self.max_body_bytes} bytes"
            return error_response(request.scope, 413, msg, code="request_too_large")
        forwarded = ForwardedRequest(
            method=request.method,
            path=path,
            query_string=request.scope.get("query_string", b""),
            headers=tuple((bytes(k), bytes(v)) for k, v in request.scope["headers"]),
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
        )
        hint = route_hint(_json(body), {k.lower(): v for k, v in request.headers.items()})
        return await self._proxy(request, forwarded, hint)

    async def _body(self, request: Request) -> bytes | None:
        """The whole body, or None past ``max_body_bytes`` (read no further: the replicas would
        refuse it anyway, and the ingress must not buffer an unbounded one)."""
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if self.max_body_bytes is not None and size > self.max_body_bytes:
                return None
            parts.append(part)
        return b"".join(parts)

    # -- one request ---------------------------------------------------------------------------
    async def _proxy(
        self, request: Request, forwarded: ForwardedRequest, hint: RouteHint
    ) -> Response:
        failure: Exception | None = None
        for _attempt in range(2):  # a replica that died before answering: once more elsewhere
            gen = self.handle.forward.remote(forwarded, hint=hint)
            try:
                head = await gen.__anext__()
            except Exception as exc:  # Ray's actor errors: the replica is gone
                failure = exc
                log.warning("replica failed before answering: %s", exc)
                continue
            if not isinstance(head, ResponseHead):
                return error_response(request.scope, 502, "the replica answered no head")
            headers = [(k, v) for k, v in head.headers if k.lower() not in HOP_HEADERS]
            if (head.header(b"content-type") or b"").startswith(b"text/event-stream"):
                response: Response = StreamingResponse(
                    _relay(gen, request), status_code=head.status
                )
                response.raw_headers = headers  # the proxy frames the unknown length
                return response
            try:
                content = b"".join([chunk async for chunk in gen])
            except Exception as exc:
                log.warning("replica failed mid-response: %s", exc)
                msg = f"the replica serving this request failed: {_short(exc)}"
                return error_response(request.scope, 503, msg, code="replica_failed")
            response = Response(content, status_code=head.status)
            response.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
            return response
        msg = f"no replica could take the request: {_short(failure)}"
        return error_response(request.scope, 503, msg, code="replica_failed")

    # -- fan-out -------------------------------------------------------------------------------
    async def _replicas(self) -> list[str]:
        """The live replicas. Serve builds the router on the handle's first call, so before
        any request one cheap call builds it."""
        ids = live_replicas(self.deployment)
        if not ids:
            await _collect(self.handle.forward.remote(ForwardedRequest("GET", "/health")))
            ids = live_replicas(self.deployment)
        return ids

    async def _ask_all(self, path: str) -> dict[str, Answer | Exception]:
        ids = await self._replicas()

        async def ask(replica: str) -> Answer:
            hint = RouteHint(replica=replica)
            gen = self.handle.forward.remote(ForwardedRequest("GET", path), hint=hint)
            return await asyncio.wait_for(_collect(gen), FAN_OUT_TIMEOUT)

        answers = await asyncio.gather(*(ask(r) for r in ids), return_exceptions=True)
        out: dict[str, Answer | Exception] = {}
        for replica, answer in zip(ids, answers, strict=True):
            if isinstance(answer, BaseException):
                out[replica] = Exception(str(answer) or type(answer).__name__)
            else:
                out[replica] = answer
        return out

    async def _aggregate(self, request: Request, path: str) -> Response:
        answers = await self._ask_all(path)
        ok = {r: a for r, a in answers.items() if not isinstance(a, Exception)}
        failed = {r: _short(a) for r, a in answers.items() if isinstance(a, Exception)}
        if path == "/metrics":
            body = merge_metrics({r: a[1] for r, a in ok.items()}, router_state(self.deployment))
            return Response(body, media_type=CONTENT_TYPE_PLAIN_0_0_4)
        if path == "/ready":
            return ready_answer(ok, failed)
        if not ok:
            msg = f"no replica answered: {failed or 'none are running'}"
            return error_response(request.scope, 503, msg, code="no_replicas")
        return JSONResponse(merge_models(ok))


async def _relay(gen: Any, request: Request) -> AsyncIterator[bytes]:
    sent = 0  # events relayed: a Responses stream numbers its error event after them
    try:
        async for chunk in gen:
            if isinstance(chunk, bytes):
                sent += sse.count_events(chunk)
            yield chunk
    except Exception as exc:  # the replica died mid-stream: say so, then end the stream
        log.warning("replica failed mid-stream: %s", exc)
        msg = f"the replica serving this stream failed: {_short(exc)}"
        yield stream_error_event(request.scope, msg, "replica_failed", 503, events_sent=sent)
    finally:
        gen.cancel()  # the client left: the replica's app sees a disconnect and aborts


async def _collect(gen: Any) -> Answer:
    head: ResponseHead | None = None
    chunks: list[bytes] = []
    async for item in gen:
        if isinstance(item, ResponseHead):
            head = item
        else:
            chunks.append(item)
    if head is None:
        raise RuntimeError("the replica answered no head")
    return head, b"".join(chunks)


def merge_models(answers: dict[str, Answer]) -> dict[str, Any]:
    """One card per model id, in the first replica's order, each listing the replicas that
    serve it and their status; "loaded" when any replica has it loaded."""
    cards: dict[str, dict[str, Any]] = {}
    for replica, (head, body) in sorted(answers.items()):
        if head.status != 200:
            continue
        for card in json.loads(body).get("data", []):
            merged = cards.setdefault(card["id"], card | {"replicas": []})
            merged["replicas"].append({"replica": replica, "status": card.get("status")})
            if card.get("status") == "loaded":
                merged["status"] = "loaded"
    return {"object": "list", "data": list(cards.values())}


def ready_answer(answers: dict[str, Answer], failed: dict[str, str]) -> Response:
    replicas: dict[str, Any] = {r: {"status": "unreachable", "error": e} for r, e in failed.items()}
    for replica, (head, body) in answers.items():
        replicas[replica] = json.loads(body) if head.status in (200, 503) else {"status": "error"}
    ready = sum(1 for r in replicas.values() if r.get("status") == "ready")
    status = "ready" if ready else "not_ready"
    answer = {"status": status, "ready_replicas": ready, "replicas": replicas}
    return JSONResponse(answer, status_code=200 if ready else 503)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


def merge_metrics(answers: dict[str, bytes], state: Any) -> bytes:
    """Every replica's series, each sample labelled with its ``replica``, plus the router's
    decisions (``inferd_ray_routed_total{reason}``)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(answers.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)
    routed = CounterMetricFamily(
        "inferd_ray_routed", "Requests the router placed, by reason.", labels=["reason"]
    )
    for reason, count in sorted(state.decisions.items()):
        routed.add_metric([reason], count)
    registry = CollectorRegistry()
    registry.register(_Families([*families.values(), routed]))
    return generate_latest(registry)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return None  # the replica answers the 400


def _short(exc: BaseException | None) -> str:
    text = str(exc) if exc is not None else "no replicas"
    return text.splitlines()[0][:300] if text else type(exc).__name__
