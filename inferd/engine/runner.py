"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat token batch.

It owns the KV-cache tensors. Per step it builds the flat inputs (token ids, positions, the slot
of each new token) and the attention metadata, runs the model, and returns logits only for the
rows where a request needs its next token, plus, for requests that ask for prompt logprobs and
have not had them yet, the logits of their prompt rows (each predicts the next prompt token).
A decode that carries speculative drafts (engine/speculative.py) needs logits at every one of
its rows: each row is a one-query decode at its position, as a plain decode would have been.

Media: a prompt chunk that holds placeholder tokens of a request's images or audio clips
(``Request.media``) runs from embeddings, the tokens' with the encoder's rows written over those
positions. The step's media are encoded once, in batches of one modality across requests,
unless the encoder cache (engine/encoder_cache.py, by digest) has them; a chunk may end inside
an image or clip, and the next one takes the rest of its rows from the cache.

Which kernels a step runs is chosen here, so that a row's numerics do not depend on what runs
beside it where that matters (README: "Determinism"):

- by default a step with prompt rows runs every row dense (``dense_rows``), so a prompt's logits
  are the same whether it came in one chunk or many, or mostly from the prefix cache; steps of
  decodes alone keep the batch-size kernels (weight-only int4/int8 up to ``small_batch`` rows,
  dense past it);
