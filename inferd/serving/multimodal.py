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
from functools import partial
from typing import Any

import torch
from PIL import Image

from inferd.engine.request import MediaInput
from inferd.loading.hf_processor import Gemma4Processing, ImageConfig
from inferd.loading.tokenizer import TokenizerBundle
from inferd.media.types import DecodedAudio, DecodedVideo
from inferd.models.gemma3_image import AROUND, Gemma3ImageConfig
from inferd.models.gemma3n_audio_features import Gemma3nAudioFeatureConfig
from inferd.models.gemma4_audio_features import Gemma4AudioFeatureConfig
from inferd.models.gemma4_image import Gemma4ImageConfig
from inferd.models.gemma4_video import Gemma4VideoConfig
from inferd.models.idefics3_image import (
    IMAGE_TOKEN,
    ImageConfigError,
    expansion,
    prepare_image,
    tile_grid,
)
from inferd.models.qwen2_audio_input import AUDIO_TOKEN, prepare_audio
from inferd.models.qwen2_vl_image import (
    IMAGE_PAD,
    VIDEO_PAD,
    PreparedVisual,
    QwenVisualConfig,
    image_tokens,
    visual_patches,
)
from inferd.models.qwen2_vl_image import prepare_image as prepare_qwen_image
from inferd.models.qwen2_vl_image import prepare_video as prepare_qwen_video
from inferd.models.qwen3_vl_video import Qwen3VideoConfig
from inferd.models.qwen3_vl_video import prepare_video as prepare_qwen3_video
from inferd.models.smolvlm_video import VIDEO_TOKEN, SmolVLMVideoConfig, prepare_video
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
    that text holds, and its MediaInputs once their positions are known (one, or one per run
    of placeholders: Qwen3-VL's video frames)."""

    text: str
    num_embeddings: int
    media: Callable[[tuple[int, ...]], tuple[MediaInput, ...]]


@dataclass(frozen=True, slots=True)
class MarkerGroup:
    """One modality's markers in rendered prompt text and the items they stand for, in order."""

    marker: str
    placeholder_id: int
    modality: str
    items: Sequence[Expansion]

    def mismatch(self, found: int) -> MediaPromptError:
        items = "images" if self.modality == "image" else f"{self.modality} clips"
        items = "videos" if self.modality == "video" else items
        return MediaPromptError(
            f"the prompt has {found} {self.modality} markers for {len(self.items)} {items}"
        )


def expand_markers(
    tokenizer: TokenizerBundle,
    text: str,
    groups: Sequence[MarkerGroup],
    *,
    add_special: bool = True,
    literal_spans: Sequence[tuple[int, int]] = (),
) -> tuple[list[int], list[MediaInput]]:
    """Token ids of ``text`` with the markers of every group expanded, and one MediaInput per
    item in prompt order (an image and a video in one prompt interleave as written). Markers
    inside ``literal_spans`` (user text) are plain text, not media."""
    cuts: list[tuple[int, MarkerGroup, Expansion]] = []
    for group in groups:
        found = _markers(text, group.marker, literal_spans)
        if len(found) != len(group.items):
            raise group.mismatch(len(found))
        cuts += [(at, group, item) for at, item in zip(found, group.items, strict=True)]
    cuts.sort(key=lambda cut: cut[0])
    ids: list[int] = []
    media: list[MediaInput] = []
    start = 0
    for cut, group, item in cuts:
        ids += _encode(tokenizer, text, start, cut, literal_spans, add_special and start == 0)
        first = len(ids)
        ids += tokenizer.encode(item.text)
        positions = tuple(p for p in range(first, len(ids)) if ids[p] == group.placeholder_id)
        if len(positions) != item.num_embeddings:
            raise MediaPromptError(
                f"the tokenizer does not keep the {group.modality} placeholder as one token"
            )
        media += item.media(positions)
        start = cut + len(group.marker)
    ids += _encode(tokenizer, text, start, len(text), literal_spans, add_special and start == 0)
    return ids, media


def _markers(text: str, marker: str, literal_spans: Sequence[tuple[int, int]]) -> list[int]:
    found, at = [], text.find(marker)
    while at >= 0:
        if not any(a <= at < b for a, b in literal_spans):
            found.append(at)
        at = text.find(marker, at + len(marker))
    return found


def _encode(
    tokenizer: TokenizerBundle,
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
    return tokenizer.encode(text[start:end], add_special=add_special, literal_spans=spans)


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
        if isinstance(self.config, Gemma3ImageConfig):
            text, literal_spans = surround_markers(text, self._marker, AROUND, literal_spans)
        return expand_markers(
            self.tokenizer,
            text,
            [self.group(images)],
            add_special=add_special,
            literal_spans=literal_spans,
        )

    def tokens_for(self, width: int, height: int) -> int:
        """The prompt tokens an upright image of this size stands for (from its header,
        before decoding): its expansion as ``prepare`` writes it, placeholders and all;
        MediaPromptError as ``prepare`` would raise."""
        if isinstance(self.config, Gemma3ImageConfig):
            # one tile whatever the size, between <start_of_image> and <end_of_image>
            return self.config.image_seq_len + 2
        try:
            rows, cols = tile_grid(width, height, self.config)
        except ImageConfigError as exc:
            raise MediaPromptError(str(exc)) from None
        return len(self.tokenizer.encode(expansion(rows, cols, self.config.image_seq_len)))

    @property
    def _marker(self) -> str:
        """What the rendered prompt holds where an image goes (Gemma 3's config names its own)."""
        return self.config.marker if isinstance(self.config, Gemma3ImageConfig) else self.marker

    def group(self, images: Sequence[ImageItem]) -> MarkerGroup:
        items = [self._expansion(image, digest) for image, digest in images]
        return MarkerGroup(self._marker, self.image_token_id, "image", items)

    def _expansion(self, image: Image.Image, digest: str) -> Expansion:
        try:
            if isinstance(self.config, Gemma3ImageConfig):
                prepared: Any = self.config.prepare(image)
            else:
                prepared = prepare_image(image, self.config)
        except ImageConfigError as exc:  # e.g. more tiles than the tokenizer can mark
            raise ImagePromptError(str(exc)) from None

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            return (MediaInput(digest, positions, prepared.tiles, prepared.normalizer),)

        return Expansion(prepared.prompt_text(), prepared.num_embeddings, media)


def surround_markers(
    text: str, marker: str, around: str, literal_spans: Sequence[tuple[int, int]]
) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with ``around`` on both sides of each marker outside ``literal_spans``, and
    those spans moved to match: text the processor adds around an image that the tokenizer
    must see with its neighbours (Gemma 3's blank lines merge with the template's newline)."""
    cuts = _markers(text, marker, literal_spans)
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
    """Qwen2-Audio's clips (each marker one placeholder per encoder row), or Gemma 3n's: the
    audio token the chat template writes becomes what its processor puts there, a blank line,
    ``boa`` + the model's fixed count of audio tokens + ``eoa``, a blank line (the blank lines
    tokenized with their neighbours, as Gemma 3's images'); each clip a MediaInput of all its
    log-mel frames."""

    config: WhisperFeatureConfig | Gemma3nAudioFeatureConfig
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
        group = self.group(clips)
        if isinstance(self.config, Gemma3nAudioFeatureConfig):
            text, literal_spans = surround_markers(text, group.marker, AROUND, literal_spans)
        return expand_markers(
            self.tokenizer, text, [group], add_special=add_special, literal_spans=literal_spans
        )

    def group(self, clips: Sequence[DecodedAudio]) -> MarkerGroup:
        cfg = self.config
        if isinstance(cfg, Gemma3nAudioFeatureConfig):  # its config names its own marker
            items = [gemma_clip(cfg, clip) for clip in clips]
            return MarkerGroup(cfg.audio_token, self.audio_token_id, "audio", items)
        items = [self._expansion(cfg, clip) for clip in clips]
        return MarkerGroup(self.marker, self.audio_token_id, "audio", items)

    @staticmethod
    def _expansion(cfg: WhisperFeatureConfig, clip: DecodedAudio) -> Expansion:
        prepared = prepare_audio(clip, cfg)

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            made = MediaInput(
                clip.digest, positions, prepared.features, modality="audio", frames=prepared.frames
            )
            return (made,)

        return Expansion(prepared.prompt_text(), prepared.num_embeddings, media)


def gemma_clip(
    cfg: Gemma3nAudioFeatureConfig | Gemma4AudioFeatureConfig, clip: DecodedAudio
) -> Expansion:
    """A Gemma clip resampled to its extractor's rate, down-mixed and featurized: its prompt
    text (Gemma 3n's the same for any clip, its fixed count of audio tokens; Gemma 4's as long
    as the clip), and a MediaInput of all its log-mel frames [frames, mel bins], which the
    model's ``encode_audio`` takes."""
    samples = clip.resampled(cfg.sampling_rate).mono()
    if not cfg.num_frames(len(samples)):
        raise MediaPromptError("an audio clip is too short to encode")
    if isinstance(cfg, Gemma3nAudioFeatureConfig):
        text, tokens = cfg.prompt_text(), cfg.soft_tokens
    else:
        text, tokens = cfg.prompt_text(len(samples)), cfg.num_tokens(len(samples))
    features = torch.from_numpy(cfg.log_mel(samples))
    frames = int(features.shape[0])

    def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
        return (MediaInput(clip.digest, positions, features, modality="audio", frames=frames),)

    return Expansion(text, tokens, media)


@dataclass(frozen=True, slots=True)
class VideoPrompter:
    """SmolVLM2's videos: each ``<video>`` marker becomes the intro, the frames' timestamps and
    their image tokens; the frames are sampled by ``config`` when the video is decoded (the
    server passes it as the decoder's sampling)."""

    config: SmolVLMVideoConfig
    image_token_id: int
    marker: str = VIDEO_TOKEN

    def group(self, videos: Sequence[DecodedVideo]) -> MarkerGroup:
        return MarkerGroup(
            self.marker, self.image_token_id, "video", [self._expansion(v) for v in videos]
        )

    def _expansion(self, video: DecodedVideo) -> Expansion:
        prepared = prepare_video(
            video.frames, video.frame_indices, video.fps, video.total_frames, self.config
        )

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            # the frames are tiles for the image encoder: modality "image" to the runner
            return (MediaInput(video.digest, positions, prepared.tiles, prepared.normalizer),)

        return Expansion(prepared.prompt_text(), prepared.num_embeddings, media)


@dataclass(frozen=True, slots=True)
class GridPrompter:
    """Images and videos for Qwen2.5-VL and Qwen3-VL: each ``<|image_pad|>`` (``<|video_pad|>``)
    the chat template writes becomes one placeholder per encoder row of the next image (video),
    and each item a MediaInput with its patch grid (which also sets its M-RoPE positions).
    Images and videos may mix in one prompt; each kind is matched to its markers in order.

    Qwen3-VL's videos (``qwen3_video``: its video processor's settings) are sampled its own
    way and stand in the prompt as one run of placeholders per temporal patch, each after its
    timestamp (models/qwen3_vl_video.py); each run is a MediaInput of its own (grid t = 1),
    which the encoder gives the same rows as the whole video and its cache keeps apart."""

    image_config: QwenVisualConfig
    video_config: QwenVisualConfig
    tokenizer: TokenizerBundle
    image_token_id: int
    video_token_id: int
    tokens_per_second: float
    qwen3_video: Qwen3VideoConfig | None = None

    def prepare(
        self,
        text: str,
        media: Sequence[ImageItem | DecodedVideo],
        *,
        add_special: bool = True,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], list[MediaInput]]:
        """Token ids of ``text`` with its image and video markers expanded, and one MediaInput
        per item, in prompt order."""
        images = [self._expansion(m) for m in media if not isinstance(m, DecodedVideo)]
        video = self._expansion if self.qwen3_video is None else self._qwen3_video
        videos = [video(m) for m in media if isinstance(m, DecodedVideo)]
        groups = [
            MarkerGroup(IMAGE_PAD, self.image_token_id, "image", images),
            MarkerGroup(VIDEO_PAD, self.video_token_id, "video", videos),
        ]
        return expand_markers(
            self.tokenizer, text, groups, add_special=add_special, literal_spans=literal_spans
        )

    def tokens_for(self, width: int, height: int) -> int:
        """The placeholder tokens an upright image of this size stands for (from its header,
        before decoding); MediaPromptError as ``prepare`` would raise."""
        try:
            return image_tokens(width, height, self.image_config)
        except ImageConfigError as exc:
            raise MediaPromptError(str(exc)) from None

    def _expansion(self, item: ImageItem | DecodedVideo) -> Expansion:
        prepared, digest = self._prepare(item)
        cfg, modality = prepared.cfg, prepared.modality

        def expand(pixels: torch.Tensor) -> torch.Tensor:
            return visual_patches(pixels, cfg, modality)

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            made = MediaInput(
                digest,
                positions,
                prepared.pixels,
                expand,
                modality=modality,
                grid=prepared.grid,
                rope_step=prepared.seconds_per_grid * self.tokens_per_second,
            )
            return (made,)

        return Expansion(prepared.prompt_text(), prepared.num_embeddings, media)

    def _qwen3_video(self, video: DecodedVideo) -> Expansion:
        assert self.qwen3_video is not None
        try:
            prepared = prepare_qwen3_video(
                video.frames, video.frame_indices, video.fps, self.qwen3_video
            )
        except ImageConfigError as exc:
            raise MediaPromptError(str(exc)) from None
        runs, size = prepared.runs(), prepared.frame_tokens

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            return tuple(
                MediaInput(
                    f"{video.digest}:{i}",  # the encoder cache keeps each temporal patch
                    positions[i * size : (i + 1) * size],
                    run.pixels,
                    partial(visual_patches, cfg=run.cfg, modality="video"),
                    modality="video",
                    grid=run.grid,
                )
                for i, run in enumerate(runs)
            )

        return Expansion(prepared.prompt_text(), size * len(runs), media)

    def _prepare(self, item: ImageItem | DecodedVideo) -> tuple[PreparedVisual, str]:
        try:
            if isinstance(item, DecodedVideo):
                video = prepare_qwen_video(item.frames, sampled_fps(item), self.video_config)
                return video, item.digest
            image, digest = item
            return prepare_qwen_image(image, self.image_config), digest
        except ImageConfigError as exc:  # e.g. an aspect ratio past 200
            raise MediaPromptError(str(exc)) from None


