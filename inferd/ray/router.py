"""PrefixAwareRouter: Serve's request router for the inferd replicas. Serve builds it in the
process holding the deployment handle (the ingress replica) and asks it to rank replicas for
each call; the ingress passes each call's ``RouteHint`` as the ``hint`` keyword.

The affinity table and the in-flight counts live in routing.py's ``RouterState``, one per
deployment, so every router Serve builds for the same deployment in this process (one per
handle) shares them, and the ingress can read the live replicas for its fan-outs. Not here:
Serve sends this class to the ingress by value (cloudpickle), with module globals of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from inferd.ray.routing import RouteHint, choose, router_state

log = logging.getLogger("inferd.ray")

DEFAULT_IMBALANCE = 4  # requests a prefix's replica may lead the idlest by and still get it


class PrefixAwareRouter(PowerOfTwoChoicesRequestRouter):
    """Session first, then the replica holding the longest prompt prefix, else the least
    loaded (see routing.choose). With ``affinity`` off, Serve's default (power of two choices)
    for every request but the ingress's fan-outs, which still reach the replica they name."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.imbalance = int(kwargs.get("imbalance", DEFAULT_IMBALANCE))
        self.affinity = bool(kwargs.get("affinity", True))
        self.state = router_state(self._deployment_id.name)
        self.state.routers.add(self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = set(self.state.replicas())
        for replica in set(self.state.in_flight) - live:  # dead or scaled down
            self._forget(replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, replica: str) -> None:
        """Its sessions and prefixes move on to the others."""
        self.state.table.forget(replica)
        self.state.in_flight.pop(replica, None)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        hint = _hint_of(pending_request)
        if not self.affinity and hint.replica is None:
            self._why(pending_request, "serve_default")
            return await super().choose_replicas(candidate_replicas, pending_request)
        loads = {r: self.state.in_flight.get(r, 0) for r in by_id}
        ranks, reason = choose(self.state.table, hint, loads, self.imbalance)
        if pending_request is not None and ranks and ranks[0]:
            # remembered before the request lands, so the next one with this prefix follows
            self.state.table.record(hint, ranks[0][0])
            self._why(pending_request, reason)
        return [[by_id[r] for r in rank] for rank in ranks]

    def _why(self, pending_request: PendingRequest | None, reason: str) -> None:
        """Kept until the request is routed (Serve may ask again after a backoff), then
        counted once."""
        if pending_request is not None:
            reasons = self.state.reasons
            reasons[pending_request.metadata.internal_request_id] = reason
            while len(reasons) > 10_000:  # requests cancelled before routing never pop theirs
                reasons.pop(next(iter(reasons)))

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        replica = replica_id.unique_id
        hint = _hint_of(pending_request)
        if hint.replica is None and self.affinity:
            # Serve may have fallen back to a later rank (the first was full): remember where
            # the request really went.
            self.state.table.record(hint, replica)
        self.state.in_flight[replica] = self.state.in_flight.get(replica, 0) + 1
        request_id = pending_request.metadata.internal_request_id
        self.state.requests[request_id] = replica
        self.state.decisions[self.state.reasons.pop(request_id, "unknown")] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        replica = self.state.requests.pop(internal_request_id, None)
        if replica is not None and replica in self.state.in_flight:
            self.state.in_flight[replica] = max(0, self.state.in_flight[replica] - 1)


def _hint_of(pending_request: PendingRequest | None) -> RouteHint:
    if pending_request is None:
        return RouteHint()
    hint = pending_request.kwargs.get("hint")
    return hint if isinstance(hint, RouteHint) else RouteHint()
