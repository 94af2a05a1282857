"""A prompt with media, made ready for the engine: each marker of the rendered prompt text
(``<image>``, or ``<|AUDIO|>`` for an audio clip) becomes the model's placeholder text for that
item (an image's tiles and their ``<image>`` tokens; one ``<|AUDIO|>`` per encoder row of a
clip), the whole is tokenized, and each item becomes a ``MediaInput`` holding its prepared
encoder input, its digest and the positions of its placeholder tokens.

Pieces of text and expansions are tokenized apart and joined: each expansion begins and ends
with special tokens, which the tokenizer never merges across, so the ids are the ones the whole
text gives (the parity tests check it against transformers' processors).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from inferd.engine.request import MediaInput
from inferd.loading.hf_processor import ImageConfig
from inferd.loading.tokenizer import TokenizerBundle
from inferd.media.types import DecodedAudio
from inferd.models.gemma3_image import AROUND, Gemma3ImageConfig
from inferd.models.idefics3_image import (
    IMAGE_TOKEN,
    ImageConfigError,
    prepare_image,
)
from inferd.models.qwen2_audio_input import AUDIO_TOKEN, prepare_audio
from inferd.models.whisper_features import WhisperFeatureConfig

ImageItem = tuple[Image.Image, str]  # a decoded image and its content digest


class MediaPromptError(ValueError):
    """The prompt and its media do not agree (the message says how): a 400 for the caller."""


ImagePromptError = MediaPromptError  # the name the image path has used


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


@dataclass(frozen=True, slots=True)
class Expansion:
    """One item ready for the prompt: the text standing for it, how many placeholder tokens
    that text holds, and its MediaInput once their positions are known."""

    text: str
    num_embeddings: int
    media: Callable[[tuple[int, ...]], MediaInput]


@dataclass(frozen=True, slots=True)
class MarkerExpander:
    """Expands one modality's markers in rendered prompt text (the shared work of the
    per-modality prompters below)."""

    tokenizer: TokenizerBundle
    placeholder_id: int
    marker: str
    modality: str

    def prepare(
        self,
        text: str,
        items: Sequence[Expansion],
        *,
        add_special: bool = True,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], list[MediaInput]]:
        """Token ids of ``text`` with its markers expanded, and one MediaInput per item, in
        order. Markers inside ``literal_spans`` (user text) are plain text, not media."""
        cuts = self._markers(text, literal_spans)
        if len(cuts) != len(items):
            raise MediaPromptError(
                f"the prompt has {len(cuts)} {self.modality} markers for {len(items)} "
                + ("images" if self.modality == "image" else f"{self.modality} clips")
            )
        ids: list[int] = []
        media: list[MediaInput] = []
        start = 0
        for cut, item in zip(cuts, items, strict=True):
            ids += self._encode(text, start, cut, literal_spans, add_special and start == 0)
            first = len(ids)
            ids += self.tokenizer.encode(item.text)
            positions = tuple(p for p in range(first, len(ids)) if ids[p] == self.placeholder_id)
            if len(positions) != item.num_embeddings:
                raise MediaPromptError(
                    f"the tokenizer does not keep the {self.modality} placeholder as one token"
                )
            media.append(item.media(positions))
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


@dataclass(frozen=True, slots=True)
class ImagePrompter:
    config: ImageConfig  # Idefics3's tiles, or Gemma 3's one image (its own marker)
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
        """Token ids of ``text`` with its image markers expanded, and one MediaInput per image."""
        marker = self.marker
        if isinstance(self.config, Gemma3ImageConfig):
            marker = self.config.marker
            text, literal_spans = surround_markers(text, marker, AROUND, literal_spans)
        expander = MarkerExpander(self.tokenizer, self.image_token_id, marker, "image")
        items = [self._expansion(image, digest) for image, digest in images]
        return expander.prepare(text, items, add_special=add_special, literal_spans=literal_spans)

    def _expansion(self, image: Image.Image, digest: str) -> Expansion:
        try:
            if isinstance(self.config, Gemma3ImageConfig):
                prepared: Any = self.config.prepare(image)
            else:
                prepared = prepare_image(image, self.config)
        except ImageConfigError as exc:  # e.g. more tiles than the tokenizer can mark
            raise ImagePromptError(str(exc)) from None

        def media(positions: tuple[int, ...]) -> MediaInput:
            return MediaInput(digest, positions, prepared.tiles, prepared.normalizer)

        return Expansion(prepared.prompt_text(), prepared.num_embeddings, media)


def surround_markers(
    text: str, marker: str, around: str, literal_spans: Sequence[tuple[int, int]]
) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with ``around`` on both sides of each marker outside ``literal_spans``, and
    those spans moved to match: text the processor adds around an image that the tokenizer
    must see with its neighbours (Gemma 3's blank lines merge with the template's newline)."""
    cuts, found = [], text.find(marker)
    while found >= 0:
        if not any(a <= found < b for a, b in literal_spans):
            cuts.append(found)
        found = text.find(marker, found + len(marker))
    out, at = [], 0
    for cut in cuts:
        out.append(text[at:cut] + around + marker + around)
        at = cut + len(marker)
    out.append(text[at:])
    grow = 2 * len(around)
    spans = [(a + grow * n, b + grow * n) for a, b in literal_spans for n in [bisect_left(cuts, a)]]
    return "".join(out), spans


@dataclass(frozen=True, slots=True)
class AudioPrompter:
    config: WhisperFeatureConfig
    tokenizer: TokenizerBundle
    audio_token_id: int
    marker: str = AUDIO_TOKEN  # what the chat template writes where a clip goes

    def prepare(
        self,
        text: str,
        clips: Sequence[DecodedAudio],
        *,
        add_special: bool = True,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], list[MediaInput]]:
        """Token ids of ``text`` with its audio markers expanded, and one MediaInput per clip
        (resampled to the feature extractor's rate, down-mixed, featurized)."""
        expander = MarkerExpander(self.tokenizer, self.audio_token_id, self.marker, "audio")
        items = [self._expansion(clip) for clip in clips]
        return expander.prepare(text, items, add_special=add_special, literal_spans=literal_spans)

    def _expansion(self, clip: DecodedAudio) -> Expansion:
        prepared = prepare_audio(clip, self.config)

        def media(positions: tuple[int, ...]) -> MediaInput:
            return MediaInput(
                clip.digest, positions, prepared.features, modality="audio", frames=prepared.frames
            )

        return Expansion(prepared.prompt_text(), prepared.num_embeddings, media)
