"""SmolVLM2 video against transformers, on MP4s generated here at odd frame rates and sizes:
the frames kept (SmolVLMVideoProcessor.sample_frames over transformers' PyAV loader), the
frames' pixels, the prompt (SmolVLMProcessor's video text: intro, timestamps, image tokens) and
its token ids; then the logits of the tiny random SmolVLM2 for a video and a video with an
image (f32), and the engine's greedy output against transformers' generate.

transformers' video processor resizes with torchvision, which has no CPU build for this torch
here; the frames' pixels are checked against its PIL image processor with splitting off,
which takes each frame through the same two resizes (long side, then one square tile) and the
same rescale and normalization.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from fractions import Fraction
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import av
import numpy as np
import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.loading.model import LoadedModel, load
from inferd.media.video import decode_video
from inferd.models.idefics3 import Idefics3ForCausalLM
from inferd.models.smolvlm_video import number_words
from inferd.serving.multimodal import ImagePrompter, VideoPrompter, expand_markers
from inferd.serving.served import ServedModel, load_model
from tests.models.paged import image_embeddings, paged_logits
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_vlm import IMAGE_SEQ_LEN, VIDEO_SAMPLING, save_tiny_smolvlm


def mp4(fps: Fraction, frames: int, width: int, height: int, seed: int = 0) -> bytes:
    """An H.264 MP4 (4:4:4, so odd sizes are allowed) of moving noise: every frame differs."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv444p"
        for i in range(frames):
            picture = np.roll(base, 3 * i, axis=1)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


# (frame rate, frames, width, height): NTSC's 29.97 on odd sides, a slow portrait clip, and
# one long enough (15 s) that the sampler skips a second at each end.
CLIPS = {
    "29.97fps 45x31": (Fraction(30000, 1001), 50, 45, 31),
    "7fps 51x91": (Fraction(7), 23, 51, 91),
    "12.5fps 33x21": (Fraction(25, 2), 9, 33, 21),
    "3fps 15s": (Fraction(3), 45, 37, 29),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any, Any]:
    directory = tmp_path_factory.mktemp("tiny-smolvlm2")
    hf, tokenizer, images = save_tiny_smolvlm(directory)
    return directory, hf, tokenizer, images


@pytest.fixture(scope="module")
def loaded(tiny: tuple[Path, Any, Any, Any]) -> LoadedModel:
    return load(tiny[0], dtype="f32", progress=False)


def reference_video(path: Path) -> tuple[np.ndarray, Any]:
    """transformers' frames and metadata: its PyAV loader, sampled by SmolVLM's sampler."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import load_video

    defaults = SimpleNamespace(num_frames=VIDEO_SAMPLING["max_frames"], fps=VIDEO_SAMPLING["fps"])
    sampler = partial(
        SmolVLMVideoProcessor.sample_frames,
        defaults,
        num_frames=VIDEO_SAMPLING["max_frames"],
        fps=VIDEO_SAMPLING["fps"],
    )
    return load_video(str(path), backend="pyav", sample_indices_fn=sampler)


def reference_prompt(frames: int, metadata: Any) -> str:
    """SmolVLMProcessor's text for one video (its replace_video_token)."""
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    processor = SimpleNamespace(
        image_seq_len=IMAGE_SEQ_LEN,
        image_token="<image>",
        fake_image_token="<fake_token_around_image>",
        global_image_token="<global-img>",
    )
    inputs = {"pixel_values": torch.zeros(1, frames), "video_metadata": [metadata]}
    return SmolVLMProcessor.replace_video_token(processor, inputs, 0)  # type: ignore[arg-type]


def reference_pixels(frames: np.ndarray) -> torch.Tensor:
    from PIL import Image
    from transformers import SmolVLMImageProcessorPil

    processor = SmolVLMImageProcessorPil(
        size=VIDEO_SAMPLING["video_size"], max_image_size={"longest_edge": 32}
    )
    pictures = [Image.fromarray(f) for f in frames]
    out = processor([pictures], do_image_splitting=False, return_tensors="pt")
    return out["pixel_values"][0]


def test_the_checkpoint_declares_video(loaded: LoadedModel) -> None:
    video = loaded.video_config
    assert video is not None and loaded.image_config is not None
    assert (video.fps, video.max_frames, video.longest_edge) == (2.0, 6, 48)
    assert video.image.tile == 32


