"""Qwen3-VL as llama.cpp ships it (loading/gguf_qwen3vl.py, loading/mmproj_qwen3vl.py): the tiny
random Qwen3-VL and Qwen3-VL-MoE converted by llama.cpp's own convert_hf_to_gguf.py into a
language model GGUF (``qwen3vl``: f32, f16, Q8_0; ``qwen3vlmoe``: f16, Q8_0) and a projector
(``qwen3vl_merger``: f32, f16), against the same checkpoint read as a Hugging Face directory
(whose parity with transformers tests/models/test_qwen3_vl_parity.py and
test_qwen3_vl_moe_parity.py prove).

The checkpoints' weights lie on Q8_0's grid, so every file holds exactly their values: each
pair of files gives the directory's config and every one of its parameters (the patch
embedding's two temporal kernels stacked back, the deep-stack mergers in order, the experts'
stacks as the directory's), the same preparation of images and videos, ids of text and chat
template; the engine's prompt ids, greedy tokens and the log-probabilities of every prompt and
reply token equal the directory's for text, an image and a video, and the language model alone
reads text as the directory does. Projectors that do not fit are refused before any weight is
read."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.loading.gguf import GGUFFile
from inferd.loading.mmproj import ProjectorError
from inferd.loading.model import load
from inferd.media.video import decode_video
from inferd.models.config import ModelConfig
from inferd.models.llama import LlamaForCausalLM
from inferd.models.qwen3_vl import Qwen3VLForCausalLM
from inferd.serving.prompter import MediaItem
from inferd.serving.served import ServedModel, load_model
from tests.contract.altered_gguf import rewrite
from tests.media.corpus import Clip, _mp4
from tests.models.test_gemma4_gguf import Run, assert_same_text_handling, greedy_run
from tests.models.test_idefics3_processor import generated
from tests.models.tiny_qwen3_vl import TinyQwen3VLGguf

LOGPROB_TOLERANCE = 1e-4  # float32 on both sides, the same weights: summation order alone
TEXTS = [
    "Hello world",
    "  two spaces, a tab\tand\n\nnewlines\n",
    "Numbers 12345 and 3.14159; def fibonacci(n):\n    return n\n",
    "Émile 三个字 🙂 it's <|vision_start|><|image_pad|><|vision_end|> <|im_start|>user",
    "<|video_pad|>The quick brown fox<|im_end|>",
]
# (checkpoint fixture, language model, projector): every file each conversion wrote
PAIRS = [
    ("tiny_qwen3_vl_gguf", "lm-f32", "mmproj-f32"),
    ("tiny_qwen3_vl_gguf", "lm-f16", "mmproj-f16"),
    ("tiny_qwen3_vl_gguf", "lm-q8_0", "mmproj-f32"),
    ("tiny_qwen3_vl_moe_gguf", "lm-f16", "mmproj-f32"),
    ("tiny_qwen3_vl_moe_gguf", "lm-q8_0", "mmproj-f32"),
]
# The engines compared: the Q8_0 language model with a projector, against the directory.
ENGINES = {"tiny_qwen3_vl_gguf": "mmproj-f16", "tiny_qwen3_vl_moe_gguf": "mmproj-f32"}


def _same_config(gguf: ModelConfig, hf: ModelConfig) -> bool:
    """Equal but for the norms' epsilon, which a GGUF stores in float32 (1e-6 reads back as
    9.99999997e-07)."""
    assert abs(gguf.rms_norm_eps - hf.rms_norm_eps) < 1e-12
    return replace(gguf, rms_norm_eps=hf.rms_norm_eps) == hf


@pytest.mark.parametrize(
    ("checkpoint", "lm", "mmproj"),
    PAIRS,
    ids=[f"{'moe' if 'moe' in c else 'dense'}-{lm}" for c, lm, _ in PAIRS],
)
def test_each_pair_of_files_holds_the_directory_model(
    request: pytest.FixtureRequest, checkpoint: str, lm: str, mmproj: str
) -> None:
    tiny: TinyQwen3VLGguf = request.getfixturevalue(checkpoint)
    directory = load(tiny.directory, dtype="f32", progress=False)
    files = tiny.files
    stored = {i.qtype for i in GGUFFile(files[lm]).tensor_infos()}
    kind = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[lm.removeprefix("lm-")]
    assert GGMLQuantizationType[kind] in stored  # the file is of the type it is named for
    ours = load(files[lm], dtype="f32", mmproj=files[mmproj], progress=False, packed_kernels=False)
    assert isinstance(ours.model, Qwen3VLForCausalLM)
    assert ours.projector == files[mmproj]
    assert _same_config(ours.config, directory.config)
    assert (ours.config.moe is not None) == ("moe" in checkpoint)
    # images and videos prepared alike
    assert (ours.visual_configs, ours.qwen3_video) == (
        directory.visual_configs,
        directory.qwen3_video,
    )
    theirs = dict(directory.model.named_parameters())
    params = dict(ours.model.named_parameters())
    assert params.keys() == theirs.keys()
    for name, value in params.items():
        assert torch.equal(value, theirs[name]), name
    assert_same_text_handling(ours, directory, files[lm], TEXTS)


def _text_only(hf: ModelConfig) -> ModelConfig:
    """The directory's decoder as the Qwen3 it is without its encoder."""
    return replace(
        hf, architecture="qwen3", qwen_vision=None, mrope_section=None, mrope_interleaved=False
    )


