"""Gemma 3n's decoder (models/gemma3n.py) against transformers' Gemma3nForCausalLM on a tiny
random checkpoint (tests/models/tiny_gemma3n.py): float32 logits of a 110-token prompt (the
window is 8), whole and in chunks through the paged cache, the greedy continuation, the same
through the engine; bf16, the dtype users run, against transformers' bf16 and the float32
reference; the text path of a Gemma3nForConditionalGeneration directory (its audio path:
test_gemma3n_audio_parity.py); and a MatFormer slice against transformers' model of the sliced
config with the cut weights."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM, SamplingParams
from inferd.engine.runner import ModelRunner
from inferd.layers.linear import dense_rows
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.matformer import MatformerSlice, matformer_slice, read_matformer_slices
from inferd.loading.model import load
from inferd.models.config import ModelConfigError
from inferd.models.gemma3n import Gemma3nForCausalLM
from inferd.models.llama import LlamaForCausalLM
from tests.models.test_llama_parity import full_forward
from tests.models.tiny import VOCAB
from tests.models.tiny_gemma3n import (
    MATFORMER_CSV,
    MEDIA_VOCAB,
    MEDIA_VOCAB_SIZE,
    MM_TEXT,
    MM_VOCAB,
    PLE_VOCAB,
    SLICE_NAME,
    SLICE_WIDTHS,
    WINDOW,
    save_tiny_gemma3n_text,
    slice_reference,
)

LOGIT_TOLERANCE = 1e-3  # float32 on both sides: only summation order differs
PROMPT = torch.randint(3, VOCAB, (110,), generator=torch.Generator().manual_seed(4)).tolist()
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("gemma3n")
    return directory, save_tiny_gemma3n_text(directory)


@pytest.fixture(scope="module")
def pair(tiny: tuple[Path, Any]) -> tuple[Any, LlamaForCausalLM]:
    ours, _ = load_safetensors_model(tiny[0], torch.float32, progress=False)
    return tiny[1], ours


def hf_greedy(hf: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def our_greedy(ours: LlamaForCausalLM, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(full_forward(ours, ids, block_size=4)[-1].argmax()))
    return ids[len(prompt) :]


def test_config_reads_each_layers_parts(pair: tuple[Any, LlamaForCausalLM]) -> None:
    cfg = pair[1].config
    assert isinstance(pair[1], Gemma3nForCausalLM)
    assert cfg.gemma3n is not None and cfg.gemma4 is not None
    assert cfg.sliding_layers == (0, 1, 3, 4, 6) and cfg.sliding_window == WINDOW
    # layers 5..7 read the last global (2) and sliding (4) layers before them
    assert [cfg.kv_source(i) for i in range(8)] == [0, 1, 2, 3, 4, 2, 4, 2]
    assert cfg.gemma3n.intermediate_sizes == (96, 128) * 4
    assert cfg.gemma3n.sparsity[:4] == (0.95, 0.95, 0.95, 0.0)
    assert cfg.gemma3n.altup_inputs == 4 and cfg.gemma3n.laurel_rank == 8
    assert cfg.gemma4.per_layer_vocab == PLE_VOCAB and cfg.final_softcap == 30.0


@pytest.mark.parametrize("chunk", [None, 7])
def test_f32_logits_match_transformers(
    pair: tuple[Any, LlamaForCausalLM], chunk: int | None
) -> None:
    hf, ours = pair
    assert len(PROMPT) > 10 * WINDOW and max(PROMPT) >= PLE_VOCAB  # ids past the PLE table
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    logits = full_forward(ours, PROMPT, block_size=4, chunk=chunk)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_greedy_tokens_match_transformers(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    assert our_greedy(ours, PROMPT) == hf_greedy(hf, PROMPT)


def test_engine_greedy_matches_transformers(tiny: tuple[Path, Any]) -> None:
    """Through the engine (paged cache, K/V-sharing layers on their sources' caches, chunked
    prefill of 8 tokens a step, decode past the window), the greedy reply is transformers'."""
    directory, hf = tiny
    expected = hf_greedy(hf, PROMPT, 10)
    config = dict(dtype="f32", block_size=4, kv_cache_tokens=256, max_num_batched_tokens=8)
    with LLM(str(directory), **config) as llm:
        reply = llm.generate(
            [PROMPT], SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False
        )
    assert list(reply[0].outputs[0].token_ids) == expected


