"""What the running server knows: its models and settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.engine.builder import ServedModel
from inferd.server.errors import APIError


@dataclass(slots=True)
class ServerState:
    models: dict[str, ServedModel]
    default_model: str | None = None
    keepalive_seconds: float = 5.0
    started: float = field(default=0.0)

    def resolve_model(self, name: str | None) -> ServedModel:
        if name in (None, "", "default"):
            key = self.default_model or next(iter(self.models), None)
            if key is None:
                raise APIError(503, "no model is loaded")
            return self.models[key]
        assert name is not None
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise APIError(
                404,
                f"the model {name!r} does not exist on this server; available: {known}",
                param="model",
                code="model_not_found",
            )
        return model