def test_the_language_model_alone_is_the_qwen3_decoder(
    tiny_qwen3_vl_moe_gguf: TinyQwen3VLGguf,
) -> None:
    directory = load(tiny_qwen3_vl_moe_gguf.directory, dtype="f32", progress=False)
    alone = load(tiny_qwen3_vl_moe_gguf.files["lm-f16"], dtype="f32", progress=False)
    assert type(alone.model) is LlamaForCausalLM and alone.projector is None
    assert alone.config.input_modalities == ("text",)
    assert _same_config(alone.config, _text_only(directory.config))


def test_inferd_convert_refuses_the_experts(
    tiny_qwen3_vl_moe_gguf: TinyQwen3VLGguf, tmp_path: Path
) -> None:
    from inferd.convert import ConvertError, convert_gguf

    with pytest.raises(ConvertError, match="a mixture-of-experts model cannot be converted"):
        convert_gguf(tiny_qwen3_vl_moe_gguf.files["lm-f16"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.fixture(scope="module", params=list(ENGINES))
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[ServedModel, ServedModel]]:
    """The Q8_0 language model with a projector, and the directory."""
    tiny: TinyQwen3VLGguf = request.getfixturevalue(request.param)
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=2048, max_model_len=512)
    from_gguf = load_model(
        tiny.files["lm-q8_0"],
        cfg,
        progress=False,
        loop=CallerLoop(),
        mmproj=tiny.files[ENGINES[request.param]],
    )
    from_hf = load_model(tiny.directory, cfg, progress=False, loop=CallerLoop())
    yield from_gguf, from_hf
    from_gguf.shutdown()
    from_hf.shutdown()


def _image() -> MediaItem:
    from inferd.serving.multimodal import image_digest

    picture = generated(30, 44, seed=61)  # resized up to the published bounds' 256x256 worth
    return picture, image_digest(picture)


def _video(served: ServedModel) -> MediaItem:
    sampling = served.video_sampling
    assert sampling is not None
    # 8 frames at 8 fps: 4 kept (the fewest), two temporal patches of 2x3 merged patches
    return decode_video(
        _mp4(Clip(fps=Fraction(8), frames=8, size=(96, 64)), None), sampling=sampling
    )


def _assert_same(ours: Run, theirs: Run, what: str) -> None:
    (ids, tokens, logprobs), (want_ids, want_tokens, want_logprobs) = ours, theirs
    assert (ids, tokens) == (want_ids, want_tokens), what
    assert len(logprobs) == len(ids) - 1 + len(tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, err_msg=what)


def test_the_engine_reads_text_images_and_video_as_the_directory(
    engines: tuple[ServedModel, ServedModel],
) -> None:
    from_gguf, from_hf = engines
    assert from_gguf.modalities["input"] == ["text", "image", "video"]
    text = {"type": "text", "text": "What do they show?"}
    cases: list[tuple[list[dict[str, str]], list[MediaItem], str]] = [
        ([text], [], "text"),
        ([{"type": "image"}, text], [_image()], "image"),
        ([{"type": "video"}, text], [_video(from_gguf)], "video"),
    ]
    for content, media, what in cases:
        _assert_same(
            greedy_run(from_gguf, content, media), greedy_run(from_hf, content, media), what
        )


