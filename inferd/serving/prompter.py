"""How one model's prompts take media: a ``Prompter``, chosen once per model by ``prompter_for``
(``serving.served.assemble`` calls it), turns rendered prompt text and decoded media into token
ids and the ``MediaInput``s to submit with them, and answers what the server asks before any
medium is decoded: the modalities the model takes, an image's token cost, the audio rate, the
video sampling, and whether the chat template wants every content as a list of parts.

One prompter per kind of model: text only, images (Idefics3/SmolVLM, Gemma 3; SmolVLM2's videos
too), audio (Qwen2-Audio, Gemma 3n), image and video grids (Qwen2.5-VL, Qwen3-VL), and Gemma 4's
images, videos and audio together. Each composes the per-modality marker expansion of
serving/multimodal.py, and refuses what its model does not take with the same messages the
server has always given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from inferd.engine.request import MediaInput
from inferd.loading.model import LoadedModel
from inferd.loading.tokenizer import TokenizerBundle
from inferd.media.types import DecodedAudio, DecodedVideo
from inferd.media.video import FrameSampling
from inferd.models.gemma3_image import AROUND
from inferd.models.smolvlm_video import SmolVLMVideoConfig
from inferd.serving.multimodal import (
    AudioPrompter,
    Gemma4Prompter,
    GridPrompter,
    ImageItem,
    ImagePrompter,
    MediaPromptError,
    VideoPrompter,
    expand_markers,
    surround_markers,
)

MediaItem = ImageItem | DecodedAudio | DecodedVideo  # a decoded image (RGB, digest), clip or video
Spans = Sequence[tuple[int, int]]


class Prompt(NamedTuple):
    """A prompt ready to submit: its token ids and the media whose rows replace some of them
    (``engine.submit(prompt.ids, params, media=prompt.media)``)."""

    ids: list[int]
    media: list[MediaInput]


@dataclass(frozen=True, slots=True)
class MediaSplit:
    """A prompt's media by kind, each kind in prompt order."""

    images: list[ImageItem]
    clips: list[DecodedAudio]
    videos: list[DecodedVideo]

    @classmethod
    def of(cls, media: Sequence[MediaItem]) -> MediaSplit:
        return cls(
            [m for m in media if not isinstance(m, DecodedAudio | DecodedVideo)],
            [m for m in media if isinstance(m, DecodedAudio)],
            [m for m in media if isinstance(m, DecodedVideo)],
        )


@dataclass(frozen=True, slots=True)
class Prompter(ABC):
    """What a model needs to turn rendered text and decoded media into a prompt. The answers
    here are a text-only model's; a prompter for a kind of media overrides those it changes."""

    model: str  # the name it is served as, which its refusals name
    tokenizer: TokenizerBundle

    kind: ClassVar[str]  # text | image | audio | grid | gemma4
    # A multimodal template iterates the parts of each message (SmolVLM's drops plain string
    # content without a word), so it gets every content as parts.
    parts_content: ClassVar[bool] = True

    @property
    def modalities(self) -> tuple[str, ...]:
        """What the model reads, text first."""
        return ("text",)

    @property
    def audio_sample_rate(self) -> int | None:
        """The rate its audio features are computed at; None for a model without audio."""
        return None

    @property
    def video_sampling(self) -> FrameSampling | None:
        """Which frames of a video its processor keeps; None where the decoder picks them."""
        return None

    def image_tokens(self, width: int, height: int) -> int | None:
        """The prompt tokens an image of this size costs, upright or turned a quarter, whichever
        is fewer (a bound known from the header); None when the model takes no images.
        MediaPromptError for a size its processor refuses."""
        return None

    @abstractmethod
    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        """Token ids of rendered ``text`` whose markers (one per item of ``media``, in order;
        none inside ``literal_spans``) stand for ``media``, and one MediaInput per item.
        MediaPromptError when they disagree or the model does not take an item's modality."""

    def refuse(self, what: str) -> MediaPromptError:
        return MediaPromptError(f"{self.model} takes no {what}")

    def sorted_media(self, media: Sequence[MediaItem], *, video: bool) -> MediaSplit:
        """``media`` by kind, after the refusals every non-grid model shares: a video where it
        takes none (or beside audio), images beside audio (no model here reads both)."""
        split = MediaSplit.of(media)
        if split.videos and (split.clips or not video):
            raise self.refuse("video" + " with audio" * bool(split.clips))
        if not split.videos and split.clips and split.images:
            raise MediaPromptError(f"{self.model} takes images or audio in a prompt, not both")
        return split


