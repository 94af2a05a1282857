"""A prompt with images, made ready for the engine: each ``<image>`` marker of the rendered
prompt text becomes the model's placeholder text for that image (its tiles and their
``<image>`` tokens), the whole is tokenized, and each image becomes a ``MediaInput`` holding
its prepared tiles, its digest and the positions of its placeholder tokens.

Pieces of text and image expansions are tokenized apart and joined: each expansion begins and
ends with special tokens, which the tokenizer never merges across, so the ids are the ones the
whole text gives (the parity tests check it against transformers' processor).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from inferd.engine.request import MediaInput
from inferd.loading.tokenizer import TokenizerBundle
from inferd.models.idefics3_image import (
    IMAGE_TOKEN,
    Idefics3ImageConfig,
    ImageConfigError,
    prepare_image,
)

ImageItem = tuple[Image.Image, str]  # a decoded image and its content digest


def image_digest(image: Image.Image) -> str:
    """A content digest of a decoded image (mode, size and pixels), for callers that hold no
    bytes of the file it came from."""
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def split_image_parts(
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]], list[ImageItem]]:
    """Messages whose content parts carry images (``{"type": "image", "image": PIL image}``,
    transformers' convention) as the chat template takes them (``{"type": "image"}``), and
    the images in order with their digests."""
    out: list[dict[str, Any]] = []
    images: list[ImageItem] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            image = part.get("image") if isinstance(part, Mapping) else None
            if isinstance(part, Mapping) and part.get("type") == "image":
                if not isinstance(image, Image.Image):
                    raise ImagePromptError("an image part needs a PIL image under 'image'")
                images.append((image, image_digest(image)))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


class ImagePromptError(ValueError):
    """The prompt and its images do not agree (the message says how): a 400 for the caller."""


@dataclass(frozen=True, slots=True)
class ImagePrompter:
    config: Idefics3ImageConfig
    tokenizer: TokenizerBundle
    image_token_id: int
    marker: str = IMAGE_TOKEN  # what the chat template writes where an image goes

    def prepare(
        self,
        text: str,
        images: Sequence[ImageItem],
        *,
        add_special: bool = True,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], list[MediaInput]]:
        """Token ids of ``text`` with its markers expanded, and one MediaInput per image, in
        order. Markers inside ``literal_spans`` (user text) are plain text, not images."""
        cuts = self._markers(text, literal_spans)
        if len(cuts) != len(images):
            raise ImagePromptError(
                f"the prompt has {len(cuts)} image markers for {len(images)} images"
            )
        ids: list[int] = []
        media: list[MediaInput] = []
        start = 0
        for cut, (image, digest) in zip(cuts, images, strict=True):
            ids += self._encode(text, start, cut, literal_spans, add_special and start == 0)
            try:
                prepared = prepare_image(image, self.config)
            except ImageConfigError as exc:  # e.g. more tiles than the tokenizer can mark
                raise ImagePromptError(str(exc)) from None
            first = len(ids)
            ids += self.tokenizer.encode(prepared.prompt_text())
            positions = tuple(p for p in range(first, len(ids)) if ids[p] == self.image_token_id)
            if len(positions) != prepared.num_embeddings:
                raise ImagePromptError(
                    "the tokenizer does not keep the image placeholder as one token"
                )
            media.append(MediaInput(digest, positions, prepared.tiles, prepared.normalizer))
            start = cut + len(self.marker)
        ids += self._encode(text, start, len(text), literal_spans, add_special and start == 0)
        return ids, media

    def _markers(self, text: str, literal_spans: Sequence[tuple[int, int]]) -> list[int]:
        found, at = [], text.find(self.marker)
        while at >= 0:
            if not any(a <= at < b for a, b in literal_spans):
                found.append(at)
            at = text.find(self.marker, at + len(self.marker))
        return found

    def _encode(
        self,
        text: str,
        start: int,
        end: int,
        literal_spans: Sequence[tuple[int, int]],
        add_special: bool,
    ) -> list[int]:
        spans = [
            (max(a, start) - start, min(b, end) - start)
            for a, b in literal_spans
            if a < end and b > start
        ]
        return self.tokenizer.encode(text[start:end], add_special=add_special, literal_spans=spans)
