"""build_deployment: inferd as a Ray Serve application (an ingress and N engine replicas), and
`inferd serve --ray`, which runs it on a Ray cluster (a local one unless --ray-address).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import threading
from typing import Any

from inferd.config import EngineConfig
from inferd.ray.args import Scale
from inferd.ray.ingress import InferdIngress
from inferd.ray.replica import InferdReplica, ReplicaSettings
from inferd.ray.router import DEFAULT_IMBALANCE
from inferd.server.options import ServerOptions
from inferd.serving.spec import ModelSpec

log = logging.getLogger("inferd.ray")

APP_NAME = "inferd"
REPLICA_DEPLOYMENT = "inferd_replica"
INGRESS_DEPLOYMENT = "inferd_ingress"
ROUTER_CLASS = "inferd.ray.router.PrefixAwareRouter"


def build_deployment(
    spec: ModelSpec,
    engine: EngineConfig | None = None,
    options: ServerOptions | None = None,
    *,
    scale: Scale | None = None,
    num_cpus: float = 1.0,
    prefix_routing: bool = True,
    imbalance: int = DEFAULT_IMBALANCE,
) -> Any:
    """The Serve application (``serve.run`` it): an ingress deployment in front of replicas
    that each load ``spec`` with ``engine``'s settings and serve every inferd route under
    ``options``. ``num_cpus``: Ray CPUs per replica (the engine's torch threads follow Ray's
    OMP_NUM_THREADS). ``prefix_routing`` off: Serve's own power-of-two routing (sessions and
    prefixes ignored), for comparison."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    engine = engine or EngineConfig()
    options = options or ServerOptions()
    scale = scale or Scale()
    # The ingress checks the client's Host; a replica is reached only through Serve handle calls
    # from the ingress (never over HTTP), whose fan-out (/ready, /v1/models, /metrics) carries
    # no Host, so its app must not refuse them.
    replica_options = dataclasses.replace(options, allowed_hosts=None)
    settings = ReplicaSettings(spec=spec, engine=engine, options=replica_options)
    router_settings: dict[str, Any] = {
        "request_router_class": ROUTER_CLASS,
        "request_router_kwargs": {"imbalance": imbalance, "affinity": prefix_routing},
    }
    router = RequestRouterConfig(**router_settings)  # a plain dict is silently ignored
    replica = serve.deployment(
        name=REPLICA_DEPLOYMENT,
        ray_actor_options={"num_cpus": num_cpus},
        # the engine queues beyond its batch itself; Serve's cap only stops runaway queues
        max_ongoing_requests=engine.max_num_seqs + engine.max_waiting,
        request_router_config=router,
        **scale.options(),
    )(InferdReplica)
    ingress = serve.deployment(
        name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4096,
    )(InferdIngress)
    return ingress.bind(
        replica.bind(settings),
        max_body_bytes=options.max_body_bytes,
        allowed_hosts=options.allowed_hosts,
    )


def serve_on_ray(
    args: argparse.Namespace, spec: ModelSpec, engine: EngineConfig, options: ServerOptions
) -> int:
    """`inferd serve --ray`: run the application until SIGINT / SIGTERM."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError("--ray needs Ray Serve: pip install 'inferd[ray]'") from None
    scale = Scale.parse(args.replicas, args.autoscale)
    ray.init(address=args.ray_address or "local", include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_deployment(spec, engine, options, scale=scale, num_cpus=args.ray_num_cpus)
    serve.run(app, name=APP_NAME, route_prefix="/")
    where = args.ray_address or "a local cluster"
    line = f"{scale.describe()} on {where}, prefix- and session-aware routing"
    print(f"inferd  ray        {line}", flush=True)
    print(f"inferd  listening  http://{args.host}:{args.port}/v1", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):  # a timed wait: the signal handlers run between waits
        pass
    serve.delete(APP_NAME)
    serve.shutdown()
    ray.shutdown()
    return 0


CONFIG_KEYS = {
    "model": str,
    "replicas": int,
    "autoscale": str,
    "num_cpus": float,
    "max_seq_len": int,
    "max_seqs": int,
    "kv_cache_tokens": int,
    "prefix_routing": bool,
}


def from_config(args: dict[str, Any]) -> Any:
    """An application builder for a Serve config file (``import_path:
    inferd.ray.deployment:from_config``, ``args`` as in CONFIG_KEYS); ValueError names an
    unknown or mistyped key."""
    unknown = sorted(set(args) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown inferd args {unknown}; known: {sorted(CONFIG_KEYS)}")
    for key, kind in CONFIG_KEYS.items():
        value = args.get(key)
        number = kind is float and isinstance(value, int)  # YAML's 2 for 2.0
        if value is not None and not (isinstance(value, kind) or number):
            raise ValueError(f"{key} must be {kind.__name__}; got {value!r}")
    from inferd.store import DEFAULT_MODEL

    engine = EngineConfig()
    engine = EngineConfig(
        max_model_len=args.get("max_seq_len", engine.max_model_len),
        max_num_seqs=args.get("max_seqs", engine.max_num_seqs),
        kv_cache_tokens=args.get("kv_cache_tokens", engine.kv_cache_tokens),
    )
    return build_deployment(
        ModelSpec(model_id=args.get("model", DEFAULT_MODEL)),
        engine,
        scale=Scale.parse(args.get("replicas"), args.get("autoscale")),
        num_cpus=float(args.get("num_cpus", 1.0)),
        prefix_routing=args.get("prefix_routing", True),
    )
