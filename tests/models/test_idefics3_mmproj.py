"""The tiny random Idefics3 (SmolVLM) as llama.cpp ships it: a language model GGUF plus a
multimodal projector GGUF (``--mmproj``), both written here with ``gguf``'s writer. Loaded
together they give transformers' logits (f32, 1e-4) for text, one image and two images, the
image settings come from the projector's metadata, the engine's greedy output equals the Hugging
Face directory's, and a projector that does not fit the language model is refused up front."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.loading.gguf import GGUFError
from inferd.loading.hf_processor import read_image_config
from inferd.loading.mmproj import ProjectorError
from inferd.loading.model import LoadedModel, load
from inferd.models.idefics3 import Idefics3ForCausalLM
from inferd.models.idefics3_image import prepare_image
from inferd.serving.multimodal import split_image_parts
from inferd.serving.served import ServedModel, load_model
from tests.models.paged import image_embeddings, paged_logits
from tests.models.test_idefics3_parity import CASES, expand
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_mmproj import write_language_model, write_mmproj, write_smolvlm_ggufs
from tests.models.tiny_vlm import vlm_tokenizer


@pytest.fixture(scope="module")
def ggufs(
    tiny_idefics3: tuple[Path, Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    _, hf, processor = tiny_idefics3
    return write_smolvlm_ggufs(hf, processor.image_processor, tmp_path_factory.mktemp("mmproj"))


@pytest.fixture(scope="module")
def loaded(ggufs: tuple[Path, Path]) -> LoadedModel:
    lm, proj = ggufs
    return load(lm, dtype="f32", mmproj=proj, progress=False)


def test_the_projector_gives_the_encoder_and_the_image_settings(
    loaded: LoadedModel, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    assert isinstance(loaded.model, Idefics3ForCausalLM)
    hf_dir = tiny_idefics3[0]
    from_hf = load(hf_dir, dtype="f32", progress=False)
    assert loaded.image_config == from_hf.image_config == read_image_config(hf_dir, from_hf.config)
    assert loaded.config.vision is not None and from_hf.config.vision is not None
    assert loaded.config.vision.image_token_id == from_hf.config.vision.image_token_id
    assert loaded.config.architecture == "llama"  # the decoder is the GGUF's, as it says
    alone = load(loaded.source.path, dtype="f32", progress=False)  # no --mmproj: text only
    assert alone.image_config is None and alone.config.vision is None
    assert not isinstance(alone.model, Idefics3ForCausalLM)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(
    case: str, loaded: LoadedModel, tiny_idefics3: tuple[Path, Any, Any]
) -> None:
    _, hf, processor = tiny_idefics3
    model = loaded.model
    assert isinstance(model, Idefics3ForCausalLM) and loaded.image_config is not None
    text, sizes = CASES[case]
    images = [generated(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    ref_inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        ref = hf(**ref_inputs).logits[0]
    expanded, prepared = expand(text, images, loaded.image_config)
    ids = loaded.tokenizer.encode(expanded)  # the GGUF's own tokenizer
    assert ids == ref_inputs["input_ids"][0].tolist()
    pixels = [p.pixel_values for p in prepared]
    assert not pixels or torch.equal(torch.cat(pixels), ref_inputs["pixel_values"][0])
    logits = paged_logits(model, ids, image_embeddings(model, ids, pixels))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    if images:  # the projector's encoder really reaches the logits
        other = image_embeddings(model, ids, [p.flip(-1) for p in pixels])
        assert (paged_logits(model, ids, other) - logits).abs().max() > 1e-2


def test_an_f16_projector_loads_close_to_f32(
    loaded: LoadedModel, tiny_idefics3: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    _, hf, processor = tiny_idefics3
    write_mmproj(hf, processor.image_processor, tmp_path / "f16.gguf", f16=True)
    half = load(loaded.source.path, dtype="f32", mmproj=tmp_path / "f16.gguf", progress=False)
    assert isinstance(half.model, Idefics3ForCausalLM)
    assert isinstance(loaded.model, Idefics3ForCausalLM) and loaded.image_config is not None
    pixels = prepare_image(generated(80, 60), loaded.image_config).pixel_values
    with torch.inference_mode():
        exact, rounded = loaded.model.encode_images(pixels), half.model.encode_images(pixels)
    assert 0 < (exact - rounded).abs().max() < 1e-2


def test_a_projector_without_preproc_size_takes_one_tile(
    ggufs: tuple[Path, Path], tiny_idefics3: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    """An older converter's file: no longest edge, so (as llama.cpp then did) no split."""
    _, hf, processor = tiny_idefics3
    write_mmproj(hf, processor.image_processor, tmp_path / "old.gguf", longest_edge=False)
    old = load(ggufs[0], dtype="f32", mmproj=tmp_path / "old.gguf", progress=False)
    assert old.image_config is not None and not old.image_config.splitting
    prepared = prepare_image(generated(300, 200), old.image_config)
    assert prepared.num_tiles == 1 and prepared.tiles.shape[-2:] == (32, 32)


