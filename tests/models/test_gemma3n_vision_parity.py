"""Gemma 3n's image encoder (models/gemma3n_vision.py, MobileNet-v5) against the oracle fixture
of tests/models/gemma3n_vision_reference.py: transformers' Gemma3nForConditionalGeneration over
timm's ``mobilenetv5_300m_enc`` (every block of it, at a fraction of its channels), run in a
venv of its own because timm needs torchvision.

The checkpoint's vision tower loads under timm's names (at full width too, by shape); the
encoder's fused features and ``embed_vision``'s soft tokens equal transformers'; our
preprocessing gives the processor's pixel values bit for bit; a chat with the image gives the
processor's ids (a blank line, ``<start_of_image>``, the soft tokens, ``<end_of_image>``, a
blank line) and the model's float32 logits, alone and beside an audio clip; the engine admits
only images the encoder fills; a checkpoint without the tower's weights serves text and audio
only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.hf_processor import read_image_config
from inferd.models.gemma3_image import Gemma3ImageConfig
from inferd.models.gemma3n_multimodal import Gemma3nMultimodalForCausalLM
from inferd.serving.served import ServedModel, load_model
from tests.models.paged import paged_logits

FIXTURE = Path(__file__).parent / "data" / "gemma3n_vision"
ROW_TOLERANCE = 1e-4
LOGIT_TOLERANCE = 1e-3  # float32 on both sides over 100 tokens: only summation order differs


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return torch.load(FIXTURE / "reference.pt")


@pytest.fixture(scope="module")
def ours() -> Gemma3nMultimodalForCausalLM:
    model, _ = load_safetensors_model(FIXTURE, torch.float32, progress=False)
    assert isinstance(model, Gemma3nMultimodalForCausalLM)
    return model


@pytest.fixture(scope="module")
def served() -> Any:
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=512, max_model_len=512)
    model = load_model(FIXTURE, cfg, progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


def test_encoder_features_match_timm(
    ours: Gemma3nMultimodalForCausalLM, reference: dict[str, Any]
) -> None:
    expected = reference["vision_output"]  # [2048, 8, 8]
    with torch.inference_mode():
        features = ours.vision_tower.timm_model(reference["pixel_values"][None])[0]
    assert features.shape == expected.shape
    assert (features - expected).abs().max() < ROW_TOLERANCE * expected.abs().max()


def test_the_full_width_encoder_has_timm_s_parameters(reference: dict[str, Any]) -> None:
    """At the published checkpoints' width (no model_args) every parameter of timm's
    ``mobilenetv5_300m_enc`` (294M) is ours, by name and shape: the blocks beyond the fixture's
    scaled-down widths (rounded channels, expansions, heads) are right too."""
    from inferd.models.config import config_from_hf
    from inferd.models.gemma3n_vision import Gemma3nVisionTower

    hf = json.loads((FIXTURE / "config.json").read_text())
    del hf["vision_config"]["model_args"]
    hf["vision_soft_tokens_per_image"] = 256
    vision = config_from_hf(hf).gemma3n_vision
    assert vision is not None
    with torch.device("meta"):
        encoder = Gemma3nVisionTower(vision).timm_model
    shapes = {name: list(p.shape) for name, p in encoder.named_parameters()}
    assert shapes == reference["full_size_shapes"]


def test_soft_tokens_match_embed_vision(
    ours: Gemma3nMultimodalForCausalLM, reference: dict[str, Any]
) -> None:
    expected = reference["soft_tokens"]  # [64, text hidden]
    with torch.inference_mode():
        rows = ours.encode_images(reference["pixel_values"][None])
    assert rows.shape == expected.shape
    assert (rows - expected).abs().max() < ROW_TOLERANCE


def test_pixel_values_are_bit_equal(
    ours: Gemma3nMultimodalForCausalLM, reference: dict[str, Any]
) -> None:
    config = read_image_config(FIXTURE, ours.config)
    assert isinstance(config, Gemma3ImageConfig)
    assert (config.height, config.image_seq_len, config.do_normalize) == (256, 64, False)
    prepared = config.prepare(Image.open(FIXTURE / "image.png"))
    assert torch.equal(prepared.pixel_values[0], reference["pixel_values"])


def test_the_saved_processor_here_is_the_oracle_s(reference: dict[str, Any]) -> None:
    """transformers' processor read back from the fixture in this venv (Pillow's backend, as
    the oracle's: with torchvision, AutoProcessor picks a resize that differs by 1/255) makes
    the fixture's ids and pixel values."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(FIXTURE))
    image = Image.open(FIXTURE / "image.png")
    inputs = processor(text=reference["prompt_text"], images=[image], return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == reference["input_ids"]
    assert torch.equal(inputs["pixel_values"][0], reference["pixel_values"])


def _image_prompt(served: ServedModel, reference: dict[str, Any]) -> tuple[list[int], Any]:
    image = Image.open(FIXTURE / "image.png").convert("RGB")
    ids, media = served.prompt(reference["prompt_text"], [(image, "picture")])
    return ids, media


def test_image_prompt_ids_and_logits_match_transformers(
    served: ServedModel, ours: Gemma3nMultimodalForCausalLM, reference: dict[str, Any]
) -> None:
    ids, media = _image_prompt(served, reference)
    assert ids == reference["input_ids"]
    assert served.modalities["input"] == ["text", "image", "audio"]
    model, vision = ours, ours.config.gemma3n_vision
    assert vision is not None
    (image,) = media
    image_id = vision.image_token_id
    assert [ids[p] for p in image.positions] == [image_id] * 64
    with torch.inference_mode():
        embeds = model.embed(torch.tensor(ids))
        embeds[list(image.positions)] = model.encode_images(image.encoder_input())
    logits = paged_logits(model, ids, embeds)
    expected = reference["logits"]
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_an_image_and_a_clip_in_one_prompt_match_transformers(
    served: ServedModel, ours: Gemma3nMultimodalForCausalLM, reference: dict[str, Any]
) -> None:
    """Both encoders in one prompt, as written: the processor's ids (each between blank lines)
    and the model's logits."""
    from inferd.media.types import DecodedAudio

    mixed = reference["mixed"]
    image = Image.open(FIXTURE / "image.png").convert("RGB")
    clip = DecodedAudio(mixed["audio"].numpy()[None], 16_000, "clip", "WAV")
    ids, media = served.prompt(mixed["prompt_text"], [(image, "picture"), clip])
    assert ids == mixed["input_ids"]
    picture, sound = media
    assert (picture.modality, sound.modality) == ("image", "audio")
    assert picture.positions[-1] < sound.positions[0]
    with torch.inference_mode():
        embeds = ours.embed(torch.tensor(ids))
        embeds[list(picture.positions)] = ours.encode_images(picture.encoder_input())
        embeds[list(sound.positions)] = ours.encode_clip(sound.encoder_input())
    logits = paged_logits(ours, ids, embeds)
    expected = mixed["logits"]
    assert (logits - expected).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


def test_the_engine_admits_only_images_the_encoder_fills(
    served: ServedModel, reference: dict[str, Any]
) -> None:
    """An image is one RGB tile (at least the encoder's 32-pixel stride) on exactly the
    model's image tokens."""
    from inferd.engine.llm_engine import AdmissionError
    from inferd.engine.request import MediaInput
    from inferd.engine.sampling import SamplingParams

    ids, (m,) = _image_prompt(served, reference)
    engine = served.engine.engine
    engine.check_media(ids, [m])
    wrong = [
        (torch.zeros(1, 3, 16, 16), m.positions, "one RGB tile"),
        (torch.zeros(2, 3, 256, 256), m.positions, "one RGB tile"),
        (m.encoder_input(), m.positions[1:], "fills 64 placeholder tokens"),
    ]
    for pixels, positions, message in wrong:
        bad = MediaInput(m.digest, positions, pixels)
        with pytest.raises(AdmissionError, match=message):
            engine.add_request("bad", ids, SamplingParams(max_tokens=1), media=[bad])


def test_only_the_channel_multiplier_and_resolution_may_change_the_network() -> None:
    from inferd.models.config import ModelConfigError, config_from_hf

    hf = json.loads((FIXTURE / "config.json").read_text())
    assert config_from_hf(hf).gemma3n_vision is not None
    hf["vision_config"]["model_args"]["stem_size"] = 32
    with pytest.raises(ModelConfigError, match="stem_size"):
        config_from_hf(hf)
    hf["vision_config"]["architecture"] = "mobilenetv5_base"  # another network: not served
    cfg = config_from_hf(hf)
    assert cfg.gemma3n_vision is None and cfg.gemma3n is not None
    assert cfg.gemma3n.unserved_media == ("image",)


def test_a_checkpoint_without_the_tower_serves_no_images(tmp_path: Path) -> None:
    """transformers writes a MobileNet vision_config even where the weights hold no tower
    (the audio tests' checkpoint): such a directory loads without the image encoder."""
    from safetensors.torch import load_file, save_file

    for f in FIXTURE.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(FIXTURE / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if "vision_tower" not in k},
        tmp_path / "model.safetensors",
    )
    model, cfg = load_safetensors_model(tmp_path, torch.float32, progress=False)
    assert cfg.gemma3n_vision is None and cfg.gemma3n is not None
    assert cfg.gemma3n.unserved_media == ("image",)
    assert not hasattr(model, "vision_tower")
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]
