"""Image blocks of an Anthropic request, matched to their places in the rendered prompt.

decode_request_media (server/media.py) decodes a request's image blocks in the order they
appear, a tool_result's images at that block's place. The chat template may render them in
another order: a template that takes tool turns renders a message's tool results before the
rest of that message, so ``[image A, tool_result(image B)]`` reads B first. Each image part
therefore carries its block's number while the turns are built, and the decoded images are put
in the order the template will meet the parts (messages in order, parts in order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_SLOT = "_inferd_image"  # the key an image part carries its block's number under, until placed


@dataclass(slots=True)
class ImageSlots:
    count: int = 0  # image blocks read so far

    def part(self, block: dict[str, Any], where: str) -> dict[str, Any]:
        """The chat template's image part for the next image block (in decoding order)."""
        self.count += 1
        return {"type": "image", _SLOT: self.count - 1}

    def in_rendered_order(self, messages: list[dict[str, Any]], media: Sequence[T]) -> list[T]:
        """``media`` (decoded in block order) in the order the parts of ``messages`` hold
        them; the parts lose their block numbers. Should the counts differ, ``media`` as it
        is: the prompt's own check then refuses the request."""
        order: list[int] = []
        for message in messages:
            content = message.get("content")
            for part in content if isinstance(content, list) else ():
                if isinstance(part, dict) and _SLOT in part:
                    order.append(part.pop(_SLOT))
        if sorted(order) != list(range(len(media))):
            return list(media)  # a count mismatch: the prompt's own check reports it
        return [media[k] for k in order]
