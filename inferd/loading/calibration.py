"""A model's importance matrix from calibration text (``inferd imatrix``).

As llama.cpp's ``llama-imatrix`` does: the text is tokenized once (BOS first where the model
adds one) and cut into chunks of ``chunk_size`` tokens, the first token of each replaced by
BOS, so that every chunk reads as a document of its own; each chunk runs as one sequence from
position 0 on a fresh KV cache while an ``ImatrixCollector`` observes every projection. The
output head is run too where it has its own weight (ISQ quantizes it then: q8), as
``llama-imatrix --process-output`` does; a head tied to the embedding is never quantized.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from inferd.layers.attention import AttentionMetadata, PrefillChunk
from inferd.loading.imatrix import Imatrix, ImatrixCollector, ImatrixError
from inferd.loading.tokenizer import TokenizerBundle
from inferd.models.decode_stack import KVCache
from inferd.models.llama import LlamaForCausalLM

DEFAULT_CHUNK_SIZE = 512  # llama-imatrix's default context
_BLOCK = 16


def calibration_chunks(
    tokenizer: TokenizerBundle, text: str, chunk_size: int, max_chunks: int | None = None
) -> list[list[int]]:
    """The token chunks ``text`` gives (whole chunks only; at most ``max_chunks``)."""
    if chunk_size < 1:
        raise ImatrixError("the chunk size must be at least 1 token")
    ids = tokenizer.encode(text, add_special=True)
    count = len(ids) // chunk_size
    if max_chunks is not None:
        count = min(count, max_chunks)
    if count < 1:
        raise ImatrixError(
            f"the calibration text has {len(ids)} tokens, fewer than one chunk of {chunk_size}"
        )
    chunks = [ids[i * chunk_size : (i + 1) * chunk_size] for i in range(count)]
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


def compute_imatrix(
    model: LlamaForCausalLM,
    tokenizer: TokenizerBundle,
    text: str,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_chunks: int | None = None,
    dataset: str = "",
    progress: bool = True,
) -> Imatrix:
    """The importance matrix of ``model`` reading ``text`` (``dataset``: its name, recorded in
    the matrix as llama.cpp records the calibration file's)."""
    chunks = calibration_chunks(tokenizer, text, chunk_size, max_chunks)
    collector = ImatrixCollector(model)
    for chunk in tqdm(chunks, desc="imatrix", unit="chunk", disable=not progress):
        read_chunk(model, collector, chunk)
    return collector.imatrix((dataset,) if dataset else (), len(chunks), chunk_size)


def read_chunk(model: LlamaForCausalLM, collector: ImatrixCollector, chunk: list[int]) -> None:
    """Run one chunk through ``model`` while ``collector`` observes it, the output head too
    where it has its own weight. The collector is started for this chunk alone, so what the
    model runs between chunks (a server's requests) is not counted."""
    with collector:
        hidden = sequence_hidden(model, chunk)
        if not model.config.tie_word_embeddings:
            model.compute_logits(hidden)


@torch.inference_mode()
def sequence_hidden(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """The final hidden states [len(ids), hidden] of ``ids`` read as one sequence from position
    0, in one prefill on a KV cache of its own."""
    cfg, n = model.config, len(ids)
    blocks = -(-n // _BLOCK)
    dtype = model.embed_tokens.weight.dtype
    caches: list[KVCache] = []
    for layer in range(cfg.num_layers):
        source = cfg.kv_source(layer)
        if source != layer:  # Gemma 4's K/V-sharing layers read an earlier layer's cache
            caches.append(caches[source])
            continue
        shape = (blocks + 1, _BLOCK, *cfg.kv_shape(layer))  # block 0: the null block
        caches.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    table = torch.arange(1, blocks + 1)
    positions = torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=table[positions // _BLOCK] * _BLOCK + positions % _BLOCK,
        decode_rows=None,
        decode_block_tables=None,
        decode_lens=None,
        prefills=(PrefillChunk(0, n, 0, table, None),),
    )
    hidden: torch.Tensor = model(torch.tensor(ids), positions, meta, caches)
    return hidden