def test_kv_sharing_layers_hold_no_cache_of_their_own(pair: tuple[Any, LlamaForCausalLM]) -> None:
    ours = pair[1]
    caches = ModelRunner(ours, ours.config, 16, 4, torch.float32).kv_caches
    assert caches[5] is caches[2] and caches[6] is caches[4] and caches[7] is caches[2]


def test_conditional_generation_directory_serves_text_and_audio(
    tiny_gemma3n_audio: tuple[Path, Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A Gemma3nForConditionalGeneration directory loads its language model, the tables of its
    image and audio ranges of ids and its audio encoder (the image encoder's tensors are left
    absent), says its image encoder is not served, and takes text and audio; a text prompt's
    logits, ids of both ranges among them, are the whole model's."""
    directory, hf, _ = tiny_gemma3n_audio
    with caplog.at_level("WARNING"):
        loaded = load(directory, dtype="f32", progress=False, packed_kernels=False)
    assert "image encoder is not served (no MobileNet-v5 in the checkpoint)" in caplog.text
    assert "serving text and audio" in caplog.text
    assert loaded.config.input_modalities == ("text", "audio")
    ids = torch.randint(3, MM_VOCAB, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    for offset, _ in MEDIA_VOCAB.values():
        assert any(offset <= i < offset + MEDIA_VOCAB_SIZE for i in ids)
    assert any(i < MM_TEXT for i in ids)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    logits = full_forward(loaded.model, ids, block_size=4, chunk=9)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


# --- bf16 --------------------------------------------------------------------------------------

BF16_REGRET = 0.5  # a bf16 pick may differ from float32's at a near-tie, never at a clear one


@pytest.fixture(scope="module")
def pair_bf16(tiny: tuple[Path, Any]) -> tuple[Any, LlamaForCausalLM]:
    ours, _ = load_safetensors_model(tiny[0], torch.bfloat16, progress=False)
    return copy.deepcopy(tiny[1]).to(torch.bfloat16), ours


def test_bf16_per_layer_inputs_are_transformers_bits(
    pair_bf16: tuple[Any, LlamaForCausalLM],
) -> None:
    """The per-layer embeddings in bf16, their constant scales rounded to bf16 first as
    transformers' Gemma 3n rounds them."""
    hf, ours = pair_bf16
    ids = torch.tensor(PROMPT)
    with torch.no_grad(), dense_rows():
        embeds = hf.model.embed_tokens(ids[None])
        expected = hf.model.project_per_layer_inputs(
            embeds, hf.model.get_per_layer_inputs(ids[None])
        )
        assert isinstance(ours, Gemma3nForCausalLM)
        got = ours.per_layer_inputs(ids, embeds[0])
    assert torch.equal(got, expected[0])


def test_bf16_prompt_logits_are_as_close_to_f32_as_transformers_bf16(
    pair: tuple[Any, LlamaForCausalLM], pair_bf16: tuple[Any, LlamaForCausalLM]
) -> None:
    """Prompt logits as the engine computes them in bf16 (every prompt row through the dense
    bf16 weights): no further from the float32 reference than transformers' bf16 ones, and
    picking its tokens as often."""
    hf, ours = pair_bf16
    with torch.no_grad():
        reference = pair[0](torch.tensor([PROMPT])).logits[0]
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    with dense_rows():
        logits = full_forward(ours, PROMPT, block_size=4).float()
    ours_error = (logits - reference).abs().mean()
    theirs_error = (theirs - reference).abs().mean()
    assert ours_error < 1.25 * theirs_error, (ours_error, theirs_error)
    wanted = reference.argmax(-1)
    agree = (logits.argmax(-1) == wanted).float().mean()
    assert agree >= (theirs.argmax(-1) == wanted).float().mean() - 0.05


def test_bf16_engine_greedy_picks_what_f32_picks_up_to_near_ties(
    tiny: tuple[Path, Any],
) -> None:
    """The engine in bf16 (chunked prefill, paged cache, decode steps through its default
    kernels): each greedy token is the float32 reference's top one, or within a near-tie of it,
    given the same text before it."""
    directory, hf = tiny
    config = dict(dtype="bf16", block_size=4, kv_cache_tokens=256, max_num_batched_tokens=8)
    with LLM(str(directory), **config) as llm:
        reply = llm.generate(
            [PROMPT], SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False
        )
    tokens = list(reply[0].outputs[0].token_ids)
    with torch.no_grad():
        reference = hf(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    picked = reference[torch.arange(len(tokens)), torch.tensor(tokens)]
    regret = reference.max(-1).values - picked
    assert regret.max() < BF16_REGRET, regret


def test_lora_targets_are_refused_with_a_clear_message(
    pair: tuple[Any, LlamaForCausalLM],
) -> None:
    with pytest.raises(ModelConfigError, match="LoRA adapters on gemma3n"):
        pair[1].lora_target(0, "q_proj")


# --- MatFormer slices ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("matformer") / "MatFormer-config.csv"
    path.write_text(MATFORMER_CSV)
    return path


def test_the_slice_table_is_read_in_the_published_format(table: Path) -> None:
    slices = read_matformer_slices(table)
    assert list(slices) == ["Main model", SLICE_NAME]
    assert slices["Main model"] == MatformerSlice("Main model", (96, 128) * 4, ())
    assert slices[SLICE_NAME].ffn_dims == tuple(SLICE_WIDTHS)
    assert slices[SLICE_NAME].skipped == (3, 6)


@pytest.fixture(scope="module")
def sliced(tiny: tuple[Path, Any], table: Path) -> tuple[Any, LlamaForCausalLM]:
    directory, hf = tiny
    cut = matformer_slice(table, SLICE_NAME)
    ours, _ = load_safetensors_model(directory, torch.float32, progress=False, matformer=cut)
    return slice_reference(hf), ours


def test_slice_config_keeps_the_layers_and_their_sharing(
    sliced: tuple[Any, LlamaForCausalLM],
) -> None:
    cfg = sliced[1].config
    assert cfg.num_layers == 6 and cfg.gemma3n is not None
    assert cfg.gemma3n.source_layers == (0, 1, 2, 4, 5, 7)
    assert cfg.gemma3n.intermediate_sizes == tuple(SLICE_WIDTHS)
    assert cfg.sliding_layers == (0, 1, 3)
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 2]


def test_slice_logits_and_greedy_match_transformers_sliced_model(
    sliced: tuple[Any, LlamaForCausalLM],
) -> None:
    hf, ours = sliced
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    logits = full_forward(ours, PROMPT, block_size=4, chunk=9)
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    assert our_greedy(ours, PROMPT) == hf_greedy(hf, PROMPT)


def test_the_main_model_slice_is_the_model(
    pair: tuple[Any, LlamaForCausalLM], tiny: tuple[Path, Any], table: Path
) -> None:
    whole = matformer_slice(table, "Main model")
    ours, _ = load_safetensors_model(tiny[0], torch.float32, progress=False, matformer=whole)
    got = full_forward(ours, PROMPT[:30], block_size=4)
    assert torch.equal(got, full_forward(pair[1], PROMPT[:30], block_size=4))


@pytest.mark.parametrize(
    ("csv_text", "name", "message"),
    [
        (MATFORMER_CSV, "E9B", r"'E9B' is not in .*'Main model', 'Config for tiny E0.5'"),
        ("a,b\n1,2\n", "x", "not a MatFormer config CSV"),
        (MATFORMER_CSV.replace("16 * 3", "16 * x"), SLICE_NAME, "'16 \\* x' is not a number"),
    ],
)
def test_bad_tables_and_names_are_refused_clearly(
    tmp_path: Path, csv_text: str, name: str, message: str
) -> None:
    path = tmp_path / "slices.csv"
    path.write_text(csv_text)
    with pytest.raises(ModelConfigError, match=message):
        matformer_slice(path, name)


@pytest.mark.parametrize(
    ("dims", "skipped", "message"),
    [
        ((96,) * 6, (2, 3), "skips layers \\[2\\], whose keys and values later layers share"),
        ((96,) * 5, (3, 6), "gives 5 FFN widths for the 6 layers it keeps"),
        ((96, 256, 96, 96, 96, 96), (3, 6), "layer 1's MLP is 128 wide"),
        ((96,) * 7, (9,), "skips layers \\[9\\]; the model has 8"),
    ],
)
def test_slices_the_checkpoint_cannot_take_are_refused(
    tiny: tuple[Path, Any], dims: tuple[int, ...], skipped: tuple[int, ...], message: str
) -> None:
    cut = MatformerSlice("bad", dims, skipped)
    with pytest.raises(ModelConfigError, match=message):
        load_safetensors_model(tiny[0], torch.float32, progress=False, matformer=cut)


def test_a_slice_of_another_architecture_is_refused(tmp_path: Path, table: Path) -> None:
    from tests.models.tiny import save_tiny

    save_tiny("llama", tmp_path)
    cut = matformer_slice(table, SLICE_NAME)
    with pytest.raises(ModelConfigError, match="apply to Gemma 3n checkpoints"):
        load_safetensors_model(tmp_path, torch.float32, progress=False, matformer=cut)
