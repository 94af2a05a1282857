"""`inferd serve --ray`'s flags and the replica count they ask for (light: no Ray import, as
`inferd --help` builds the parser)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Scale:
    """A fixed replica count, or autoscaling between ``min_replicas`` and ``max_replicas``."""

    replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None

    @classmethod
    def parse(cls, replicas: int | None, autoscale: str | None) -> Scale:
        """From `--replicas N` / `--autoscale MIN:MAX` (ValueError names the bad flag)."""
        if replicas is not None and autoscale is not None:
            raise ValueError("give --replicas or --autoscale, not both")
        if autoscale is not None:
            low, sep, high = autoscale.partition(":")
            if not sep or not low.isdigit() or not high.isdigit():
                raise ValueError(f"--autoscale takes MIN:MAX, e.g. 1:4; got {autoscale!r}")
            lo, hi = int(low), int(high)
            if hi < 1 or lo > hi:
                raise ValueError(f"--autoscale needs 0 <= MIN <= MAX and MAX >= 1; got {autoscale}")
            return cls(replicas=max(lo, 1), min_replicas=lo, max_replicas=hi)
        count = 2 if replicas is None else replicas
        if count < 1:
            raise ValueError("--replicas must be at least 1")
        return cls(replicas=count)

    def describe(self) -> str:
        if self.min_replicas is None:
            return f"{self.replicas} replicas"
        return f"autoscaling {self.min_replicas}..{self.max_replicas} replicas"

    def options(self) -> dict[str, Any]:
        if self.min_replicas is None:
            return {"num_replicas": self.replicas}
        return {
            "autoscaling_config": {
                "min_replicas": self.min_replicas,
                "initial_replicas": self.replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": 4,
            }
        }


def add_ray_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (pip install 'inferd[ray]')")
    g.add_argument(
        "--ray",
        action="store_true",
        help="serve as a Ray Serve application: replicas, each an engine with its own KV cache, "
        "behind Serve's HTTP proxy on --host/--port; requests go to the replica holding their "
        "prompt prefix or session",
    )
    g.add_argument("--replicas", type=int, default=None, help="--ray: replicas (default: 2)")
    g.add_argument("--autoscale", metavar="MIN:MAX", default=None, help="--ray: autoscale replicas")
    g.add_argument(
        "--ray-address",
        default=None,
        help="--ray: a running cluster to join (default: start a local one)",
    )
    g.add_argument(
        "--ray-num-cpus",
        type=float,
        default=1.0,
        help="--ray: CPUs each replica reserves (default: 1)",
    )