def test_mismatched_projectors_are_refused_before_loading(
    ggufs: tuple[Path, Path],
    tiny_idefics3: tuple[Path, Any, Any],
    tiny_llama_gguf: Path,
    tmp_path: Path,
) -> None:
    hf_dir, hf, processor = tiny_idefics3
    lm, proj = ggufs
    gemma = tmp_path / "gemma3.gguf"
    write_mmproj(hf, processor.image_processor, gemma, projector_type="gemma3")
    narrow = tmp_path / "narrow.gguf"
    write_mmproj(hf, processor.image_processor, narrow, connector_width=32)
    spec = json.loads(vlm_tokenizer().to_str())
    for token in spec["added_tokens"]:  # <image> typed as a normal token: the BPE splits it
        token["special"] = token["special"] and token["content"] != "<image>"
    split_image = tmp_path / "split-image.gguf"
    write_language_model(hf, split_image, Tokenizer.from_str(json.dumps(spec)))
    renamed = json.loads(vlm_tokenizer().to_str().replace("<row_3_col_2>", "<row_3_col_b>"))
    no_mark = tmp_path / "no-mark.gguf"  # a 3x3 split needs <row_3_col_2>
    write_language_model(hf, no_mark, Tokenizer.from_str(json.dumps(renamed)))
    wide_mlp = tmp_path / "wide-mlp.gguf"
    write_mmproj(hf, processor.image_processor, wide_mlp, feed_forward_length=96)
    cases: list[tuple[Path, Path, str]] = [
        (lm, gemma, "projector type 'gemma3' is not supported"),
        (lm, narrow, "gives 32-wide embeddings .* language model is 64 wide"),
        (lm, wide_mlp, r"tensor v.blk.0.ffn_up.weight has shape \(80, 48\), .* says \(96, 48\)"),
        (lm, lm, "is not a multimodal projector .*'llama'"),
        (tiny_llama_gguf, proj, "tokenizer has no <image>"),
        (split_image, proj, "has <image> as a normal token"),
        (no_mark, proj, "split into up to 3x3 tiles, .* has no <row_3_col_2> token"),
        (hf_dir, proj, "--mmproj goes with a GGUF language model"),
    ]
    for model, projector, message in cases:
        with pytest.raises(ProjectorError, match=message):
            load(model, dtype="f32", mmproj=projector, progress=False)
    with pytest.raises(GGUFError, match="GGUF file not found"):
        load(lm, dtype="f32", mmproj=tmp_path / "missing.gguf", progress=False)


@pytest.fixture(scope="module")
def engines(
    ggufs: tuple[Path, Path], tiny_idefics3: tuple[Path, Any, Any]
) -> Iterator[tuple[ServedModel, ServedModel]]:
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=1024, max_model_len=512)
    from_gguf = load_model(ggufs[0], cfg, progress=False, loop=CallerLoop(), mmproj=ggufs[1])
    from_hf = load_model(tiny_idefics3[0], cfg, progress=False, loop=CallerLoop())
    yield from_gguf, from_hf
    from_gguf.shutdown()
    from_hf.shutdown()


def greedy(served: ServedModel, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    parts, images = split_image_parts(messages)
    ids, media = served.chat_prompt(parts, images)
    engine = served.engine.engine
    engine.add_request(
        f"g{len(ids)}", ids, SamplingParams(max_tokens=8, temperature=0), media=media
    )
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    return ids, tokens


def test_engine_greedy_equals_the_hf_directory(
    engines: tuple[ServedModel, ServedModel],
) -> None:
    from_gguf, from_hf = engines
    assert from_gguf.modalities["input"] == ["text", "image"]
    fox, cat = generated(300, 200, seed=7), generated(40, 70, seed=8)
    parts = [
        {"type": "image", "image": fox},
        {"type": "text", "text": "and"},
        {"type": "image", "image": cat},
        {"type": "text", "text": "Which is quick?"},
    ]
    for content in (parts[:1] + parts[3:], parts, [{"type": "text", "text": "Hello fox"}]):
        messages = [{"role": "user", "content": content}]
        ids, tokens = greedy(from_gguf, messages)
        assert (ids, tokens) == greedy(from_hf, messages)
        assert len(tokens) == 8


def test_llm_takes_the_projector(
    ggufs: tuple[Path, Path], engines: tuple[ServedModel, ServedModel]
) -> None:
    from inferd.llm import LLM

    image = generated(70, 50, seed=9)
    content = [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]
    messages = [{"role": "user", "content": content}]
    ids, tokens = greedy(engines[1], messages)  # the Hugging Face directory's engine
    with LLM(ggufs[0], mmproj=ggufs[1], dtype="f32") as llm:
        [out] = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens
