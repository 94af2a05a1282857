"""A tiny random Gemma 4 decoder (Gemma4ForCausalLM) with every part Gemma 4 adds to Gemma 3.

Six layers, sliding, global, sliding, global, sliding, global: the global layers have their own
head size (32 against 16) and one key/value head against two, values read from the keys'
projection (``attention_k_eq_v``) and proportional RoPE on a quarter of their channel pairs;
the last two layers share the K/V of layers 2 and 3 and have double-wide MLPs; per-layer
embeddings (8 a layer); soft-capped logits; a sliding window of 6, shorter than the prompts.
Every weight is random, each layer's output scalar too, so a tensor read into the wrong place
cannot go unnoticed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.models.tiny import VOCAB, write_tokenizer

WINDOW = 6
LAYER_TYPES = ["sliding_attention", "full_attention"] * 3


def text_config(**overrides: Any) -> Any:
    from transformers import Gemma4TextConfig

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 100000.0,
            },
        },
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    return Gemma4TextConfig(**settings)


def randomize_gemma4(model: torch.nn.Module, seed: int) -> None:
    """Every parameter and each layer's output scalar random; Gemma 4's norms scale by ``w``,
    so theirs lie around one (and so do its experts' routers' scales, per channel and per
    expert)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(noise * (2.4 / p.shape[-1] ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def save_tiny_gemma4_text(directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """The randomized tiny decoder saved in ``directory`` with a tokenizer; returns the
    transformers model in float32 eval mode (eager attention)."""
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(text_config(**overrides)).float()
    randomize_gemma4(model, seed)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    write_tokenizer(directory)
    model.config._attn_implementation = "eager"
    return model.eval()


# --- Gemma4AssistantForCausalLM: a drafter for the decoder above ----------------------------

ASSISTANT_WINDOW = 5  # its own sliding window, unlike the served model's


def save_tiny_gemma4_assistant(
    directory: Path, seed: int = 1, ordered: bool = True, backbone: int = 64
) -> Any:
    """A randomized tiny drafting assistant for ``save_tiny_gemma4_text``'s decoder: a sliding
    and a global layer reading its cache (the same K/V shapes), 32 wide, its own window; with
    ``ordered`` its head scores 2 of 8 token clusters (a random token order); ``backbone``:
    the width of the model it drafts for. Returns the
    transformers model in float32 eval mode."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    text = text_config(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=ASSISTANT_WINDOW,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        use_double_wide_mlp=False,
        num_kv_shared_layers=2,
    )
    config = Gemma4AssistantConfig(
        text_config=text.to_dict(),
        backbone_hidden_size=backbone,
        use_ordered_embeddings=ordered,
        num_centroids=8,
        centroid_intermediate_top_k=2,
    )
    torch.manual_seed(seed)
    model = Gemma4AssistantForCausalLM(config).float()
    randomize_gemma4(model, seed)
    if ordered:
        order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))
        model.masked_embedding.token_ordering.copy_(order)
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    model.config.get_text_config()._attn_implementation = "eager"
    return model.eval()


# --- Gemma4ForConditionalGeneration: the decoder above under an image encoder ---------------

BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
BOA, AUDIO, EOA = "<|audio>", "<|audio|>", "<audio|>"
VIDEO = "<|video|>"
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
EXTRA = [BOI, IMAGE, EOI, BOA, AUDIO, EOA, VIDEO, *TURN_TOKENS]
MM_VOCAB = 340
PATCH, POOLING, MAX_SOFT_TOKENS = 4, 2, 70  # up to 280 patches of 4 px, 2x2 to a token
VIDEO_FRAMES = 4  # the video processor keeps this many frames (32 in the real one)
# Gemma's turns over content parts, an image part written as the image token.
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' }}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'audio' %}{{ '<|audio|>' }}"
    "{% elif part['type'] == 'video' %}{{ '<|video|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def mm_token_id(name: str) -> int:
    from tests.models.tiny import SPECIALS

    return (SPECIALS + EXTRA).index(name)


def _mm_tokenizer(gemma: bool = False) -> Any:
    """The byte-level tokenizer, or with ``gemma`` Gemma's own kind (``gemma_tokenizer``, its
    ``<bos>`` written by the template)."""
    from transformers import PreTrainedTokenizerFast

    from tests.models.tiny import byte_level_tokenizer

    fast = PreTrainedTokenizerFast(
        tokenizer_object=gemma_tokenizer() if gemma else byte_level_tokenizer(MM_VOCAB, EXTRA),
        bos_token=GEMMA_BOS if gemma else None,
        add_bos_token=gemma,
        unk_token=GEMMA_UNK if gemma else None,
        eos_token="<end_of_turn>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": IMAGE,
            "boi_token": BOI,
            "eoi_token": EOI,
            "audio_token": AUDIO,
            "boa_token": BOA,
            "eoa_token": EOA,
        },
    )
    fast.chat_template = "{{ bos_token }}" + TEMPLATE if gemma else TEMPLATE
    return fast


GEMMA_BOS, GEMMA_UNK = "<bos>", "<unk>"
_SPM_SPACE = "\u2581"


def gemma_tokenizer() -> Any:
    """A tokenizer of Gemma's kind, ``MM_VOCAB`` tokens: BPE over text whose spaces are ``▁``,
    with byte fallback (``<0x00>`` ... ``<0xFF>``), the chat and media markers first (the ids
    ``mm_token_id`` gives), then ``<bos>`` and ``<unk>``. llama.cpp's converter takes only this
    kind for Gemma 4 (``LlamaHfVocab``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from tests.models.tiny import CORPUS, SPECIALS, with_byte_fallback

    trained = Tokenizer(models.BPE(unk_token=GEMMA_UNK, fuse_unk=True))
    trained.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    trainer = trainers.BpeTrainer(
        vocab_size=MM_VOCAB - 256,
        special_tokens=[*SPECIALS, *EXTRA, GEMMA_BOS, GEMMA_UNK],
        show_progress=False,
    )
    trained.train_from_iterator(CORPUS, trainer)
    tok = with_byte_fallback(trained)
    # transformers' GemmaTokenizer: the split finds no space once the normalizer ran.
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    assert tok.get_vocab_size() == MM_VOCAB
    return tok


def vision_config(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        pooling_kernel_size=POOLING,
        position_embedding_size=64,
        rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
        standardize=True,
        use_clipped_linears=True,
    )
    settings.update(overrides)
    return settings


MEL_BINS = 16  # the audio encoder's first conv block has as many channels


def audio_config(**overrides: Any) -> dict[str, Any]:
    """Chunks of 4 frames seeing 5 back (itself included), as the real one's 12 and 13."""
    settings: dict[str, Any] = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        subsampling_conv_channels=[MEL_BINS, 8],
        conv_kernel_size=5,
        attention_chunk_size=4,
        attention_context_left=5,
        attention_context_right=0,
        attention_logit_cap=5.0,  # low enough that the cap bends some logits
        use_clipped_linears=True,
        output_proj_dims=24,
    )
    settings.update(overrides)
    return settings


def mm_config(
    audio_overrides: dict[str, Any] | None = None,
    vision_overrides: dict[str, Any] | None = None,
    **text_overrides: Any,
) -> Any:
    from transformers import Gemma4Config

    text = text_config(
        vocab_size=MM_VOCAB,
        vocab_size_per_layer_input=MM_VOCAB,
        use_bidirectional_attention="vision",
        eos_token_id=mm_token_id("<end_of_turn>"),
        **text_overrides,
    )
    return Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision_config(**(vision_overrides or {})),
        audio_config=audio_config(**(audio_overrides or {})),
        image_token_id=mm_token_id(IMAGE),
        boi_token_id=mm_token_id(BOI),
        eoi_token_id=mm_token_id(EOI),
        video_token_id=mm_token_id(VIDEO),
        audio_token_id=mm_token_id(AUDIO),
        boa_token_id=mm_token_id(BOA),
        eoa_token_index=mm_token_id(EOA),
    )


def randomize_clip_bounds(model: torch.nn.Module, seed: int) -> None:
    """Finite clamp bounds on every clipped projection, tight enough that some values meet
    them (infinite ones would hide a bound read into the wrong place)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-1.5 - float(torch.rand((), generator=g)))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5 + float(torch.rand((), generator=g)))


Q8_0_BLOCK = 32  # values per Q8_0 block, along a tensor's rows


def on_q8_0_grid(model: torch.nn.Module) -> None:
    """Every weight of two or more dimensions made exactly representable in Q8_0 and in float16,
    so that llama.cpp's converter stores the same values at each of its output types: in each
    block of 32 along a row, multiples of a power of two ``d`` between -127 d and 127 d, the
    largest magnitude exactly 127 d (the quantizer's scale is the largest magnitude over 127).
    Only what the checkpoint saves: a buffer transformers computes (the audio's relative
    position table) stays as it computes it."""
    with torch.no_grad():
        for tensor in model.state_dict().values():  # sharing the parameters' storage
            if tensor.dim() < 2 or not tensor.is_floating_point():
                continue
            rows = tensor.view(-1, tensor.shape[-1])
            for start in range(0, rows.shape[1], Q8_0_BLOCK):
                block = rows[:, start : start + Q8_0_BLOCK]
                largest = block.abs().amax(-1, keepdim=True).clamp_min(1e-6)
                step = 2.0 ** torch.ceil(torch.log2(largest / 127))
                steps = torch.round(block / step).clamp(-127, 127)
                top = steps.abs().argmax(-1, keepdim=True)
                sign = torch.where(steps.gather(-1, top) < 0, -1.0, 1.0)
                steps.scatter_(-1, top, 127 * sign)
                block.copy_(steps * step)


# What llama.cpp's Gemma 4 projector assumes rather than records (tools/mtmd: pooling 3; audio
# attention in chunks of 12 seeing 13 back, logits capped at 50): the shape ``llama_cpp`` gives
# the encoders, so that the converted files describe this model. ``input_feat_size`` is what the
# converter writes as the projector's mel bins.
LLAMA_CPP_VISION: dict[str, Any] = {"pooling_kernel_size": 3}
LLAMA_CPP_AUDIO: dict[str, Any] = {
    "attention_chunk_size": 12,
    "attention_context_left": 13,
    "attention_logit_cap": 50.0,
    "input_feat_size": MEL_BINS,
}
LLAMA_CPP_SOFT_TOKENS = 280  # the image processor's default budget


def save_tiny_gemma4(
    directory: Path,
    seed: int = 0,
    audio_overrides: dict[str, Any] | None = None,
    *,
    llama_cpp: bool = False,
) -> tuple[Any, Any]:
    """The randomized tiny Gemma4ForConditionalGeneration and its processor (image processor,
    audio feature extractor and tokenizer) saved in ``directory``; returns both (the model in
    float32 eval mode). ``llama_cpp``: the encoders in the shape llama.cpp's projector assumes
    (``LLAMA_CPP_VISION``, ``LLAMA_CPP_AUDIO``), the image processor at its default budget and
    Gemma's kind of tokenizer (``gemma_tokenizer``), as llama.cpp's converter takes them; and
    the weights on Q8_0's grid (``on_q8_0_grid``), so its float32, float16 and Q8_0 files all
    hold this very model."""
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    if llama_cpp:
        audio_overrides = {**LLAMA_CPP_AUDIO, **(audio_overrides or {})}
    config = mm_config(audio_overrides, LLAMA_CPP_VISION if llama_cpp else None)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).float()
    randomize_gemma4(model, seed)
    randomize_clip_bounds(model, seed)
    with torch.no_grad():  # a standardization that moves the features
        model.model.vision_tower.std_bias.normal_(
            0.0, 0.5, generator=torch.Generator().manual_seed(seed)
        )
        model.model.vision_tower.std_scale.uniform_(
            0.5, 1.5, generator=torch.Generator().manual_seed(seed)
        )
    if llama_cpp:
        on_q8_0_grid(model)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.save_pretrained(str(directory))
    model.config._attn_implementation = "eager"
    pooling = config.vision_config.pooling_kernel_size
    soft_tokens = LLAMA_CPP_SOFT_TOKENS if llama_cpp else MAX_SOFT_TOKENS
    images = Gemma4ImageProcessorPil(
        patch_size=PATCH, pooling_kernel_size=pooling, max_soft_tokens=soft_tokens
    )

    class ProcessorWithoutVideo(Gemma4Processor):  # type: ignore[misc]
        """Gemma4Processor less its video processor, which needs torchvision (absent here)."""

        def check_argument_for_proper_class(self, name: str, argument: Any) -> Any:
            if name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(name, argument)

    tokenizer = _mm_tokenizer(gemma=llama_cpp)
    features = Gemma4AudioFeatureExtractor(feature_size=MEL_BINS)
    processor = ProcessorWithoutVideo(
        feature_extractor=features,
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
        image_seq_length=soft_tokens,
    )
    if llama_cpp:  # every marker special: llama.cpp's converter makes those control tokens
        extra = [*tokenizer.extra_special_tokens, "<start_of_turn>"]
        tokenizer.add_special_tokens({"extra_special_tokens": extra})
    # transformers v5's layout (its save_pretrained needs the video processor we lack):
    # the settings in processor_config.json, the media tokens in tokenizer_config.json.
    settings = {
        "image_processor": images.to_dict(),
        "feature_extractor": features.to_dict(),
        "video_processor": video_processor_settings(pooling, 32 if llama_cpp else VIDEO_FRAMES),
    }
    settings["image_processor"]["resample"] = int(images.resample)
    settings["feature_extractor"]["mel_floor"] = float(features.mel_floor)
    (directory / "processor_config.json").write_text(json.dumps(settings, indent=1))
    tokenizer.save_pretrained(str(directory))
    return model.eval(), processor


def video_processor_settings(pooling: int = POOLING, frames: int = VIDEO_FRAMES) -> dict[str, Any]:
    """What Gemma4VideoProcessor saves (it needs torchvision, absent here, to be built): its
    defaults, at the tiny encoder's patches and pooling, keeping ``frames`` frames."""
    return {
        "video_processor_type": "Gemma4VideoProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "resample": 3,
        "do_sample_frames": True,
        "num_frames": frames,
        "patch_size": PATCH,
        "pooling_kernel_size": pooling,
        "max_soft_tokens": 70,
    }


# --- The same model as llama.cpp ships it: a language model GGUF plus a projector -------------

# The files convert_tiny_gemma4 writes: (name, outtype, projector or language model).
GGUF_FILES = (
    ("lm-f32", "f32", False),
    ("lm-f16", "f16", False),
    ("lm-q8_0", "q8_0", False),
    ("mmproj-f32", "f32", True),
    ("mmproj-f16", "f16", True),
)


@dataclass(frozen=True)
class TinyGemma4Gguf:
    """A ``llama_cpp`` checkpoint (its directory, transformers model and processor) and
    llama.cpp's files of it, by name (``GGUF_FILES``)."""

    directory: Path
    hf: Any
    processor: Any
    files: dict[str, Path]

    @property
    def tiny(self) -> tuple[Path, Any, Any]:
        """As the ``tiny_gemma4`` fixture gives a checkpoint."""
        return self.directory, self.hf, self.processor


def convert_tiny_gemma4(directory: Path, out: Path) -> dict[str, Path]:
    """llama.cpp's converter's files of the ``llama_cpp`` checkpoint in ``directory``, written
    into ``out`` (``GGUF_FILES``)."""
    from tests.models.llama_cpp_convert import convert_files

    return convert_files(directory, out, GGUF_FILES)
