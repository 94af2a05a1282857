"""Our Idefics3 (SmolVLM) against transformers on the tiny random checkpoint: the encoder's
embeddings and the logits of every position, for one image, two images and text alone (f32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.loading.hf_model import load_safetensors_model
from inferd.models.idefics3 import Idefics3ForCausalLM
from inferd.models.idefics3_image import Idefics3ImageConfig, prepare_image
from tests.models.paged import image_embeddings, paged_logits
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_vlm import IMAGE_SEQ_LEN


@pytest.fixture(scope="module")
def ours(tiny_idefics3: tuple[Path, Any, Any]) -> Idefics3ForCausalLM:
    model, cfg = load_safetensors_model(tiny_idefics3[0], torch.float32, progress=False)
    assert isinstance(model, Idefics3ForCausalLM)
    assert cfg.architecture == "idefics3" and cfg.vision is not None
    return model


@pytest.fixture(scope="module")
def image_config(tiny_idefics3: tuple[Path, Any, Any]) -> Idefics3ImageConfig:
    return Idefics3ImageConfig.from_hf(tiny_idefics3[2].image_processor.to_dict(), IMAGE_SEQ_LEN)


def expand(text: str, images: list[Any], cfg: Idefics3ImageConfig) -> tuple[str, list[Any]]:
    prepared = [prepare_image(i, cfg) for i in images]
    pieces = text.split("<image>")
    expanded = pieces[0] + "".join(
        p.prompt_text() + rest for p, rest in zip(prepared, pieces[1:], strict=True)
    )
    return expanded, prepared


CASES = {
    "one image": ("<|im_start|>user\n<image>What is in this picture?", [(70, 50)]),
    "two images": (
        "Compare <image> with<image> please: which fox is quick?",
        [(300, 200), (9, 40)],
    ),
    "text only": ("The quick brown fox jumps over the lazy dog.", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(
    case: str,
    ours: Idefics3ForCausalLM,
    image_config: Idefics3ImageConfig,
    tiny_idefics3: tuple[Path, Any, Any],
) -> None:
    _, hf, processor = tiny_idefics3
    text, sizes = CASES[case]
    images = [generated(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    ref_inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        ref = hf(**ref_inputs).logits[0]
    expanded, prepared = expand(text, images, image_config)
    ids = processor.tokenizer(expanded)["input_ids"]
    assert ids == ref_inputs["input_ids"][0].tolist()
    embeds = image_embeddings(ours, ids, [p.pixel_values for p in prepared])
    logits = paged_logits(ours, ids, embeds)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    if images:  # the image really reaches the logits: another image changes them
        other = image_embeddings(ours, ids, [p.pixel_values.flip(-1) for p in prepared])
        assert (paged_logits(ours, ids, other) - logits).abs().max() > 1e-2


def test_encoder_matches_transformers(
    ours: Idefics3ForCausalLM, image_config: Idefics3ImageConfig, tiny_idefics3: Any
) -> None:
    hf = tiny_idefics3[1]
    pixels = prepare_image(generated(300, 200), image_config).pixel_values
    with torch.inference_mode():
        ref = hf.model.get_image_features(pixels[None]).pooler_output[0]
        mine = ours.encode_images(pixels)
    assert mine.shape == (pixels.shape[0] * IMAGE_SEQ_LEN, ours.config.hidden_size)
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


def test_chunked_prefill_splits_an_image_anywhere(
    ours: Idefics3ForCausalLM, image_config: Idefics3ImageConfig, tiny_idefics3: Any
) -> None:
    text, sizes = CASES["one image"]
    expanded, prepared = expand(text, [generated(*sizes[0])], image_config)
    ids = tiny_idefics3[2].tokenizer(expanded)["input_ids"]
    embeds = image_embeddings(ours, ids, [prepared[0].pixel_values])
    whole = paged_logits(ours, ids, embeds)
    # 7: chunks end mid-image
    chunked = paged_logits(ours, ids, embeds, cuts=range(7, len(ids), 7))
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


def test_smolvlm_logits_match_transformers(tmp_path: Path) -> None:
    """SmolVLM2's model type: the same model, read from the published layout (its image
    settings in preprocessor_config.json), against transformers' SmolVLM."""
    from inferd.loading.hf_processor import read_image_config
    from tests.models.tiny_vlm import save_tiny_smolvlm

    hf, tokenizer, image_processor = save_tiny_smolvlm(tmp_path)
    model, cfg = load_safetensors_model(tmp_path, torch.float32, progress=False)
    assert isinstance(model, Idefics3ForCausalLM) and cfg.architecture == "smolvlm"
    image_config = read_image_config(tmp_path, cfg)
    assert image_config is not None and image_config.longest_edge == 96
    images = [generated(300, 200, seed=5), generated(40, 30, seed=6)]
    expanded, prepared = expand("Two: <image> and <image>. Which?", images, image_config)
    ids = tokenizer(expanded)["input_ids"]
    pixels = image_processor([images], return_tensors="pt")
    assert torch.equal(pixels["pixel_values"][0], torch.cat([p.pixel_values for p in prepared]))
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids]), **pixels).logits[0]
    embeds = image_embeddings(model, ids, [p.pixel_values for p in prepared])
    ours = paged_logits(model, ids, embeds)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