- ``deterministic``: every row of every step dense, and every row's attention through the
  one-query paged kernel (a prompt row attends as if it were a decode at its position), so a
  row's bits depend only on its request: not on the batch, the chunking, preemption or prefix
  hits. Rows of a bidirectional span (Gemma 3's images) still go through the prefill tiles,
  the only path that lets a row see later keys, one prefill per span (whose shapes do not
  depend on the chunking either).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from inferd.engine.encoder_cache import EncoderCache
from inferd.engine.kv_cache import NULL_BLOCK
from inferd.engine.request import MediaInput, Request
from inferd.engine.scheduler import ScheduledChunk, SchedulerOutput
from inferd.host_memory import huge_page_zeros
from inferd.kernels.kv_quant import row_width
from inferd.layers.attention import AttentionMetadata, PrefillChunk, chunk_mask
from inferd.layers.linear import dense_rows, packed_rows
from inferd.layers.lora import lora_rows
from inferd.models.config import ModelConfig
from inferd.models.llama import KVCache, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows whose hidden state becomes logits; None: all
    # Same order as sample_rows: one row each, 1 + len(draft) for a chunk with drafts.
    sampled_chunks: tuple[ScheduledChunk, ...]
    prompt_rows: torch.Tensor | None = None  # rows whose logits score the next prompt token
    prompt_spans: tuple[PromptSpan, ...] = ()  # same order as prompt_rows
    media: tuple[MediaSlice, ...] = ()  # rows whose embeddings an image encoder gives
    rope_positions: torch.Tensor | None = None  # [3, num_tokens]: M-RoPE models' positions


@dataclass(frozen=True, slots=True)
class MediaSlice:
    """Rows of a step that take one image's encoder rows ``first``, ``first + 1``, ...: the
    part of the image a prefill chunk holds (a chunk may end in the middle of an image)."""

    media: MediaInput
    rows: tuple[int, ...]
    first: int


@dataclass(frozen=True, slots=True)
class PromptSpan:
    """``count`` consecutive rows of one request; the first predicts prompt token ``first``."""

    request: Request
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class PromptLogits:
    """Logits of a request's prompt rows: row j predicts prompt token ``first + j``."""

    request: Request
    first: int
    logits: torch.Tensor  # [rows, vocab]


@dataclass(frozen=True, slots=True)
class StepResult:
    logits: torch.Tensor  # [rows, vocab]: one row per sampling chunk, 1 + drafts for a verify
    chunks: tuple[ScheduledChunk, ...]  # the chunks that sample, in the order of the rows
    prompt_logits: tuple[PromptLogits, ...] = ()
    hidden: torch.Tensor | None = None  # the logits rows' hidden states, when ``keep_hidden``


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        *,
        deterministic: bool = False,
        encoder_cache_bytes: int = 256 << 20,
    ) -> None:
        self.model = model
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.deterministic = deterministic
        self.keep_hidden = False  # a drafter that starts from the model's hidden states
        self.config = config
        self.block_size = block_size
        # ``kv_dtype``: the model's dtype, another float one, or int8 rows with their scales
        # (inferd/kernels/kv_quant.py), which the kernels quantize and dequantize.
        self.kv_dtype = kv_dtype
        self.kv_caches: list[KVCache] = []  # read block by block each step: huge pages
        for layer in range(config.num_layers):  # each layer's shape (Gemma 4's global ones)
            source = config.kv_source(layer)
            if source != layer:  # Gemma 4's K/V-sharing layers read an earlier layer's cache
                self.kv_caches.append(self.kv_caches[source])
                continue
            heads, head_dim = config.kv_shape(layer)
            shape = (num_blocks, block_size, heads, row_width(head_dim, kv_dtype))
            self.kv_caches.append(
                (huge_page_zeros(shape, kv_dtype), huge_page_zeros(shape, kv_dtype))
            )

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        """Run one step: logits of the sampling rows (and of prompt rows where asked for)."""
        inputs = self.prepare(output)
        embeds = None
        if inputs.media:
            # Encoder rows are prompt rows: dense, so an image's rows do not depend on how many
            # tiles or clips were encoded beside it (the batch-size kernels would switch to the
            # int8 copies below ``small_batch`` rows), as the decoder's prompt rows are.
            with dense_rows():
                embeds = self._embeddings(inputs)
        positions = inputs.positions if inputs.rope_positions is None else inputs.rope_positions
        with self._row_kernels(output), lora_rows(_row_adapters(output)):
            hidden = self.model(
                inputs.input_ids, positions, inputs.meta, self.kv_caches, embeds=embeds
            )
        with self._logit_kernels(output):
            rows = inputs.sample_rows
            sampled = hidden if rows is None else hidden[rows]
            logits = self.model.compute_logits(sampled)
            kept = sampled if self.keep_hidden else None
            if inputs.prompt_rows is None:
                return StepResult(logits, inputs.sampled_chunks, hidden=kept)
            prompt_logits = self.model.compute_logits(hidden[inputs.prompt_rows])
        parts, row = [], 0
        for span in inputs.prompt_spans:
            rows = prompt_logits[row : row + span.count]
            parts.append(PromptLogits(span.request, span.first, rows))
            row += span.count
        return StepResult(logits, inputs.sampled_chunks, tuple(parts), kept)

    def _embeddings(self, inputs: ModelInputs) -> torch.Tensor:
        """The step's input embeddings: the tokens', with image rows over their placeholders."""
        x = self.model.embed(inputs.input_ids)
        encoded = self.encode([part.media for part in inputs.media])
        for part in inputs.media:
            rows = torch.tensor(part.rows, dtype=torch.long)
            image = encoded[part.media.digest]
            x[rows] = image[part.first : part.first + len(part.rows)].to(x.dtype)
        return x

    def encode(self, media: Sequence[MediaInput]) -> dict[str, torch.Tensor]:
        """Encoder rows of each image by digest: from the encoder cache, the others encoded
        together across the step's requests (a model's tiles all have one size), in calls of
        at most ENCODER_BATCH_TILES tiles, and kept."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[str, MediaInput] = {}
        for m in media:
            if m.digest in found or m.digest in missing:
                continue
            cached = self.encoder_cache.get(m.digest)
            if cached is not None:
                found[m.digest] = cached
            else:
                missing[m.digest] = m
        for batch in _tile_batches(list(missing.values())):
            for m, part in zip(batch, self._encode_batch(batch), strict=True):
                if part.shape[0] != len(m.positions):
                    raise ValueError(
                        f"an {m.modality} encodes to {part.shape[0]} rows for "
                        f"{len(m.positions)} placeholder tokens"
                    )
                part = part.clone() if len(batch) > 1 else part  # not a view of the batch
                self.encoder_cache.put(m.digest, part)
                found[m.digest] = part
        return found

    def _encode_batch(self, batch: list[MediaInput]) -> list[torch.Tensor]:
        """One encoder call for media of one modality: each one's rows."""
        places = [m.places for m in batch if m.places is not None]
        if places:  # Gemma 4: images of any shape, one call each
            pairs = zip(batch, places, strict=True)  # a batch is of one model's media
            return [self.model.encode_patches(m.encoder_input(), p) for m, p in pairs]
        inputs = torch.cat([m.encoder_input() for m in batch])
        grids = [m.grid for m in batch if m.grid is not None]
        if grids:
            return self.model.encode_grids(inputs, grids)
        if batch[0].modality == "audio":
            return self.model.encode_audio(inputs, [m.frames for m in batch])
        tiles = [m.pixel_values.shape[0] for m in batch]
        rows = self.model.encode_images(inputs)
        per_tile = rows.shape[0] // sum(tiles)
        return list(rows.split([t * per_tile for t in tiles]))

    def _row_kernels(self, output: SchedulerOutput) -> AbstractContextManager[None]:
        """Dense rows for steps with prompt rows (always, when deterministic); packed rows
        for a step of decodes with drafts, however many (each row's bits those of a plain
        decode: ``packed_rows``); else the batch-size kernels."""
        if self.deterministic or not _decodes_only(output):
            return dense_rows()
        if any(c.draft for c in output.chunks):
            return packed_rows()
        return nullcontext()

    def _logit_kernels(self, output: SchedulerOutput) -> AbstractContextManager[None]:
        """The output head's: dense when deterministic, packed for a verify step of decodes
        (as its layers'), else by batch size."""
        if self.deterministic:
            return dense_rows()
        if _decodes_only(output) and any(c.draft for c in output.chunks):
            return packed_rows()
        return nullcontext()

    def _prefill_chunk(self, req: Request, row: int, start: int, count: int) -> PrefillChunk:
        """Rows ``row..`` of the batch: ``count`` of the request's tokens from ``start``,
        attended through the prefill tiles. Every one of its bidirectional spans comes along,
        so a tile's shapes do not depend on the chunking (layers/attention.py)."""
        n_blocks = -(-(start + count) // self.block_size)
        table = torch.tensor(req.block_ids[:n_blocks], dtype=torch.long)
        mask = chunk_mask(start, count)
        return PrefillChunk(row, count, start, table, mask, req.bidirectional_spans)

    def prepare(self, output: SchedulerOutput) -> ModelInputs:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        prompt_rows: list[int] = []
        prompt_spans: list[PromptSpan] = []
        media: list[MediaSlice] = []
        rope: list[torch.Tensor] | None = [] if self.config.mrope_section is not None else None
        bs = self.block_size
        for chunk in output.chunks:
            req, row = chunk.request, len(ids)
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            ids.extend(chunk.token_ids())
            positions.extend(span)
            if rope is not None:
                rope.append(self._rope_positions(req, chunk.start, chunk.start + chunk.num_tokens))
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in span)
            prompt_chunk = chunk.start < req.num_prompt_tokens
            if req.media and prompt_chunk:
                media.extend(_media_slices(req, chunk, row))
            if self.deterministic or chunk.draft or (chunk.num_tokens == 1 and not prompt_chunk):
                # Deterministic: each row a one-query decode at its position (its keys are
                # written before attention runs), the same sums whatever the chunking. A prompt
                # row otherwise always attends through the prefill tiles, even alone (a retry
                # whose prompt the prefix cache held recomputes just the last prompt token).
                # Rows of a bidirectional span (Gemma 3's images) go through the tiles anyway
                # (a decode sees no later key), one prefill per span.
                inside = _spans_in(req, chunk)
                for i, p in enumerate(span):
                    if not any(a <= p < b for a, b in inside):
                        decode_rows.append(row + i)
                        decode_tables.append(req.block_ids[: p // bs + 1])
                for a, b in inside:
                    prefills.append(self._prefill_chunk(req, row + a - chunk.start, a, b - a))
            else:
                prefills.append(self._prefill_chunk(req, row, chunk.start, chunk.num_tokens))
            if chunk.completes:
                sample_rows.extend(range(len(ids) - 1 - len(chunk.draft), len(ids)))
                sampled.append(chunk)
            if req.params.prompt_logprobs is not None and not req.output_token_ids:
                # Position p predicts prompt token p + 1; the last prompt row samples instead.
                end = min(chunk.start + chunk.num_tokens, req.num_prompt_tokens - 1)
                if end > chunk.start:
                    prompt_rows.extend(range(row, row + end - chunk.start))
                    prompt_spans.append(PromptSpan(req, chunk.start + 1, end - chunk.start))
        decoding = bool(decode_rows)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long) if decoding else None,
            decode_block_tables=_pad_tables(decode_tables) if decoding else None,
            decode_lens=(
                torch.tensor([positions[r] + 1 for r in decode_rows], dtype=torch.long)
                if decoding
                else None
            ),
            prefills=tuple(prefills),
        )
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            meta=meta,
            # Rows are sampled in order and at most once, so as many as the step's are all
            # of them (every row of a plain decode step): no gather then.
            sample_rows=(
                None
                if len(sample_rows) == len(ids)
                else torch.tensor(sample_rows, dtype=torch.long)
            ),
            sampled_chunks=tuple(sampled),
            prompt_rows=torch.tensor(prompt_rows, dtype=torch.long) if prompt_rows else None,
            prompt_spans=tuple(prompt_spans),
            media=tuple(media),
            rope_positions=torch.cat(rope, dim=1) if rope else None,
        )

    def _rope_positions(self, req: Request, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions [3, end - start] of a request's tokens ``[start, end)``: the
        prompt's as the model lays them out around its media, then ``p + delta``."""
        if req.rope_positions is None:
            n = req.num_prompt_tokens
            spans = [(m.positions[0], m.grid, m.rope_step) for m in req.media if m.grid]
            req.rope_positions = self.model.rope_index(n, spans)
            req.rope_delta = int(req.rope_positions.max()) + 1 - n if n else 0
        n = req.rope_positions.shape[1]
        prompt = req.rope_positions[:, start : min(end, n)]
        if end <= n:
            return prompt
        later = torch.arange(max(start, n), end) + req.rope_delta
        return torch.cat((prompt, later.expand(3, -1)), dim=1)


# The most tiles one encoder call takes when it gathers several images: the call's activations
# grow with it (SmolVLM-256M: ~6 MB of MLP activations a tile in bf16), while the per-call
# overhead it saves is spent after a few tiles. An image with more tiles goes alone.
ENCODER_BATCH_TILES = 16
# An audio clip's 30 s window weighs about four tiles in the encoder (Qwen2-Audio: 1500
# positions of 1280 wide, 20 heads, against SmolVLM's 1024 patches of 768, 12 heads).
AUDIO_CLIP_TILES = 4
# A SigLIP tile's patches (SmolVLM's 512 px tiles of 16 px): what a grid of Qwen2.5-VL patches
# is counted in.
GRID_TILE_PATCHES = 1024


def _tile_batches(media: list[MediaInput]) -> list[list[MediaInput]]:
    """``media`` in order, in groups of one modality and at most ENCODER_BATCH_TILES tiles
    (or one image; an audio clip counts as AUDIO_CLIP_TILES)."""
    batches: list[list[MediaInput]] = []
    tiles = ENCODER_BATCH_TILES
    for m in media:
        n = _encoder_tiles(m)
        if not batches or tiles + n > ENCODER_BATCH_TILES or batches[-1][0].modality != m.modality:
            batches.append([])
            tiles = 0
        batches[-1].append(m)
        tiles += n
    return batches


def _encoder_tiles(m: MediaInput) -> int:
    """What one medium weighs in an encoder call, in tiles: an audio clip AUDIO_CLIP_TILES,
    patches (a grid's, Gemma 4's) ``GRID_TILE_PATCHES`` to a tile."""
    if m.modality == "audio":
        return AUDIO_CLIP_TILES
    if m.grid is not None:
        t, h, w = m.grid
        return -(-t * h * w // GRID_TILE_PATCHES)
    if m.places is not None:
        return -(-int(m.pixel_values.shape[0]) // GRID_TILE_PATCHES)
    return int(m.pixel_values.shape[0])


def _media_slices(req: Request, chunk: ScheduledChunk, row: int) -> list[MediaSlice]:
    """The parts of the request's images that fall in this chunk, at their batch rows."""
    start, end = chunk.start, chunk.start + chunk.num_tokens
    out = []
    for m in req.media:
        first, last = bisect_left(m.positions, start), bisect_left(m.positions, end)
        if last > first:
            rows = tuple(row + p - start for p in m.positions[first:last])
            out.append(MediaSlice(m, rows, first))
    return out


def _spans_in(req: Request, chunk: ScheduledChunk) -> list[tuple[int, int]]:
    """The parts of the request's bidirectional spans that this chunk holds, as positions."""
    start, end = chunk.start, chunk.start + chunk.num_tokens
    return [
        (max(a, start), min(b, end)) for a, b in req.bidirectional_spans if a < end and b > start
    ]


def _row_adapters(output: SchedulerOutput) -> list[str | None]:
    """Each row's LoRA adapter (None: the base model), in the order ``prepare`` lays rows."""
    return [c.request.params.lora for c in output.chunks for _ in range(c.num_tokens)]


def _decodes_only(output: SchedulerOutput) -> bool:
    """Whether every row of the step is a generated token (no prompt or recomputed rows)."""
    return all(
        c.num_tokens == 1 + len(c.draft) and c.start >= c.request.num_prompt_tokens
        for c in output.chunks
    )


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables of unequal length, padded with the null block into one [n, max] tensor."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=torch.long)
