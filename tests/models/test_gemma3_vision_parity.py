"""Our Gemma 3 vision model against transformers on the tiny random checkpoint: the image
processor bit for bit, the prompt's ids and image ranges, the encoder's rows, and the logits of
every position (f32) for text alone, one image and two images (the second crossing a prefill
tile), through the paged-attention path with each image's tokens attending both ways."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from inferd.loading.hf_model import load_safetensors_model, load_tokenizer
from inferd.loading.hf_processor import read_image_config
from inferd.models.gemma import Gemma3ForCausalLM
from inferd.models.gemma3_image import Gemma3ImageConfig
from inferd.models.gemma3_vision import Gemma3VisionForCausalLM
from inferd.serving.multimodal import ImagePrompter, image_digest
from tests.models.paged import image_embeddings, paged_logits
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_gemma3v import IMAGE_SIZE, MM_TOKENS

Spans = tuple[tuple[int, int], ...]


@pytest.fixture(scope="module")
def ours(tiny_gemma3v: tuple[Path, Any, Any]) -> Gemma3VisionForCausalLM:
    model, cfg = load_safetensors_model(tiny_gemma3v[0], torch.float32, progress=False)
    assert isinstance(model, Gemma3VisionForCausalLM)
    assert cfg.architecture == "gemma3" and cfg.vision is not None and cfg.vision.bidirectional
    assert cfg.sliding_layers == (0,) and cfg.rope_local_theta == 1000.0
    return model


@pytest.fixture(scope="module")
def prompter(tiny_gemma3v: tuple[Path, Any, Any], ours: Gemma3VisionForCausalLM) -> ImagePrompter:
    directory = tiny_gemma3v[0]
    config = read_image_config(directory, ours.config)
    assert isinstance(config, Gemma3ImageConfig)
    assert (config.height, config.width, config.image_seq_len) == (IMAGE_SIZE, IMAGE_SIZE, 16)
    return ImagePrompter(config, load_tokenizer(directory, ours.config), ours.image_token_id)


CASES = {
    "text only": ("The quick brown fox jumps over the lazy dog.", []),
    "one image": (
        "<start_of_turn>user\nHi <start_of_image>What is in this picture?<end_of_turn>\n",
        [(70, 50)],
    ),
    "two images": (
        "Compare <start_of_image> with the next one, the lighthouse keeper:<start_of_image> "
        "please: which fox is quick?",
        [(300, 200), (9, 40)],
    ),
}


def prepare(
    prompter: ImagePrompter, text: str, images: list[Image.Image]
) -> tuple[list[int], list[torch.Tensor], Spans]:
    ids, media = prompter.prepare(text, [(i, image_digest(i)) for i in images])
    spans = tuple((m.positions[0], m.positions[-1] + 1) for m in media)
    return ids, [m.encoder_input() for m in media], spans


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(
    case: str,
    ours: Gemma3VisionForCausalLM,
    prompter: ImagePrompter,
    tiny_gemma3v: tuple[Path, Any, Any],
) -> None:
    _, hf, processor = tiny_gemma3v
    text, sizes = CASES[case]
    images = [generated(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    ref_inputs = processor(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.inference_mode():
        ref = hf(**ref_inputs).logits[0]
    ids, pixels, spans = prepare(prompter, text, images)
    assert ids == ref_inputs["input_ids"][0].tolist()
    image_rows = [p for a, b in spans for p in range(a, b)]
    types = ref_inputs.get("token_type_ids")
    assert image_rows == (types[0].nonzero().flatten().tolist() if types is not None else [])
    if images:
        torch.testing.assert_close(torch.cat(pixels), ref_inputs["pixel_values"], atol=0, rtol=0)
    embeds = image_embeddings(ours, ids, pixels)
    logits = paged_logits(ours, ids, embeds, dense=True, spans=spans)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
    if case == "two images":  # the second image's tokens straddle a 64-position prefill tile
        assert spans[1][0] < 64 < spans[1][1]
    if images:  # the image and its two-way attention both reach the logits
        other = image_embeddings(ours, ids, [p.flip(-1) for p in pixels])
        assert (paged_logits(ours, ids, other, dense=True, spans=spans) - logits).abs().max() > 1e-2
        assert (paged_logits(ours, ids, embeds, dense=True) - ref).abs().max() > 1e-3


def test_encoder_matches_transformers(
    ours: Gemma3VisionForCausalLM, prompter: ImagePrompter, tiny_gemma3v: Any
) -> None:
    hf = tiny_gemma3v[1]
    _, pixels, _ = prepare(prompter, "<start_of_image>", [generated(300, 200)])
    with torch.inference_mode():
        ref = hf.model.get_image_features(pixels[0]).pooler_output[0]
        mine = ours.encode_images(pixels[0])
    assert mine.shape == (MM_TOKENS, ours.config.hidden_size)
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)


def test_chunks_around_an_image_and_a_prefix_hit_inside_it(
    ours: Gemma3VisionForCausalLM, prompter: ImagePrompter
) -> None:
    """Chunks that end at an image's edges give the whole prompt's logits; so does resuming
    from keys already cached up to the middle of an image (a prefix-cache hit there)."""
    text, sizes = CASES["two images"]
    ids, pixels, spans = prepare(prompter, text, [generated(h, w) for h, w in sizes])
    embeds = image_embeddings(ours, ids, pixels)
    whole = paged_logits(ours, ids, embeds, dense=True, spans=spans)
    edges = tuple(sorted({p for span in spans for p in span}))
    chunked = paged_logits(ours, ids, embeds, dense=True, spans=spans, cuts=(3, *edges))
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    cfg, bs = ours.config, 16
    shape = (-(-len(ids) // bs) + 1, bs, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    paged_logits(ours, ids, embeds, dense=True, spans=spans, caches=caches)
    middle = spans[1][0] + 5
    resumed = paged_logits(ours, ids, embeds, dense=True, spans=spans, caches=caches, first=middle)
    torch.testing.assert_close(resumed, whole[middle:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
@pytest.mark.parametrize("size", [(5, 7), (64, 64), (70, 50), (31, 400), (900, 12), (1, 1)])
def test_pixels_match_the_processor(
    mode: str, size: tuple[int, int], prompter: ImagePrompter, tiny_gemma3v: Any
) -> None:
    image = generated(*size, mode=mode, seed=size[0])
    ref = tiny_gemma3v[2].image_processor(image, return_tensors="pt")["pixel_values"]
    _, pixels, _ = prepare(prompter, "<start_of_image>", [image])
    assert pixels[0].dtype == ref.dtype
    torch.testing.assert_close(pixels[0], ref, atol=0, rtol=0)


def test_a_literal_marker_in_user_text_stays_text(prompter: ImagePrompter) -> None:
    text = "say <start_of_image> now: <start_of_image>"
    ids, media = prompter.prepare(
        text, [(generated(8, 8), "d")], literal_spans=[(4, 4 + len("<start_of_image>"))]
    )
    assert len(media) == 1 and len(media[0].positions) == MM_TOKENS
    boi = prompter.tokenizer.encode("<start_of_image>")
    assert ids.count(boi[0]) == 1  # the literal one is spelled out as plain text


def test_the_published_tensor_names_load_alike(
    ours: Gemma3VisionForCausalLM, tiny_gemma3v: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    """Published checkpoints keep the encoder under ``vision_tower.vision_model.`` (transformers
    v5 saves it as ``vision_tower.``): the same weights either way."""
    from safetensors.torch import load_file, save_file

    directory = tiny_gemma3v[0]
    for name in directory.iterdir():
        if name.suffix != ".safetensors":
            (tmp_path / name.name).write_bytes(name.read_bytes())
    saved = load_file(directory / "model.safetensors")
    published = {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in saved.items()
    }
    assert any(k.startswith("vision_tower.vision_model.encoder.") for k in published)
    save_file(published, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_safetensors_model(tmp_path, torch.float32, progress=False)
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(theirs[name], p), name


def test_gemma3_text_checkpoint_matches_transformers(
    tiny_gemma3v: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    """The text model alone (Gemma3ForCausalLM, model_type gemma3_text), its head tied."""
    from transformers import Gemma3ForCausalLM as HFGemma3

    from tests.models.tiny import randomize

    text = copy.deepcopy(tiny_gemma3v[1].config.text_config)
    text.tie_word_embeddings = True  # as the real ones (the tiny vision model is untied)
    hf = HFGemma3(text).float()
    randomize(hf, 3)
    hf.save_pretrained(str(tmp_path))
    model, cfg = load_safetensors_model(tmp_path, torch.float32, progress=False)
    assert (
        type(model) is Gemma3ForCausalLM
        and cfg.vision is None
        and cfg.rope_local_theta == 1000.0
        and cfg.tie_word_embeddings
    )
    ids = list(range(10, 60))  # longer than the window of 6
    with torch.inference_mode():
        ref = hf.eval()(torch.tensor([ids])).logits[0]
        embeds = model.embed(torch.tensor(ids))
    logits = paged_logits(model, ids, embeds, dense=True)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def gemma3_tokenizers(gemma3_gguf: Path) -> tuple[Any, Any]:
    """Ours and transformers' reading of Gemma 3's tokenizer (the 270M GGUF's)."""
    from transformers import AutoTokenizer

    from inferd.loading.gguf import GGUFFile
    from inferd.loading.tokenizer import tokenizer_from_gguf

    ours = tokenizer_from_gguf(GGUFFile(gemma3_gguf).metadata)
    return ours, AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)


