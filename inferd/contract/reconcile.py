"""Usage reconciled: what a cancelled run cost, from both ends (seed 000's last state of a
cancellation, after the caller, the connection, the server and the scheduler).

The caller knows what reached it: ``Cancelled.completion_tokens``, typed by ``usage_source``
(the server's own figures, or the deltas received: a lower bound). The server knows what it
computed: inferd's JSON access log (``--access-log-format json``) writes one ``request_end``
line per request under the ``x-request-id`` the caller sent, with its outcome
(``client_disconnected``, or ``error`` and why: ``timeout``, ``abort``, ``shutdown``,
``error``) and the tokens its engine handed the handler. ``reconcile`` sets one against the
other:

- figures the server sent on the stream must equal its record;
- tokens received may fall short of the record by the tokens generated after the caller's
  last read (in flight, or computed before the server noticed the cut): ``undelivered``. The
  record never falls below them, nor exceeds the request's ``max_tokens``;
- the record's outcome must match who cut the run: the caller or the connection (the server
  saw a disconnect), the scheduler (a timeout or an abort), the server (its own failure or a
  shutdown).

What is billed is the server's record, when there is one: it counts what was computed,
delivered or not. No record (a server killed mid-stream writes none) leaves the run
unreconciled, and says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from inferd.contract.stream import Cancelled, Canceller, UsageSource

# (access log outcome, its error) a run cut by each canceller leaves; None: any error
_RECORDED: dict[Canceller, frozenset[tuple[str, str | None]]] = {
    Canceller.CALLER: frozenset({("client_disconnected", None)}),
    Canceller.CONNECTION: frozenset({("client_disconnected", None)}),
    Canceller.SCHEDULER: frozenset({("error", "timeout"), ("error", "abort")}),
    Canceller.SERVER: frozenset({("error", "error"), ("error", "shutdown")}),
}


@dataclass(frozen=True)
class ServerRecord:
    """One request as the server's access log recorded it at its end."""

    request_id: str
    status: int
    outcome: str
    error: str | None
    prompt_tokens: int | None
    completion_tokens: int | None


def server_record(log: str, request_id: str) -> ServerRecord | None:
    """The ``request_end`` line of a JSON access log for ``request_id``; None while there is
    none (the server writes it once the request's handler has ended)."""
    for line in log.splitlines():
        if not line.startswith("{"):
            continue  # the server's other log lines
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "request_end" and entry.get("request_id") == request_id:
            return ServerRecord(
                request_id,
                int(entry["status"]),
                str(entry["outcome"]),
                entry.get("error"),
                entry.get("prompt_tokens"),
                entry.get("completion_tokens"),
            )
    return None


@dataclass(frozen=True)
class Reconciliation:
    by: Canceller
    source: UsageSource
    client_tokens: int | None  # what the caller knows (see ``source``)
    server_tokens: int | None  # what the server recorded; None: it kept no record
    undelivered: int | None  # computed by the server, never received; None: not both known
    problems: tuple[str, ...]

    @property
    def consistent(self) -> bool:
        return not self.problems

    @property
    def billed_tokens(self) -> int | None:
        """The server's record when it kept one; else what the caller knows, marked by
        ``source`` (unknown stays None)."""
        return self.server_tokens if self.server_tokens is not None else self.client_tokens


def reconcile(outcome: Cancelled, record: ServerRecord | None, max_tokens: int) -> Reconciliation:
    """Set a cancelled run's client-side usage against the server's record of it."""
    source, client = outcome.usage_source, outcome.completion_tokens
    if record is None:
        return Reconciliation(
            outcome.by, source, client, None, None, ("the server kept no record of the request",)
        )
    server = record.completion_tokens or 0  # none: the engine never handed over a token
    problems = []
    expected = _RECORDED[outcome.by]
    if (record.outcome, record.error) not in expected and (record.outcome, None) not in expected:
        problems.append(
            f"cut by the {outcome.by}, but the server recorded {record.outcome}"
            + (f" ({record.error})" if record.error else "")
        )
    undelivered = None
    if server > max_tokens:
        problems.append(f"the server recorded {server} tokens, over max_tokens {max_tokens}")
    elif source is UsageSource.SERVER:
        if server != client:
            problems.append(f"the stream's usage says {client} tokens, the record {server}")
        if outcome.usage is not None and record.prompt_tokens != outcome.usage.prompt_tokens:
            problems.append(
                f"the stream's usage says {outcome.usage.prompt_tokens} prompt tokens, "
                f"the record {record.prompt_tokens}"
            )
        undelivered = 0
    elif client is not None and server < client:
        problems.append(f"{client} tokens arrived, but the server recorded only {server}")
    else:
        undelivered = server - (client or 0)
    return Reconciliation(outcome.by, source, client, server, undelivered, tuple(problems))
