"""InferdReplica: one Serve replica = one inferd engine with its own KV pool, serving the
whole inferd app (every OpenAI / Anthropic route, streams included) to calls from the ingress.

The engine steps on a thread of its own (``ThreadLoop``): the replica's main thread belongs to
Ray's worker, and Serve runs this class's methods on its event loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from inferd.config import EngineConfig
from inferd.engine.driver import ThreadLoop
from inferd.ray.routing import RouteHint
from inferd.server.app import build_app
from inferd.server.forward import ForwardedRequest, ResponseHead, run_request
from inferd.server.options import ServerOptions
from inferd.serving.loading import load_spec
from inferd.serving.registry import ModelRegistry, ModelSlot
from inferd.serving.spec import ModelSpec

log = logging.getLogger("inferd.ray")

REPLICA_HEADER = "x-inferd-replica"


@dataclass(frozen=True, slots=True)
class ReplicaSettings:
    """What every replica loads and serves (pickled into each replica by Serve)."""

    spec: ModelSpec
    engine: EngineConfig
    options: ServerOptions


class InferdReplica:
    def __init__(self, settings: ReplicaSettings) -> None:
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.loop = ThreadLoop(name=f"inferd-engine-{self.replica_id}")
        model = load_spec(settings.spec, settings.engine, loop=self.loop)
        slot = ModelSlot.of_loaded(model)
        self.registry = ModelRegistry(
            [slot],
            auto_reload=settings.options.auto_reload,
            drain_timeout=settings.options.drain_timeout,
        )
        self.app = build_app(self.registry, settings.options)
        self.extra = ((REPLICA_HEADER.encode(), self.replica_id.encode()),)
        log.info("replica %s serving %s", self.replica_id, model.id)

    async def forward(
        self, request: ForwardedRequest, hint: RouteHint | None = None
    ) -> AsyncIterator[ResponseHead | bytes]:
        """One request through this replica's app; ``hint`` is the router's, unused here."""
        async for item in run_request(self.app, request, self.extra):
            yield item

    def __del__(self) -> None:
        registry = getattr(self, "registry", None)
        if registry is not None:
            registry.shutdown()