def test_inferd_llm_takes_the_projector(engines: tuple[ServedModel, ServedModel]) -> None:
    from inferd.llm import LLM

    from_gguf, from_hf = engines
    picture, digest = _image()
    text = {"type": "text", "text": "What is it?"}
    ids, tokens, _ = greedy_run(from_hf, [{"type": "image"}, text], [(picture, digest)])
    messages = [{"role": "user", "content": [{"type": "image", "image": picture}, text]}]
    greedy = SamplingParams(max_tokens=len(tokens), temperature=0)
    with LLM(from_gguf.source.path, mmproj=from_gguf.projector, dtype="f32") as llm:
        [out] = llm.chat(messages, greedy, use_tqdm=False)
    assert (out.prompt_token_ids, list(out.outputs[0].token_ids)) == (ids, tokens)


def test_the_language_model_alone_reads_text_as_the_directory(
    tiny_qwen3_vl_gguf: TinyQwen3VLGguf,
) -> None:
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=1024, max_model_len=256)
    alone = load_model(tiny_qwen3_vl_gguf.files["lm-f32"], cfg, progress=False, loop=CallerLoop())
    from_hf = load_model(tiny_qwen3_vl_gguf.directory, cfg, progress=False, loop=CallerLoop())
    content = [{"type": "text", "text": "Count 1 2 3 and tell a story."}]
    try:
        _assert_same(greedy_run(alone, content, []), greedy_run(from_hf, content, []), "text alone")
    finally:
        alone.shutdown()
        from_hf.shutdown()


def test_projectors_that_do_not_fit_are_refused_before_loading(
    tiny_qwen3_vl_gguf: TinyQwen3VLGguf, tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    lm, proj = tiny_qwen3_vl_gguf.files["lm-f32"], tiny_qwen3_vl_gguf.files["mmproj-f32"]

    def lm_with(name: str, **keys: object) -> Path:
        return rewrite(lm, tmp_path / f"{name}.gguf", metadata=keys)

    def projector_with(name: str, **keys: object) -> Path:
        return rewrite(proj, tmp_path / f"{name}.gguf", metadata=keys)

    deeper = {
        "clip.vision.block_count": 4,
        "clip.vision.is_deepstack_layers": [True, True, False, False],
    }
    cases: list[tuple[Path, Path, str]] = [
        (
            lm_with("narrow", **{"qwen3vl.embedding_length": 48}),
            proj,
            "encoder gives 64-wide embeddings; the language model is 48 wide",
        ),
        (
            lm_with("deep", **{"qwen3vl.n_deepstack_layers": 3}),
            proj,
            "deep stack feeds 2 layers; the language model takes 3",
        ),
        (
            lm_with("sections", **{"qwen3vl.rope.dimension_sections": [6, 5, 4, 0]}),
            proj,
            r"sections \[6, 5, 4, 0\] .* do not cover its 32-wide heads",
        ),
        (
            lm,
            projector_with("qwen2vl", **{"clip.projector_type": "qwen2vl_merger"}),
            "projector type 'qwen2vl_merger' is not supported",
        ),
        (
            lm,
            projector_with("deeper", **deeper),
            "the projector lacks 12 tensors, e.g. v.blk.3.attn_out.bias",
        ),
        (
            tiny_llama_gguf,
            proj,
            "goes with a qwen3vl or qwen3vlmoe language model, not 'llama'",
        ),
        (lm, lm, "is not a multimodal projector .*'qwen3vl'"),
    ]
    for model, projector, message in cases:
        with pytest.raises(ProjectorError, match=message):
            load(model, dtype="f32", mmproj=projector, progress=False)


def test_a_projector_without_the_markers_in_the_vocabulary_is_refused(
    tiny_qwen3_vl_gguf: TinyQwen3VLGguf, tmp_path: Path
) -> None:
    lm, proj = tiny_qwen3_vl_gguf.files["lm-f32"], tiny_qwen3_vl_gguf.files["mmproj-f32"]
    tokens = GGUFFile(lm).metadata["tokenizer.ggml.tokens"]
    renamed = ["<|vid|>" if t == "<|video_pad|>" else t for t in tokens]
    no_video = rewrite(lm, tmp_path / "no-video.gguf", metadata={"tokenizer.ggml.tokens": renamed})
    with pytest.raises(ProjectorError, match=r"tokenizer has no <\|video_pad\|> token"):
        load(no_video, dtype="f32", mmproj=proj, progress=False)