@pytest.mark.parametrize(
    "text",
    [
        "<bos><start_of_turn>user\n<start_of_image>Describe this.<end_of_turn>\n",
        "Look:\n<start_of_image>\n\nand then <start_of_image> again\n",
    ],
)
def test_the_blank_lines_merge_with_their_neighbours_in_gemma3s_tokenizer(
    gemma3_tokenizers: tuple[Any, Any], text: str
) -> None:
    """Gemma 3's own tokenizer (the 270M GGUF's: it has the image markers, though not the soft
    token, so no soft tokens here) has tokens for runs of newlines: the processor's blank lines
    must be tokenized with the template's text around them, as transformers does when it
    tokenizes the expanded prompt whole."""
    tokenizer, reference = gemma3_tokenizers
    config = Gemma3ImageConfig(IMAGE_SIZE, IMAGE_SIZE, image_seq_len=0)
    prompter = ImagePrompter(config, tokenizer, image_token_id=262_144)
    images = [(generated(8, 8), "d")] * text.count("<start_of_image>")
    ids, _ = prompter.prepare(text, images, add_special=False)
    expanded = text.replace("<start_of_image>", "\n\n<start_of_image><end_of_image>\n\n")
    assert ids == reference(expanded, add_special_tokens=False)["input_ids"]
    newlines = {reference.convert_tokens_to_ids(n) for n in ("\n\n\n", "\n\n\n\n")}
    assert newlines & set(ids)  # the merged runs really occur


def test_what_we_cannot_run_is_refused_on_load(tiny_gemma3v: tuple[Path, Any, Any]) -> None:
    import json

    from inferd.models.config import ModelConfigError, config_from_hf
    from inferd.models.idefics3_image import ImageConfigError

    hf = json.loads((tiny_gemma3v[0] / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="outside"):
        config_from_hf({**hf, "image_token_index": 10_000})
    with pytest.raises(ModelConfigError, match="mm_tokens_per_image"):
        config_from_hf({**hf, "mm_tokens_per_image": 15})
    settings = {"size": {"height": 64, "width": 64}, "do_pan_and_scan": True}
    with pytest.raises(ImageConfigError, match="pan-and-scan"):
        Gemma3ImageConfig.from_hf(settings, MM_TOKENS)
