"""Write the Gemma 3n image-encoder oracle fixture: a tiny random Gemma3nForConditionalGeneration
whose vision tower is timm's MobileNet-v5, run by transformers in float32.

transformers builds Gemma 3n's vision tower with timm, and timm imports torchvision, whose PyPI
build does not load beside the project's torch; so this script runs in a venv of its own
(never the project's), and the suite reads only what it writes. From the repository root::

    python3 -m venv /tmp/g3n-oracle-venv
    /tmp/g3n-oracle-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm==1.0.31 \\
        transformers==5.24.0 safetensors pillow
    PYTHONPATH=$PWD /tmp/g3n-oracle-venv/bin/python tests/models/gemma3n_vision_reference.py

It writes ``tests/models/data/gemma3n_vision/`` (a few MB): a Hugging Face directory of the
model (the decoder and audio encoder of tests/models/tiny_gemma3n.py's multimodal model, its
vision tower ``mobilenetv5_300m_enc`` at ``CHANNEL_MULTIPLIER`` of its channels (every block
of the real one, 8 or 16 channels wide) fused to ``RESOLUTION`` squared soft tokens, weights
in bfloat16) with its processor (images resized to ``IMAGE_SIZE``), the test image
``image.png``, and ``reference.pt``: the image's pixel values as the processor makes them, the
vision tower's output, ``embed_vision``'s soft tokens, and for ``PROMPT`` (the image, then
text) the processor's ids, the model's logits at every position and its greedy reply of
``GREEDY_TOKENS`` tokens (ids, text, each token's log-probability); and for ``MIXED_PROMPT``
(the image, an audio clip, text) the clip's samples, the processor's ids and the logits; and
the shape of every parameter of the full-width encoder (294M parameters) by timm's name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.models.tiny_gemma3n import (
    AUDIO_SOFT_TOKENS,
    MEDIA_VOCAB,
    MEDIA_VOCAB_SIZE,
    MEL_BINS,
    TEMPLATE,
    _mm_tokenizer,
    mm_config,
    randomize_gemma3n,
)

FIXTURE = Path(__file__).parent / "data" / "gemma3n_vision"
# Stages of 8, 8, 8 and 16 channels (the stem keeps its 64): round_channels floors at 8.
CHANNEL_MULTIPLIER = 1 / 80
IMAGE_SIZE = 256  # the processor's square; the real one's is 768
RESOLUTION = 8  # MSFA output: the 16 x 16 stage-2 features average-pooled by 2
SOFT_TOKENS = RESOLUTION * RESOLUTION
PROMPT = [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]
# Both encoders in one prompt: the image, a clip, then text.
MIXED_PROMPT = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "And this?"}]
SEED = 7
GREEDY_TOKENS = 8


def test_image() -> Any:
    """A 200 x 120 picture (not square, so the resize stretches it) of gradients and blocks."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:120, 0:200]
    rgb = np.stack([x * 255 // 199, y * 255 // 119, (x * y) % 256], axis=-1).astype(np.uint8)
    rgb[30:70, 40:110] = (250, 20, 30)
    rgb[60:100, 120:180] = (10, 200, 60)
    return Image.fromarray(rgb)


def test_clip() -> Any:
    """0.75 s of a 440 Hz tone with a little noise, at 16 kHz, float32."""
    import numpy as np

    t = np.arange(12_000) / 16_000
    noise = np.random.default_rng(SEED).standard_normal(t.shape)
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.05 * noise).astype(np.float32)


def vision_config() -> dict[str, Any]:
    return {
        "architecture": "mobilenetv5_300m_enc",
        "model_args": {
            "channel_multiplier": CHANNEL_MULTIPLIER,
            "msfa_output_resolution": RESOLUTION,
        },
        "hidden_size": 2048,  # MobileNetV5Encoder's MSFA width, whatever the multiplier
        "vocab_offset": MEDIA_VOCAB["embed_vision"][0],
        "vocab_size": MEDIA_VOCAB_SIZE,
        "rms_norm_eps": 1e-6,
    }


def randomize_vision(tower: torch.nn.Module, seed: int) -> None:
    """The MobileNet's weights random at scales that keep its activations near one: convs by
    their fan-in, norms and layer scales around one (a channel or tensor misplaced shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("gamma"):
                p.copy_(0.7 + 0.2 * noise)
            elif p.ndim == 1 and name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.ndim == 1:  # RMS norms
                p.copy_(1 + 0.3 * noise)
            else:
                fan_in = p[0].numel()
                p.copy_(noise * (1.5 / fan_in**0.5))


def full_size_shapes() -> dict[str, list[int]]:
    """Every parameter's shape in timm's ``mobilenetv5_300m_enc`` at full width (the published
    checkpoints' encoder), built on the meta device."""
    import timm

    with torch.device("meta"):
        encoder = timm.create_model(vision_config()["architecture"])
    return {name: list(p.shape) for name, p in encoder.named_parameters()}


def build(config: Any) -> Any:
    from transformers import Gemma3nForConditionalGeneration

    torch.manual_seed(SEED)
    model = Gemma3nForConditionalGeneration(config).float()
    randomize_gemma3n(model, SEED)
    randomize_vision(model.model.vision_tower, SEED + 1)
    # The checkpoint is bfloat16, as the real ones: the reference runs on exactly its values.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.generation_config.eos_token_id = None  # generate exactly GREEDY_TOKENS
    model.config._attn_implementation = "eager"
    model.config.get_text_config()._attn_implementation = "eager"
    return model.eval()


def greedy(model: Any, inputs: Any, tokenizer: Any) -> dict[str, Any]:
    """transformers' greedy reply of ``GREEDY_TOKENS``: ids, text, each token's log-prob."""
    prompt = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=GREEDY_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, prompt:].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[token])
        for step, token in zip(out.logits, tokens, strict=True)
    ]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return {"ids": tokens, "text": text, "logprobs": logprobs}


