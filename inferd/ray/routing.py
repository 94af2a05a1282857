"""What the Ray router routes by: a request's session key and its prompt-prefix digests, and
the affinity table that remembers which replica saw which.

The prefix digests are a cheap stand-in for the engine's own prefix-cache hashes: tokenizing in
the router would mean loading the tokenizer into the ingress and paying for it on every request,
so the router hashes the prompt's *text* instead, in the order the chat template renders it
(system / instructions first, then each message's role and text). Block ``i``'s digest chains
the one before it, as the KV cache's block hashes do (engine/kv_cache.py), so two prompts share
digest ``i`` exactly when their first ``(i + 1) * block_chars`` characters agree. A shared text
prefix renders to a shared token prefix under the same template, so a replica that served a
digest most likely holds that prefix's KV blocks.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

BLOCK_CHARS = 256  # about 64 tokens of English: a handful of KV blocks per digest
MAX_BLOCKS = 32  # digests past the first 8 KiB of text add little: the head decides
SESSION_HEADER = "x-session-id"


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the ingress tells the router about one request (passed as a handle kwarg)."""

    session: str | None = None  # `user` field or x-session-id header: sticks to one replica
    prefix: tuple[str, ...] = ()  # chained digests of the prompt text's leading blocks
    replica: str | None = None  # fan-out (/v1/models, /metrics): exactly this replica


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt's text in rendering order, for chat, completions, Anthropic messages and
    Responses bodies alike; "" when the body has none."""
    parts: list[str] = []
    for key in ("system", "instructions"):  # Anthropic's and Responses' system text
        parts.append(_text_of(body.get(key)))
    prompt = body.get("prompt")  # /v1/completions
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        parts.append(prompt[0])
    items = body.get("messages")
    if items is None:
        items = body.get("input")  # /v1/responses: a string or a list of items
    if isinstance(items, str):
        parts.append(items)
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, dict):
                parts.append(f"<{item.get('role', '')}>{_text_of(item.get('content'))}")
    return "".join(parts)


def _text_of(content: Any) -> str:
    """A message's text: a string, or the text of its parts (media parts stand as a marker)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                out.append(text if isinstance(text, str) else f"[{part.get('type', '')}]")
        return "".join(out)
    return ""


def prefix_digests(
    text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
) -> tuple[str, ...]:
    """Chained digests of ``text``'s full leading blocks (a partial last block is left out: it
    is the part most likely to differ between requests)."""
    digests: list[str] = []
    parent = b""
    for i in range(min(len(text) // block_chars, max_blocks)):
        block = text[i * block_chars : (i + 1) * block_chars].encode()
        parent = hashlib.blake2b(parent + block, digest_size=12).digest()
        digests.append(parent.hex())
    return tuple(digests)


def session_key(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The header wins over the body's `user` (OpenAI's end-user id, Anthropic's
    metadata.user_id)."""
    header = headers.get(SESSION_HEADER)
    if header:
        return header
    user = body.get("user")
    if isinstance(user, str) and user:
        return user
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        user_id = metadata.get("user_id")
        if isinstance(user_id, str) and user_id:
            return user_id
    return None


def route_hint(body: Any, headers: Mapping[str, str]) -> RouteHint:
    if not isinstance(body, dict):
        return RouteHint(session=headers.get(SESSION_HEADER) or None)
    return RouteHint(session_key(body, headers), prefix_digests(prompt_text(body)))


@dataclass
class AffinityTable:
    """Which replica last served each session and each prefix digest, bounded (least
    recently used entries go first). Replica ids are Serve's replica unique ids."""

    max_entries: int = 100_000
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    prefixes: OrderedDict[str, str] = field(default_factory=OrderedDict)

    def session_replica(self, session: str, live: Iterable[str]) -> str | None:
        replica = self.sessions.get(session)
        if replica is None or replica not in set(live):
            return None
        self.sessions.move_to_end(session)
        return replica

    def prefix_replica(self, digests: tuple[str, ...], live: Iterable[str]) -> tuple[str, int]:
        """The live replica that saw the longest of ``digests``, and how many blocks matched
        (("", 0) when none)."""
        alive = set(live)
        for depth in range(len(digests), 0, -1):
            replica = self.prefixes.get(digests[depth - 1])
            if replica is not None and replica in alive:
                return replica, depth
        return "", 0

    def record(self, hint: RouteHint, replica: str) -> None:
        if hint.session is not None:
            self._put(self.sessions, hint.session, replica)
        for digest in hint.prefix:
            self._put(self.prefixes, digest, replica)

    def forget(self, replica: str) -> None:
        """A replica died: its sessions and prefixes go elsewhere from now on."""
        for table in (self.sessions, self.prefixes):
            for key in [k for k, v in table.items() if v == replica]:
                del table[key]

    def _put(self, table: OrderedDict[str, str], key: str, replica: str) -> None:
        table[key] = replica
        table.move_to_end(key)
        while len(table) > self.max_entries:
            table.popitem(last=False)


def choose(
    table: AffinityTable,
    hint: RouteHint,
    loads: Mapping[str, int],
    imbalance: int,
) -> tuple[list[list[str]], str]:
    """Ranked replica choices for ``hint`` among the live replicas in ``loads`` (replica ->
    requests in flight from this router), and why the first rank was chosen: "replica" (a
    fan-out), "session", "prefix", or "least_loaded". A prefix's replica is skipped when it is
    more than ``imbalance`` requests busier than the idlest: a cache hit is not worth a queue.
    Ranks after the first hold the rest, idlest first (Serve tries them in order when the first
    is full)."""
    by_load = sorted(loads, key=lambda r: loads[r])
    if hint.replica is not None:
        return ([[hint.replica]] if hint.replica in loads else []), "replica"
    if hint.session is not None:
        replica = table.session_replica(hint.session, loads)
        if replica is not None:
            return _ranked(replica, by_load), "session"
    replica, depth = table.prefix_replica(hint.prefix, loads)
    if depth and loads[replica] <= loads[by_load[0]] + imbalance:
        return _ranked(replica, by_load), "prefix"
    idlest = [r for r in by_load if loads[r] == loads[by_load[0]]] if by_load else []
    return ([idlest, [r for r in by_load if r not in idlest]] if idlest else []), "least_loaded"


def _ranked(first: str, by_load: list[str]) -> list[list[str]]:
    return [[first], [r for r in by_load if r != first]]


@dataclass
class RouterState:
    """What the routers of one deployment in this process share."""

    table: AffinityTable = field(default_factory=AffinityTable)
    in_flight: dict[str, int] = field(default_factory=dict)  # replica -> requests
    requests: dict[str, str] = field(default_factory=dict)  # internal request id -> replica
    decisions: Counter[str] = field(default_factory=Counter)  # why each request went where
    reasons: dict[str, str] = field(default_factory=dict)  # request id -> why, until routed
    # Serve may build several routers for one deployment here (one per handle), each told
    # the live replicas on its own: the union is the truth, one router's list is not.
    routers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)

    def replicas(self) -> list[str]:
        return sorted({r.unique_id for router in self.routers for r in router.curr_replicas})


_STATES: dict[str, RouterState] = {}


def router_state(deployment: str) -> RouterState:
    return _STATES.setdefault(deployment, RouterState())


def live_replicas(deployment: str) -> list[str]:
    """The replicas Serve currently routes to (empty before the first call builds a router)."""
    return router_state(deployment).replicas()
