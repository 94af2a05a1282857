"""Gemma 4 as llama.cpp ships it (loading/gguf_gemma4.py, loading/mmproj_gemma4.py): the tiny
random Gemma 4 converted by llama.cpp's own convert_hf_to_gguf.py into a language model GGUF
(f32, f16, Q8_0) and a projector with its image and audio encoders (f32, f16), against the same
checkpoint read as a Hugging Face directory (whose parity with transformers the
tests/models/test_gemma4_*_parity.py modules prove).

The checkpoint's weights lie on Q8_0's grid, so every file holds exactly its values: each pair
of files gives the directory's config and every one of its parameters (the audio attention's
per-channel scale to float32 rounding: the converter stores it after a softplus), the same
processing of media, ids of text and chat template; the engine's prompt ids, greedy tokens and
the log-probabilities of every prompt and reply token equal the directory's for text, an image
with a clip, and a video. Projectors that do not fit are refused before any weight is read.

The same with experts beside each layer's dense MLP (``enable_moe_block``): the language model's
f32 and Q8_0 files give the directory's decoder config and every parameter (the expert stacks,
router and their norms included), the engine's log-probabilities on text equal the directory's,
and each expert's projection quantizes under ISQ (q8, q4) to the directory's logits."""

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
from inferd.loading.model import LoadedModel, load
from inferd.media.audio import decode_audio
from inferd.media.video import decode_video
from inferd.models.config import ModelConfig
from inferd.models.gemma4 import Gemma4ForCausalLM
from inferd.models.gemma4_multimodal import Gemma4MultimodalForCausalLM
from inferd.serving.prompter import MediaItem
from inferd.serving.served import ServedModel, load_model
from tests.contract.altered_gguf import rewrite
from tests.media.corpus import Clip, Tone, _mp4, wav_bytes
from tests.models.test_idefics3_processor import generated
from tests.models.test_llama_parity import full_forward
from tests.models.tiny_gemma4 import TinyGemma4Gguf

LOGPROB_TOLERANCE = 1e-4  # float32 on both sides, the same weights: summation order alone
TEXTS = [
    "Hello world",
    "  two spaces, a tab\tand\n\nnewlines\n",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
    "Émile 三个字 🙂 <0x41> ▁ <start_of_turn>user\n<|image|><end_of_turn>",
    "<bos>The quick brown fox<end_of_turn>",
]
PAIRS = [("lm-f32", "mmproj-f32"), ("lm-f16", "mmproj-f16"), ("lm-q8_0", "mmproj-f32")]


@pytest.fixture(scope="module")
def directory(tiny_gemma4_gguf: TinyGemma4Gguf) -> LoadedModel:
    return load(tiny_gemma4_gguf.directory, dtype="f32", progress=False)


def _same_config(gguf: ModelConfig, hf: ModelConfig) -> bool:
    """Equal but for the norms' epsilon, which a GGUF stores in float32 (1e-6 reads back as
    9.99999997e-07)."""
    assert gguf.gemma4_vision is not None and hf.gemma4_vision is not None
    assert abs(gguf.rms_norm_eps - hf.rms_norm_eps) < 1e-12
    vision = replace(gguf.gemma4_vision, rms_norm_eps=hf.gemma4_vision.rms_norm_eps)
    return replace(gguf, rms_norm_eps=hf.rms_norm_eps, gemma4_vision=vision) == hf