def main() -> None:
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nProcessor
    from transformers.models.siglip import SiglipImageProcessorPil

    config = mm_config()
    config.vision_config = type(config.vision_config)(**vision_config())
    config.vision_soft_tokens_per_image = SOFT_TOKENS
    model = build(config)
    processor = Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(feature_size=MEL_BINS),
        # The real Gemma 3n processor's settings, at a smaller square; Pillow's backend, the
        # one transformers picks without torchvision (the project's venv) and inferd follows.
        image_processor=SiglipImageProcessorPil(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, do_normalize=False
        ),
        tokenizer=_mm_tokenizer(),
        chat_template=TEMPLATE,
        audio_seq_length=AUDIO_SOFT_TOKENS,
        image_seq_length=SOFT_TOKENS,
    )
    FIXTURE.mkdir(parents=True, exist_ok=True)
    image = test_image()
    image.save(FIXTURE / "image.png")
    text = processor.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(text=text, images=[image], return_tensors="pt")
    pixels = inputs["pixel_values"]
    with torch.no_grad():
        tower = model.model.vision_tower(pixel_values=pixels, do_pooling=False)
        soft = model.model.get_image_features(pixels).pooler_output
        logits = model(**inputs).logits[0]
    reply = greedy(model, inputs, processor.tokenizer)  # in float32, before the bf16 save
    mixed_text = processor.apply_chat_template(
        [{"role": "user", "content": MIXED_PROMPT}], add_generation_prompt=True, tokenize=False
    )
    clip = test_clip()
    mixed = processor(text=mixed_text, images=[image], audio=[clip], return_tensors="pt")
    with torch.no_grad():
        mixed_logits = model(**mixed).logits[0]
    print("vision", tuple(tower.last_hidden_state.shape), "soft", tuple(soft.shape))
    print("prompt", inputs["input_ids"].shape[1], "tokens; logits", tuple(logits.shape))
    model.to(torch.bfloat16).save_pretrained(str(FIXTURE))
    processor.save_pretrained(str(FIXTURE))
    torch.save(
        {
            "prompt_text": text,
            "input_ids": inputs["input_ids"][0].tolist(),
            "pixel_values": pixels[0],
            "vision_output": tower.last_hidden_state[0],
            "soft_tokens": soft[0],
            "logits": logits,
            "greedy": reply,
            "full_size_shapes": full_size_shapes(),
            "mixed": {
                "prompt_text": mixed_text,
                "input_ids": mixed["input_ids"][0].tolist(),
                "audio": torch.from_numpy(clip),
                "logits": mixed_logits,
            },
        },
        FIXTURE / "reference.pt",
    )
    size = sum(f.stat().st_size for f in FIXTURE.iterdir())
    print(f"wrote {FIXTURE} ({size} bytes)")


if __name__ == "__main__":
    main()
