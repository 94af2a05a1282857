"""The decode stack (one native call for a decode step's layers, models/decode_stack.py) gives
every row the bits the layer-by-layer path gives it: logits of every step and the KV caches it
wrote, on the real SmolLM2 and Gemma 3 (bf16, their GGUF's int4/int8 weights) and on tiny
random models of each architecture (QKV bias, q/k norms, soft-capping, sliding windows, partial
rotary); the engine's greedy replies are the same with it and without; and the steps it must not
take (a prompt chunk, ``dense_rows``, a LoRA row, a projection without a VNNI copy) run layer by
layer. A machine without AVX-512 VNNI skips it all (tests/machine.py): there is no stack to run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM, kernels
from inferd.engine.sampling import SamplingParams
from inferd.kernels.kv_quant import row_width
from inferd.layers.attention import AttentionMetadata, PrefillChunk
from inferd.layers.linear import Linear, PackedKind, dense_rows
from inferd.layers.lora import lora_rows
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import load_safetensors_model
from inferd.models.llama import LlamaForCausalLM
from tests.machine import vnni_missing
from tests.models.tiny import ARCHITECTURES, save_tiny

# The stack runs only the VNNI build's packed copies: without them both paths below would be
# the layer-by-layer one, compared with itself.
NO_VNNI = vnni_missing()
pytestmark = pytest.mark.skipif(NO_VNNI is not None, reason=str(NO_VNNI))

BLOCK = 16
Caches = list[tuple[torch.Tensor, torch.Tensor]]


def _caches(model: LlamaForCausalLM, blocks: int, dtype: torch.dtype) -> Caches:
    cfg = model.config
    shape = (blocks, BLOCK, cfg.num_kv_heads, row_width(cfg.head_dim, dtype))
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(cfg.num_layers)
    ]


def _prefill(model: LlamaForCausalLM, ids: list[int], table: torch.Tensor, caches: Caches) -> int:
    """The prompt into the caches (one chunk, as the runner's dense prompt rows); its greedy
    next token."""
    pos = torch.arange(len(ids))
    meta = AttentionMetadata(
        slot_mapping=table[pos // BLOCK] * BLOCK + pos % BLOCK,
        decode_rows=None,
        decode_block_tables=None,
        decode_lens=None,
        prefills=(PrefillChunk(0, len(ids), 0, table, None),),
    )
    with dense_rows():
        hidden = model(torch.tensor(ids), pos, meta, caches)
    return int(model.compute_logits(hidden[-1:]).argmax())


def _decode_meta(lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    pos = torch.tensor(lens) - 1  # each row's new token
    rows = torch.arange(len(lens))
    return AttentionMetadata(
        slot_mapping=tables[rows, pos // BLOCK] * BLOCK + pos % BLOCK,
        decode_rows=rows,
        decode_block_tables=tables,
        decode_lens=torch.tensor(lens),
        prefills=(),
    )


def decode_run(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    steps: int,
    stack: bool,
    cache_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], Caches]:
    """Each prompt prefilled, then ``steps`` batched greedy decode steps of all of them: the
    logits of each step and the caches at the end."""
    model.stack_enabled = stack
    dtype = cache_dtype or model.embed_tokens.weight.dtype
    longest = max(len(p) for p in prompts) + steps
    per_seq = -(-longest // BLOCK)
    caches = _caches(model, 1 + per_seq * len(prompts), dtype)
    # Each sequence's blocks interleaved with the others' (as a pool hands them out).
    tables = torch.arange(1, 1 + per_seq * len(prompts)).view(per_seq, len(prompts)).T.contiguous()
    with torch.inference_mode():
        tokens = [_prefill(model, p, tables[i], caches) for i, p in enumerate(prompts)]
        lens = [len(p) + 1 for p in prompts]
        logits = []
        for _ in range(steps):
            meta = _decode_meta(lens, tables)
            hidden = model(torch.tensor(tokens), torch.tensor(lens) - 1, meta, caches)
            step = model.compute_logits(hidden)
            logits.append(step)
            tokens = step.argmax(-1).tolist()
            lens = [n + 1 for n in lens]
    return logits, caches


def assert_stack_matches_layers(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    steps: int,
    cache_dtype: torch.dtype | None = None,
) -> None:
    layers, layer_caches = decode_run(model, prompts, steps, stack=False, cache_dtype=cache_dtype)
    model._stack_built = False  # built afresh at the next decode step
    stacked, stacked_caches = decode_run(model, prompts, steps, stack=True, cache_dtype=cache_dtype)
    assert model._stack is not None, "the model should run its decode steps in the stack"
    for i, (a, b) in enumerate(zip(layers, stacked, strict=True)):
        assert torch.equal(a, b), f"step {i}: logits differ by {(a - b).abs().max():.3g}"
    for (k1, v1), (k2, v2) in zip(layer_caches, stacked_caches, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    return [[(7 * i + 31 * s + 3) % vocab for i in range(n)] for s, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> LlamaForCausalLM:
    model = load_gguf_model(GGUFFile(smollm2_gguf), torch.bfloat16, progress=False)[0]
    model.use_kernels(kernels.load_ops(torch.bfloat16))
    return model


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_smollm2_stack_gives_the_layers_bits(smollm2: LlamaForCausalLM, rows: int) -> None:
    # Lengths across block edges and past one attention chunk (128 keys).
    lengths = tuple(9 + 23 * r for r in range(rows))
    assert_stack_matches_layers(smollm2, _prompts(smollm2.config.vocab_size, lengths), steps=4)


def test_smollm2_stack_over_an_int8_cache(smollm2: LlamaForCausalLM) -> None:
    prompts = _prompts(smollm2.config.vocab_size, (40, 150, 7))
    assert_stack_matches_layers(smollm2, prompts, steps=4, cache_dtype=torch.int8)


def test_gemma3_stack_gives_the_layers_bits(gemma3_gguf: Path) -> None:
    """Sandwich norms, q/k norms, two rotary tables, sliding-window layers (a 512-key window:
    one prompt runs past it)."""
    model = load_gguf_model(GGUFFile(gemma3_gguf), torch.bfloat16, progress=False)[0]
    model.use_kernels(kernels.load_ops(torch.bfloat16))
    window = model.config.sliding_window
    assert window is not None
    prompts = _prompts(model.config.vocab_size, (window + 20, 33))
    assert_stack_matches_layers(model, prompts, steps=3)


def _tiny_packed(arch: str, directory: Path) -> LlamaForCausalLM:
    save_tiny(arch, directory)
    model, _ = load_safetensors_model(directory, torch.bfloat16, progress=False)
    for m in model.layers.modules():
        if isinstance(m, Linear):
            m.pack(PackedKind.INT4)  # the VNNI copy where the build has the kernel
    model.use_kernels(kernels.load_ops(torch.bfloat16))
    return model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tiny_architectures_stack_gives_the_layers_bits(arch: str, tmp_path: Path) -> None:
    model = _tiny_packed(arch, tmp_path)
    prompts = _prompts(model.config.vocab_size, (40, 3, 17))  # past the tiny sliding windows
    assert_stack_matches_layers(model, prompts, steps=5)


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Iterator[LlamaForCausalLM]:
    yield _tiny_packed("llama", tmp_path)


def _runs_stack(model: LlamaForCausalLM, rows: int = 2) -> bool:
    """Whether a decode step of ``rows`` rows runs in the stack (run_stack's answer)."""
    lens = [5 + r for r in range(rows)]
    caches = _caches(model, 1 + rows, model.embed_tokens.weight.dtype)
    tables = torch.arange(1, 1 + rows).view(rows, 1)
    meta = _decode_meta(lens, tables)
    x = model.embed(torch.zeros(rows, dtype=torch.long))
    with torch.inference_mode():
        return model.run_stack(x, torch.tensor(lens) - 1, meta, caches) is not None


def test_steps_the_stack_must_not_take(tiny_llama: LlamaForCausalLM) -> None:
    assert _runs_stack(tiny_llama)
    with dense_rows():  # --deterministic, or a step with prompt rows
        assert not _runs_stack(tiny_llama)
    with lora_rows(["adapter", None]):  # a row with an adapter
        assert not _runs_stack(tiny_llama)
    tiny_llama.stack_enabled = False
    assert not _runs_stack(tiny_llama)
    tiny_llama.stack_enabled = True
    # A projection without a VNNI copy keeps the model out of the stack altogether.
    block: Any = tiny_llama.layers[1]
    down: Linear = block.mlp.down_proj
    down.packed_kind = None
    tiny_llama._stack_built = False
    assert not _runs_stack(tiny_llama)
    assert tiny_llama._stack is None


def test_engine_greedy_replies_with_and_without_the_stack(smollm2_gguf: Path) -> None:
    """Through the whole engine at its defaults (six requests batched), an int8 cache too."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    chats = [[{"role": "user", "content": f"Tell me about the number {i}."}] for i in range(6)]
    for kv in ("auto", "int8"):
        with LLM(str(smollm2_gguf), kv_cache_dtype=kv) as llm:
            model = llm.model.engine.engine.model
            replies = {}
            for stack in (False, True):
                model.stack_enabled = stack
                outs = llm.chat(chats, params, use_tqdm=False)
                replies[stack] = [o.outputs[0].token_ids for o in outs]
            assert model._stack is not None
            assert replies[False] == replies[True], kv
