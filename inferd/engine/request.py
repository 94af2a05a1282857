"""A request's state as the engine tracks it between steps."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferd.engine.detokenizer import IncrementalDetokenizer
from inferd.engine.sampling import SamplingParams
from inferd.engine.thinking import ThinkingTracker
from inferd.structured.matcher import TokenMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(frozen=True, slots=True)
class MediaInput:
    """One image or audio clip of a prompt, prepared for the model's encoder: its rows replace
    the embeddings of the prompt tokens at ``positions`` (its placeholder tokens, ascending,
    one per row)."""

    digest: str  # the content's digest: keys the encoder cache and the prefix cache
    positions: tuple[int, ...]
    # What the model's encoder takes, or a compact form of it that ``expand`` turns into it
    # when the encoder runs (an image's tiles of bytes): a request holds it until it finishes.
    # An image: its tiles [tiles, 3, H, W] for ``encode_images``; audio: its window's log-mel
    # features [1, mels, frames] for ``encode_audio``; an image or video with a ``grid``: its
    # flat patches [t * h * w, patch values] for ``encode_grids``; Gemma 4: see ``places``.
    pixel_values: torch.Tensor
    expand: Callable[[torch.Tensor], torch.Tensor] | None = None
    modality: str = "image"  # "image" | "video" | "audio": which encoder and placeholder token
    frames: int = 0  # audio: the mel frames the clip covers (the rest of its window is padding)
    # Qwen2.5-VL: the patch grid (t, h, w), which sets both the encoder's attention and the
    # M-RoPE positions of its tokens, and the temporal position step of a video (0: an image).
    grid: tuple[int, int, int] | None = None
    rope_step: float = 0.0
    # Gemma 4: an image's (or video frame's) patches [patches, patch values] as
    # ``pixel_values``, and here each patch's (x, y) place in its grid [patches, 2].
    places: torch.Tensor | None = None

    def encoder_input(self) -> torch.Tensor:
        return self.pixel_values if self.expand is None else self.expand(self.pixel_values)

    def overlaps(self, start: int, end: int) -> bool:
        """Whether it lies in part within prompt positions ``[start, end)``."""
        return self.positions[0] < end and self.positions[-1] >= start


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    # The draws of an unseeded sampled request (None: torch's global generator). A seeded
    # request draws from ``generator_at`` instead.
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    cache_salt: str | None = None  # isolates this caller's prefix-cache entries from others'
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    # Follows params.constraint through the output: it has consumed every output token once.
    matcher: TokenMatcher | None = None
    media: tuple[MediaInput, ...] = ()  # media whose encoder rows replace prompt embeddings
    # M-RoPE models: the prompt's [3, prompt tokens] positions, computed by the runner on first
    # use; a token past the prompt at index p has position p + rope_delta on all three axes.
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    thinking: ThinkingTracker | None = None  # follows params.thinking through the output
    # [start, end) prompt ranges whose tokens attend to each other both ways (Gemma 3's
    # images): prefill honours them, and the scheduler never ends a chunk inside one.
    bidirectional_spans: tuple[tuple[int, int], ...] = ()
    # Gemma 4's drafting assistant: the served model's final hidden state at the position
    # whose logits gave the last token (kept by the engine when a drafter needs it).
    draft_hidden: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.params.thinking is not None:
            self.thinking = ThinkingTracker(self.params.thinking)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def generator_at(self, index: int) -> torch.Generator | None:
        """The generator that draws output token ``index`` (0: the first output token).

        A seeded request's draws depend only on its seed and the token's position: each
        position gets a generator seeded from both, so however many draws were made before
        (one per token plainly, more or fewer when speculation verifies drafts: see
        engine/speculative.py) the same seed gives the same text, alone, in a batch or again.
        Unseeded: ``generator`` (None: the global one), whose stream simply goes on.
        """
        seed = self.params.seed
        if seed is None:
            return self.generator
        return torch.Generator().manual_seed(position_seed(seed, index))

    @property
    def draws_on(self) -> torch.device | None:
        """The device of the request's draws (None: wherever its logits are)."""
        if self.params.seed is not None:
            return torch.device("cpu")  # generator_at's generators are CPU ones
        return None if self.generator is None else self.generator.device

    def media_digests(self, start: int, end: int) -> list[str]:
        """Digests of the media held in part by positions ``[start, end)``."""
        return [m.digest for m in self.media if m.overlaps(start, end)]

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]


def position_seed(seed: int, index: int) -> int:
    """A 64-bit seed for output position ``index`` of a request seeded with ``seed``: a hash,
    so nearby seeds and positions give unrelated streams (torch's CPU generator keeps only the
    low 32 bits of a seed; a hash spreads both inputs over them)."""
    data = seed.to_bytes(8, "little") + index.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
