"""inferd on Ray Serve (``pip install 'inferd[ray]'``): replicas, each one inferd engine with
its own KV pool, behind an ingress that routes each request to the replica most likely to hold
its prompt prefix (or its session's replica). See deployment.py (``build_deployment``,
`inferd serve --ray`), ingress.py, router.py, routing.py, replica.py, forward.py.
"""

from __future__ import annotations

from typing import Any


def build_deployment(*args: Any, **kwargs: Any) -> Any:
    """See ``inferd.ray.deployment.build_deployment`` (imported on call: Ray is optional)."""
    from inferd.ray.deployment import build_deployment as build

    return build(*args, **kwargs)