@pytest.mark.parametrize(("lm", "mmproj"), PAIRS, ids=[lm for lm, _ in PAIRS])
def test_each_pair_of_files_holds_the_directory_model(
    tiny_gemma4_gguf: TinyGemma4Gguf, directory: LoadedModel, lm: str, mmproj: str
) -> None:
    files = tiny_gemma4_gguf.files
    stored = {i.qtype for i in GGUFFile(files[lm]).tensor_infos()}
    kind = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[lm.removeprefix("lm-")]
    assert GGMLQuantizationType[kind] in stored  # the file is of the type it is named for
    ours = load(files[lm], dtype="f32", mmproj=files[mmproj], progress=False, packed_kernels=False)
    assert isinstance(ours.model, Gemma4MultimodalForCausalLM)
    assert ours.projector == files[mmproj]
    assert _same_config(ours.config, directory.config)
    assert ours.gemma4 == directory.gemma4  # images, videos and audio prepared alike
    theirs = dict(directory.model.named_parameters())
    params = dict(ours.model.named_parameters())
    assert params.keys() == theirs.keys()
    for name, value in params.items():
        if name.endswith("per_dim_scale"):
            torch.testing.assert_close(value, theirs[name], rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(value, theirs[name]), name
    assert_same_text_handling(ours, directory, files[lm], TEXTS)


def assert_same_text_handling(
    ours: LoadedModel, directory: LoadedModel, gguf: Path, texts: list[str]
) -> None:
    """The GGUF's tokenizer encodes and decodes ``texts`` as the directory's does, special
    tokens skipped or not, and its chat template is the file's, equal to the directory's."""
    for text in texts:
        ids = directory.tokenizer.encode(text, add_special=True)
        assert ours.tokenizer.encode(text, add_special=True) == ids, text
        for skip in (True, False):
            assert ours.tokenizer.decode(ids, skip_special=skip) == directory.tokenizer.decode(
                ids, skip_special=skip
            )
    template = GGUFFile(gguf).metadata["tokenizer.chat_template"]
    assert ours.chat_template.source == template == directory.chat_template.source


def test_the_language_model_alone_reads_text(
    tiny_gemma4_gguf: TinyGemma4Gguf, directory: LoadedModel
) -> None:
    alone = load(tiny_gemma4_gguf.files["lm-f32"], dtype="f32", progress=False)
    assert type(alone.model) is Gemma4ForCausalLM and alone.gemma4 is None
    assert alone.config.input_modalities == ("text",)
    text_only = replace(directory.config, gemma4_vision=None, gemma4_audio=None)
    assert replace(alone.config, rms_norm_eps=text_only.rms_norm_eps) == text_only


@pytest.fixture(scope="module")
def engines(tiny_gemma4_gguf: TinyGemma4Gguf) -> Iterator[tuple[ServedModel, ServedModel]]:
    """The Q8_0 language model with the float16 projector, and the directory."""
    files = tiny_gemma4_gguf.files
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=2048, max_model_len=512)
    from_gguf = load_model(
        files["lm-q8_0"], cfg, progress=False, loop=CallerLoop(), mmproj=files["mmproj-f16"]
    )
    from_hf = load_model(tiny_gemma4_gguf.directory, cfg, progress=False, loop=CallerLoop())
    yield from_gguf, from_hf
    from_gguf.shutdown()
    from_hf.shutdown()


Run = tuple[list[int], list[int], list[float]]  # prompt ids, greedy tokens, their logprobs


def greedy_run(served: ServedModel, content: list[dict[str, str]], media: list[MediaItem]) -> Run:
    """One user turn of ``content`` with ``media`` through ``served``'s engine, greedy for six
    tokens: the prompt's ids, the reply's tokens, and the log-probabilities of every prompt token
    after the first and of every reply token."""
    ids, inputs = served.chat_prompt([{"role": "user", "content": content}], media)
    engine = served.engine.engine
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0, prompt_logprobs=0)
    engine.add_request(f"r{len(ids)}", ids, params, media=inputs)
    tokens: list[int] = []
    logprobs: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_ids
            logprobs += [lp.logprob for lp in out.logprobs or ()]
            logprobs += [lp.logprob for lp in out.prompt_logprobs or () if lp is not None]
    return ids, tokens, logprobs


def _image() -> MediaItem:
    from inferd.serving.multimodal import image_digest

    picture = generated(30, 44, seed=61)
    return picture, image_digest(picture)


def _clip() -> MediaItem:
    return decode_audio(wav_bytes(Tone(16_000, 0.7, (440.0,))))


def _video(served: ServedModel) -> MediaItem:
    sampling = served.video_sampling
    assert sampling is not None
    return decode_video(
        _mp4(Clip(fps=Fraction(8), frames=4, size=(40, 28)), None), sampling=sampling
    )


def test_the_engine_reads_text_images_audio_and_video_as_the_directory(
    engines: tuple[ServedModel, ServedModel],
) -> None:
    from_gguf, from_hf = engines
    assert from_gguf.modalities["input"] == ["text", "image", "video", "audio"]
    text = {"type": "text", "text": "What do they show?"}
    cases: list[tuple[list[dict[str, str]], list[MediaItem], str]] = [
        ([text], [], "text"),
        ([{"type": "image"}, {"type": "audio"}, text], [_image(), _clip()], "image and clip"),
        ([{"type": "video"}, text], [_video(from_gguf)], "video"),
    ]
    for content, media, what in cases:
        ids, tokens, logprobs = greedy_run(from_gguf, content, media)
        want_ids, want_tokens, want_logprobs = greedy_run(from_hf, content, media)
        assert (ids, tokens) == (want_ids, want_tokens), what
        assert len(logprobs) == len(ids) - 1 + len(tokens)
        np.testing.assert_allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE, err_msg=what)


