"""ModelRunner: turns a SchedulerOutput into one forward pass over a flat token batch.

It owns the KV-cache tensors. Per step it builds the flat inputs (token ids, positions, the slot
of each new token) and the attention metadata, runs the model, and returns logits only for the
rows where a request needs its next token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferd.engine.scheduler import ScheduledChunk, SchedulerOutput
from inferd.layers.attention import AttentionMetadata, PrefillChunk, chunk_mask, decode_mask
from inferd.models.config import ModelConfig
from inferd.models.llama import KVCache, LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows whose hidden state becomes logits
    sampled_chunks: tuple[ScheduledChunk, ...]  # same order as sample_rows


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(config.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> tuple[torch.Tensor, tuple[ScheduledChunk, ...]]:
        """Run one step; returns logits [num_sampled, vocab] and the chunks they belong to."""
        inputs = self.prepare(output)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return logits, inputs.sampled_chunks

    def prepare(self, output: SchedulerOutput) -> ModelInputs:
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        bs = self.block_size
        for chunk in output.chunks:
            req, row = chunk.request, len(ids)
            span = range(chunk.start, chunk.start + chunk.num_tokens)
            ids.extend(req.token_at(p) for p in span)
            positions.extend(span)
            blocks.extend(req.block_ids[p // bs] for p in span)
            offsets.extend(p % bs for p in span)
            if chunk.num_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(req.block_ids[: chunk.start // bs + 1])
            else:
                n_blocks = -(-(chunk.start + chunk.num_tokens) // bs)
                table = torch.tensor(req.block_ids[:n_blocks], dtype=torch.long)
                mask = chunk_mask(chunk.start, chunk.num_tokens)
                prefills.append(PrefillChunk(row, chunk.num_tokens, chunk.start, table, mask))
            if chunk.completes:
                sample_rows.append(len(ids) - 1)
                sampled.append(chunk)
        tables = _pad_tables(decode_tables) if decode_rows else None
        mask = None
        if tables is not None:
            decode_pos = torch.tensor([positions[r] for r in decode_rows], dtype=torch.long)
            mask = decode_mask(decode_pos, tables.shape[1] * bs)
        meta = AttentionMetadata(
            slot_blocks=torch.tensor(blocks, dtype=torch.long),
            slot_offsets=torch.tensor(offsets, dtype=torch.long),
            decode_rows=torch.tensor(decode_rows, dtype=torch.long) if decode_rows else None,
            decode_block_tables=tables,
            decode_mask=mask,
            prefills=tuple(prefills),
        )
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long),
            sampled_chunks=tuple(sampled),
        )


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    """Block tables of unequal length, padded with the null block into one [n, max] tensor."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