@dataclass(frozen=True, slots=True)
class TextPrompter(Prompter):
    """A model that reads text alone: the tokenizer's ids; any medium is refused."""

    kind: ClassVar[str] = "text"
    parts_content: ClassVar[bool] = False

    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        split = self.sorted_media(media, video=False)
        if split.images:
            raise self.refuse("images")
        if split.clips:
            raise self.refuse("audio")
        return self.tokenizer.encode(text, add_special=True, literal_spans=literal_spans), []


@dataclass(frozen=True, slots=True)
class ImageModelPrompter(Prompter):
    """Idefics3/SmolVLM's tiled images or Gemma 3's one square each; SmolVLM2's videos too,
    when the checkpoint has video settings (``videos``)."""

    images: ImagePrompter
    videos: VideoPrompter | None = None

    kind: ClassVar[str] = "image"

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("text", "image", "video") if self.videos is not None else ("text", "image")

    @property
    def video_sampling(self) -> SmolVLMVideoConfig | None:
        return self.videos.config if self.videos is not None else None

    def image_tokens(self, width: int, height: int) -> int | None:
        return min(self.images.tokens_for(width, height), self.images.tokens_for(height, width))

    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        split = self.sorted_media(media, video=self.videos is not None)
        if split.videos and self.videos is not None:  # images and videos interleave as written
            groups = [self.images.group(split.images), self.videos.group(split.videos)]
            return expand_markers(self.tokenizer, text, groups, literal_spans=literal_spans)
        if split.clips:
            raise self.refuse("audio")
        return self.images.prepare(text, split.images, literal_spans=literal_spans)


@dataclass(frozen=True, slots=True)
class AudioModelPrompter(Prompter):
    """Qwen2-Audio's clips (each ``<|AUDIO|>`` marker becomes one placeholder per encoder row)
    or Gemma 3n's (its fixed count of audio tokens between ``boa`` and ``eoa``)."""

    audio: AudioPrompter

    kind: ClassVar[str] = "audio"

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("text", "audio")

    @property
    def audio_sample_rate(self) -> int | None:
        return self.audio.config.sampling_rate

    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        split = self.sorted_media(media, video=False)
        if split.images:
            raise self.refuse("images")
        return self.audio.prepare(text, split.clips, literal_spans=literal_spans)


@dataclass(frozen=True, slots=True)
class Gemma3nModelPrompter(Prompter):
    """Gemma 3n's images (Gemma 3's one square each, written as the image soft token) and
    audio clips, for the encoders its checkpoint carries, mixed as written: each marker between
    blank lines, as Gemma3nProcessor writes both."""

    images: ImagePrompter | None
    audio: AudioPrompter | None

    kind: ClassVar[str] = "gemma3n"

    @property
    def modalities(self) -> tuple[str, ...]:
        media = (("image", self.images), ("audio", self.audio))
        return ("text", *(name for name, prompter in media if prompter is not None))

    @property
    def audio_sample_rate(self) -> int | None:
        return self.audio.config.sampling_rate if self.audio is not None else None

    def image_tokens(self, width: int, height: int) -> int | None:
        return self.images.tokens_for(width, height) if self.images is not None else None

    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        split = MediaSplit.of(media)
        if split.videos:
            raise self.refuse("video")
        if split.clips and self.audio is None:
            raise self.refuse("audio")
        if split.images and self.images is None:
            raise self.refuse("images")
        groups = []
        if self.images is not None:
            groups.append(self.images.group(split.images))
        if self.audio is not None:
            groups.append(self.audio.group(split.clips))
        spans = list(literal_spans)
        for group in groups:
            text, spans = surround_markers(text, group.marker, AROUND, spans)
        return expand_markers(self.tokenizer, text, groups, literal_spans=spans)


@dataclass(frozen=True, slots=True)
class GridModelPrompter(Prompter):
    """Qwen2.5-VL's and Qwen3-VL's images and videos as patch grids, mixed in one prompt."""

    grid: GridPrompter

    kind: ClassVar[str] = "grid"

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("text", "image", "video")

    @property
    def video_sampling(self) -> FrameSampling | None:
        return self.grid.qwen3_video  # Qwen3-VL's processor samples its own way

    def image_tokens(self, width: int, height: int) -> int | None:
        return min(self.grid.tokens_for(width, height), self.grid.tokens_for(height, width))

    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        if any(isinstance(m, DecodedAudio) for m in media):
            raise self.refuse("audio")
        visual = [m for m in media if not isinstance(m, DecodedAudio)]
        return self.grid.prepare(text, visual, literal_spans=literal_spans)


