"""Our Llama against transformers reading the same GGUF: logits and greedy generations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.layers.attention import AttentionMetadata, PrefillChunk, chunk_mask
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.models.llama import LlamaForCausalLM
from tests.kernels.choice import OPS_NAMES, ops_named

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
    "Émile a écrit 三个字 and an emoji 🙂 — then stopped.",
]


def full_forward(
    model: LlamaForCausalLM, ids: list[int], block_size: int = 16, chunk: int | None = None
) -> torch.Tensor:
    """Logits for every position of one prompt, through the paged-attention path; ``chunk``:
    prefill that many tokens per forward (chunked prefill), else all at once."""
    cfg = model.config
    n = len(ids)
    num_blocks = -(-n // block_size)
    dtype = model.embed_tokens.weight.dtype
    caches = []
    for layer in range(cfg.num_layers):  # each layer's own shape (Gemma 4's global layers)
        shape = (num_blocks + 1, block_size, *cfg.kv_shape(layer))
        caches.append((torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)))
    table = torch.arange(1, num_blocks + 1)
    step = chunk or n
    out = []
    with torch.inference_mode():
        for start in range(0, n, step):
            pos = torch.arange(start, min(start + step, n))
            meta = AttentionMetadata(
                slot_mapping=table[pos // block_size] * block_size + pos % block_size,
                decode_rows=None,
                decode_block_tables=None,
                decode_lens=None,
                prefills=(PrefillChunk(0, len(pos), start, table, chunk_mask(start, len(pos))),),
            )
            hidden = model(torch.tensor(ids[start : start + len(pos)]), pos, meta, caches)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.fixture(scope="module")
def ours_f32(smollm2_gguf: Path) -> LlamaForCausalLM:
    return load_gguf_model(GGUFFile(smollm2_gguf), torch.float32, progress=False)[0]


@pytest.fixture(scope="module")
def ours_bf16(smollm2_gguf: Path) -> LlamaForCausalLM:
    return load_gguf_model(GGUFFile(smollm2_gguf), torch.bfloat16, progress=False)[0]


def _reference(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("ops_name", OPS_NAMES)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_f32_logits_match_transformers(
    prompt: str,
    ops_name: str,
    ours_f32: LlamaForCausalLM,
    hf_smollm2: Any,
    hf_smollm2_tokenizer: Any,
) -> None:
    ours_f32.use_kernels(ops_named(ops_name))
    ids = hf_smollm2_tokenizer(prompt)["input_ids"]
    ours, ref = full_forward(ours_f32, ids), _reference(hf_smollm2, ids)
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_bf16_top1_agrees_with_transformers(
    prompt: str, ours_bf16: LlamaForCausalLM, hf_smollm2: Any, hf_smollm2_tokenizer: Any
) -> None:
    ids = hf_smollm2_tokenizer(prompt)["input_ids"]
    ours, ref = full_forward(ours_bf16, ids), _reference(hf_smollm2, ids)
    assert ours[-1].argmax() == ref[-1].argmax()
    picks, wanted = ours.argmax(-1), ref.argmax(-1)
    # bf16 rounding may flip a near-tie, never a clear choice: wherever our pick differs, the
    # float32 reference must rank it within a fraction of a logit of its own top token.
    rows = torch.arange(len(ids))
    regret = ref[rows, wanted] - ref[rows, picks]
    assert regret.max().item() < 0.5, f"bf16 picks the reference ranks {regret.max():.2f} lower"
    agree = (picks == wanted).float().mean().item()
    assert agree >= 0.85, f"bf16 top-1 agreement {agree:.2f}"


def test_block_size_does_not_change_logits(
    ours_f32: LlamaForCausalLM, hf_smollm2_tokenizer: Any
) -> None:
    ids = hf_smollm2_tokenizer(PROMPTS[1])["input_ids"]
    torch.testing.assert_close(full_forward(ours_f32, ids, 4), full_forward(ours_f32, ids, 32))