@pytest.mark.parametrize("clip", list(CLIPS))
def test_frames_and_prompt_match_transformers(
    clip: str, tmp_path: Path, loaded: LoadedModel, tiny: tuple[Path, Any, Any, Any]
) -> None:
    fps, count, width, height = CLIPS[clip]
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4(fps, count, width, height))
    ref_frames, metadata = reference_video(path)
    video_config = loaded.video_config
    assert video_config is not None
    ours = decode_video(path.read_bytes(), sampling=video_config)
    assert list(ours.frame_indices) == list(metadata.frames_indices)
    if clip == "3fps 15s":  # the ends are skipped
        assert ours.frame_indices[0] == 3 and ours.frame_indices[-1] < count - 1
    assert np.array_equal(ours.frames, ref_frames)

    prompter = VideoPrompter(video_config, loaded.config.vision.image_token_id)  # type: ignore[union-attr]
    group = prompter.group([ours])
    item = group.items[0]
    expected = reference_prompt(len(ref_frames), metadata)
    assert item.text == expected
    assert number_words(len(ref_frames)) in expected

    text = "<|im_start|>user\n<video>What happens?<|im_end|>\n"
    ids, media = expand_markers(loaded.tokenizer, text, [group])
    assert ids == tiny[2](text.replace("<video>", expected))["input_ids"]
    assert len(media) == 1 and len(media[0].positions) == len(ref_frames) * IMAGE_SEQ_LEN
    assert torch.equal(media[0].encoder_input(), reference_pixels(ref_frames))


def _video_and_image(loaded: LoadedModel, with_image: bool) -> tuple[str, list[Any]]:
    video = decode_video(
        mp4(Fraction(30000, 1001), 50, 45, 31, seed=3), sampling=loaded.video_config
    )
    image = generated(70, 50, seed=4)
    if with_image:
        return "<image>Same scene? <video>Say.", [image, video]
    return "<|im_start|>user\n<video>What happens?<|im_end|>\n", [video]


def _prompt(loaded: LoadedModel, text: str, media: list[Any]) -> tuple[list[int], list[Any]]:
    vision = loaded.config.vision
    assert vision is not None and loaded.image_config and loaded.video_config
    images = ImagePrompter(loaded.image_config, loaded.tokenizer, vision.image_token_id)
    videos = VideoPrompter(loaded.video_config, vision.image_token_id)
    pictures = [(m, f"image-{i}") for i, m in enumerate(media) if not hasattr(m, "frames")]
    clips = [m for m in media if hasattr(m, "frames")]
    return expand_markers(loaded.tokenizer, text, [images.group(pictures), videos.group(clips)])


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image and video"])
def test_logits_match_transformers(
    with_image: bool, loaded: LoadedModel, tiny: tuple[Path, Any, Any, Any]
) -> None:
    hf = tiny[1]
    model = loaded.model
    assert isinstance(model, Idefics3ForCausalLM)
    ids, media = _prompt(loaded, *_video_and_image(loaded, with_image))
    pixels = [m.encoder_input() for m in media]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=torch.cat(pixels)[None]).logits[0]
    ours = paged_logits(model, ids, image_embeddings(model, ids, pixels))
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    # every frame reaches the logits: the frames reversed change them
    other = [
        p.flip(0) if p.shape[0] > 1 and i == len(pixels) - 1 else p for i, p in enumerate(pixels)
    ]
    changed = paged_logits(model, ids, image_embeddings(model, ids, other))
    assert (changed - ours).abs().max() > 1e-2


@pytest.fixture(scope="module")
def served(tiny: tuple[Path, Any, Any, Any]) -> Iterator[ServedModel]:
    cfg = EngineConfig(
        dtype="f32", max_num_batched_tokens=32, kv_cache_tokens=2048, max_model_len=512
    )
    model = load_model(tiny[0], cfg, progress=False, loop=CallerLoop())
    yield model
    model.shutdown()


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image and video"])
def test_greedy_equals_transformers_generate(
    with_image: bool, served: ServedModel, loaded: LoadedModel, tiny: tuple[Path, Any, Any, Any]
) -> None:
    text, media = _video_and_image(loaded, with_image)
    items = [(m, f"image-{i}") if not hasattr(m, "frames") else m for i, m in enumerate(media)]
    ids, inputs = served.prompt(text, items)
    assert ids == _prompt(loaded, text, media)[0]
    assert "video" in served.modalities["input"]
    engine = served.engine.engine
    engine.add_request(
        f"video-{with_image}", ids, SamplingParams(max_tokens=8, temperature=0), media=inputs
    )
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
    pixels = torch.cat([m.encoder_input() for m in inputs])[None]
    with torch.inference_mode():
        out = tiny[1].generate(
            input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=8, do_sample=False
        )
    assert tokens == out[0, len(ids) :].tolist()


def test_many_frames_encode_in_passes_as_one(loaded: LoadedModel, tiny: Any) -> None:
    """More tiles than one encoder pass takes (a long video): the same rows as transformers'
    encoder gives for all of them at once."""
    from inferd.models.idefics3 import TILES_PER_PASS

    model = loaded.model
    assert isinstance(model, Idefics3ForCausalLM)
    pixels = torch.randn(TILES_PER_PASS + 5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = tiny[1].model.get_image_features(pixels[None]).pooler_output[0]
        ours = model.encode_images(pixels)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