@dataclass(frozen=True, slots=True)
class Gemma4ModelPrompter(Prompter):
    """Gemma 4's images, videos and audio clips, any mix in one prompt, for the encoders its
    checkpoint has (a video needs the image encoder)."""

    media: Gemma4Prompter

    kind: ClassVar[str] = "gemma4"

    @property
    def modalities(self) -> tuple[str, ...]:
        p = self.media.processing
        visual = ("image", "video") if p.image is not None else ()
        return ("text", *visual, *(("audio",) if p.audio is not None else ()))

    @property
    def audio_sample_rate(self) -> int | None:
        audio = self.media.processing.audio
        return audio.sampling_rate if audio is not None else None

    @property
    def video_sampling(self) -> FrameSampling | None:
        return self.media.processing.video

    def image_tokens(self, width: int, height: int) -> int | None:
        if self.media.processing.image is None:
            return None
        return min(self.media.image_tokens(width, height), self.media.image_tokens(height, width))

    def prepare(
        self, text: str, media: Sequence[MediaItem], *, literal_spans: Spans = ()
    ) -> tuple[list[int], list[MediaInput]]:
        split = MediaSplit.of(media)
        if split.clips and self.media.processing.audio is None:
            raise self.refuse("audio")
        if (split.images or split.videos) and self.media.processing.image is None:
            raise self.refuse("images" if split.images else "video")
        return self.media.prepare(text, media, literal_spans=literal_spans)


def prompter_for(loaded: LoadedModel) -> Prompter:
    """The prompter for what ``loaded``'s encoders and processor settings take."""
    name, tokenizer, cfg = loaded.source.name, loaded.tokenizer, loaded.config
    if cfg.vision is not None and loaded.image_config is not None:
        images = ImagePrompter(loaded.image_config, tokenizer, cfg.vision.image_token_id)
        video = loaded.video_config  # SmolVLM2 with video settings
        videos = VideoPrompter(video, cfg.vision.image_token_id) if video is not None else None
        return ImageModelPrompter(name, tokenizer, images, videos)
    if cfg.audio is not None and loaded.audio_config is not None:
        audio = AudioPrompter(loaded.audio_config, tokenizer, cfg.audio.audio_token_id)
        return AudioModelPrompter(name, tokenizer, audio)
    if cfg.gemma3n is not None and (loaded.gemma3n_audio or loaded.image_config):
        return _gemma3n_prompter(loaded)
    if cfg.qwen_vision is not None and loaded.visual_configs is not None:
        q, (image_config, video_config) = cfg.qwen_vision, loaded.visual_configs
        grid = GridPrompter(
            image_config,
            video_config,
            tokenizer,
            q.image_token_id,
            q.video_token_id,
            q.tokens_per_second,
            loaded.qwen3_video,
        )
        return GridModelPrompter(name, tokenizer, grid)
    if loaded.gemma4 is not None:
        g4_vision, g4_audio = cfg.gemma4_vision, cfg.gemma4_audio
        media = Gemma4Prompter(
            loaded.gemma4,
            tokenizer,
            g4_vision.image_token_id if g4_vision is not None else -1,
            g4_vision.video_token_id if g4_vision is not None else -1,
            g4_audio.audio_token_id if g4_audio is not None else -1,
        )
        return Gemma4ModelPrompter(name, tokenizer, media)
    return TextPrompter(name, tokenizer)


def _gemma3n_prompter(loaded: LoadedModel) -> Gemma3nModelPrompter:
    """Gemma 3n's prompter, for the encoders its checkpoint carries."""
    tokenizer, cfg = loaded.tokenizer, loaded.config
    clips: AudioPrompter | None = None
    images: ImagePrompter | None = None
    if cfg.gemma3n_audio is not None and loaded.gemma3n_audio is not None:
        clips = AudioPrompter(loaded.gemma3n_audio, tokenizer, cfg.gemma3n_audio.audio_token_id)
    if cfg.gemma3n_vision is not None and loaded.image_config is not None:
        image_id = cfg.gemma3n_vision.image_token_id
        images = ImagePrompter(loaded.image_config, tokenizer, image_id)
    return Gemma3nModelPrompter(loaded.source.name, tokenizer, images, clips)