def sampled_fps(video: DecodedVideo) -> float:
    """Frames kept a second: the stream's rate thinned by the sampling (transformers' video
    metadata ``sampled_fps``)."""
    if video.fps > 0 and video.total_frames > 0:
        return video.fps * len(video.frames) / video.total_frames
    return len(video.frames) / video.duration if video.duration > 0 else 1.0


@dataclass(frozen=True, slots=True)
class Gemma4Prompter:
    """Gemma 4's images, videos and audio clips, mixed in one prompt as written. Each marker
    the chat template writes (its image, video or audio token) becomes what transformers'
    Gemma4Processor puts there: an image's ``boi`` + one image token per soft token + ``eoi``
    (its patches of any shape and their places a MediaInput); a video's frames, each after its
    ``mm:ss`` time, each a MediaInput of its own (its placeholders see each other both ways, not
    the next frame's); a clip's ``boa`` + one audio token per encoder row + ``eoa``."""

    processing: Gemma4Processing
    tokenizer: TokenizerBundle
    image_token_id: int
    video_token_id: int
    audio_token_id: int

    def prepare(
        self,
        text: str,
        media: Sequence[ImageItem | DecodedAudio | DecodedVideo],
        *,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> tuple[list[int], list[MediaInput]]:
        """Token ids of ``text`` with every marker expanded, and the MediaInputs in prompt
        order; the caller has refused the modalities the checkpoint has no encoder for."""
        p, groups = self.processing, []
        if p.image is not None:
            images = [m for m in media if not isinstance(m, DecodedAudio | DecodedVideo)]
            items = [self._image(p.image, image, digest) for image, digest in images]
            groups.append(MarkerGroup(p.image.image_token, self.image_token_id, "image", items))
        if p.video is not None:
            videos = [self._video(p.video, m) for m in media if isinstance(m, DecodedVideo)]
            groups.append(MarkerGroup(p.video.video_token, self.video_token_id, "video", videos))
        if p.audio is not None:
            clips = [gemma_clip(p.audio, m) for m in media if isinstance(m, DecodedAudio)]
            groups.append(MarkerGroup(p.audio.audio_token, self.audio_token_id, "audio", clips))
        return expand_markers(self.tokenizer, text, groups, literal_spans=literal_spans)

    def image_tokens(self, width: int, height: int) -> int:
        """The prompt tokens an upright image of this size stands for, ``boi`` and ``eoi``
        included; MediaPromptError for a size the processor refuses."""
        assert self.processing.image is not None
        try:
            return self.processing.image.num_soft_tokens(height, width) + 2
        except ImageConfigError as exc:
            raise MediaPromptError(str(exc)) from None

    @staticmethod
    def _image(cfg: Gemma4ImageConfig, image: Image.Image, digest: str) -> Expansion:
        try:
            prepared = cfg.prepare(image)
        except ImageConfigError as exc:  # e.g. too small to hold one pooled cell
            raise MediaPromptError(str(exc)) from None

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            return (MediaInput(digest, positions, prepared.patches, places=prepared.positions),)

        return Expansion(prepared.prompt_text(), prepared.num_soft_tokens, media)

    @staticmethod
    def _video(cfg: Gemma4VideoConfig, video: DecodedVideo) -> Expansion:
        try:
            frames = cfg.prepare(video.frames)
        except ImageConfigError as exc:
            raise MediaPromptError(str(exc)) from None
        if not frames:
            raise MediaPromptError("a video has no frames")
        size = frames[0].num_soft_tokens  # every frame has the stream's size

        def media(positions: tuple[int, ...]) -> tuple[MediaInput, ...]:
            return tuple(
                MediaInput(
                    f"{video.digest}:{i}",  # the encoder cache keeps each frame
                    positions[i * size : (i + 1) * size],
                    frame.patches,
                    modality="video",
                    places=frame.positions,
                )
                for i, frame in enumerate(frames)
            )

        text = cfg.prompt_text(video.frame_indices, video.fps, size)
        return Expansion(text, size * len(frames), media)
