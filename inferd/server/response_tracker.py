"""How far a response got, read from the ASGI messages that carry it.

A middleware that may cut a request (limits.py's --request-timeout, shutdown.py's drain) must
answer in a way the client can still read: a whole error response if nothing was sent yet, a
last error event if an event stream is under way (a Responses stream numbers it after the
events already sent), nothing if the response already finished. ``ResponseTracker.wrap`` gives
the app a ``send`` that keeps those facts as the messages go out.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import Message, Send

from inferd.server import sse

EVENT_STREAM = b"text/event-stream"


@dataclass(slots=True)
class ResponseTracker:
    started: bool = False  # the status line and headers went out
    event_stream: bool = False  # ... saying text/event-stream
    events: int = 0  # SSE events sent so far
    finished: bool = False  # the last body message went out

    def see(self, message: Message) -> None:
        """Note one message the app sends."""
        if message["type"] == "http.response.start":
            self.started = True
            for key, value in message.get("headers", []):
                if key.lower() == b"content-type":
                    self.event_stream = value.startswith(EVENT_STREAM)
        elif message["type"] == "http.response.body":
            self.events += sse.count_events(message.get("body", b""))
            self.finished = not message.get("more_body", False)

    def wrap(self, send: Send) -> Send:
        """``send``, noting each message before it goes out."""

        async def tracked_send(message: Message) -> None:
            self.see(message)
            await send(message)

        return tracked_send