def test_projectors_that_do_not_fit_are_refused_before_loading(
    tiny_gemma4_gguf: TinyGemma4Gguf, tiny_llama_gguf: Path, tmp_path: Path
) -> None:
    files = tiny_gemma4_gguf.files
    lm, proj = files["lm-f32"], files["mmproj-f32"]
    llama = tiny_llama_gguf  # no Gemma 4 markers in its tokenizer
    narrow = rewrite(lm, tmp_path / "narrow.gguf", metadata={"gemma4.embedding_length": 48})
    other_kind = rewrite(
        proj, tmp_path / "gemma3.gguf", metadata={"clip.vision.projector_type": "gemma3"}
    )
    mels = rewrite(proj, tmp_path / "mels.gguf", metadata={"clip.audio.num_mel_bins": 128})
    cases: list[tuple[Path, Path, str]] = [
        (narrow, proj, "image encoder gives 64-wide embeddings; the language model is 48 wide"),
        (lm, other_kind, "projector type 'gemma3' \\+ 'gemma4a' is not supported"),
        (llama, proj, "a Gemma 4 projector goes with a gemma4 language model, not 'llama'"),
        (lm, mels, "says 128 mel bins, its first conv block has 16 channels"),
        (lm, lm, "is not a multimodal projector .*'gemma4'"),
    ]
    for model, projector, message in cases:
        with pytest.raises(ProjectorError, match=message):
            load(model, dtype="f32", mmproj=projector, progress=False)


def test_a_projector_without_the_markers_in_the_vocabulary_is_refused(
    tiny_gemma4_gguf: TinyGemma4Gguf, tmp_path: Path
) -> None:
    lm, proj = tiny_gemma4_gguf.files["lm-f32"], tiny_gemma4_gguf.files["mmproj-f32"]
    tokens = GGUFFile(lm).metadata["tokenizer.ggml.tokens"]
    renamed = ["<|vid|>" if t == "<|video|>" else t for t in tokens]
    no_video = rewrite(lm, tmp_path / "no-video.gguf", metadata={"tokenizer.ggml.tokens": renamed})
    with pytest.raises(ProjectorError, match=r"tokenizer has no <\|video\|> token"):
        load(no_video, dtype="f32", mmproj=proj, progress=False)


@pytest.fixture(scope="module")
def moe(tiny_gemma4_moe_gguf: TinyGemma4Gguf) -> tuple[LoadedModel, dict[str, Path]]:
    """The tiny Gemma 4 with experts read from its directory, and its files."""
    directory = load(tiny_gemma4_moe_gguf.directory, dtype="f32", progress=False)
    return directory, tiny_gemma4_moe_gguf.files


@pytest.mark.parametrize("lm", ["lm-f32", "lm-q8_0"])
def test_a_file_with_experts_holds_the_directory_decoder(
    moe: tuple[LoadedModel, dict[str, Path]], lm: str
) -> None:
    directory, files = moe
    ours = load(files[lm], dtype="f32", progress=False, packed_kernels=False)
    text_only = replace(directory.config, gemma4_vision=None, gemma4_audio=None)
    assert text_only.moe is not None
    assert replace(ours.config, rms_norm_eps=text_only.rms_norm_eps) == text_only
    theirs = dict(directory.model.named_parameters())
    params = dict(ours.model.named_parameters())
    assert {n for n in params if ".moe." in n} == {n for n in theirs if ".moe." in n}
    assert params.keys() <= theirs.keys()
    for name, value in params.items():
        assert torch.equal(value, theirs[name]), name


def test_the_engine_reads_text_through_the_experts_as_the_directory(
    moe: tuple[LoadedModel, dict[str, Path]],
) -> None:
    directory, files = moe
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=2048, max_model_len=512)
    from_gguf = load_model(files["lm-q8_0"], cfg, progress=False, loop=CallerLoop())
    from_hf = load_model(directory.source.path, cfg, progress=False, loop=CallerLoop())
    try:
        content = [{"type": "text", "text": "What do the experts say about the storm?"}]
        ids, tokens, logprobs = greedy_run(from_gguf, content, [])
        want_ids, want_tokens, want_logprobs = greedy_run(from_hf, content, [])
    finally:
        from_gguf.shutdown()
        from_hf.shutdown()
    assert (ids, tokens) == (want_ids, want_tokens)
    np.testing.assert_allclose(logprobs, want_logprobs, atol=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("isq", ["q8", "q4"])
def test_the_experts_of_a_file_quantize_as_the_directory(
    moe: tuple[LoadedModel, dict[str, Path]], isq: str
) -> None:
    """The file's expert stacks, dequantized, fill each expert's own projection (layers/moe.py),
    which ``--isq`` quantizes as it does the directory's: the same logits in bf16."""
    directory, files = moe
    ours = load(files["lm-q8_0"], dtype="bf16", isq=isq, progress=False)
    theirs = load(directory.source.path, dtype="bf16", isq=isq, progress=False)
    experts = ours.model.layers[0].moe.experts
    for projection in (*experts.gate_up_proj, *experts.down_proj):
        assert projection.weight.numel() == 0  # quantized in place: the dense weight dropped
    ids = ours.tokenizer.encode(" ".join(TEXTS[:3]), add_special=True)
    assert torch.equal(full_forward(ours.model, ids), full_forward(theirs.model, ids))
