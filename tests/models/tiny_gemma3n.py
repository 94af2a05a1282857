"""A tiny random Gemma 3n decoder (Gemma3nForCausalLM) with every part Gemma 3n adds.

Eight layers, sliding but for layers 2, 5 and 7 (global), a sliding window of 8, much shorter
than the test prompts; the last three layers share the K/V of layers 2 and 4; four AltUp
streams, a Laurel branch of rank 8, per-layer embeddings (8 a layer) from a table narrower
than the vocabulary (the ids past it read row 0), MLPs of two widths, the first three gated
sparsely; soft-capped logits. Every weight is random, norms around one, so a tensor read into
the wrong place cannot go unnoticed.

``slice_reference`` builds what a MatFormer slice of it must equal: transformers' model from
the sliced config with the sliced weights (the MLPs' first units, the layers kept, their
blocks of the PLE tables).

``save_tiny_gemma3n_multimodal`` puts the same decoder under a tiny audio encoder (two
conformer layers) as a Gemma3nForConditionalGeneration with its processor; transformers builds
its image encoder with timm, absent here, so an empty module stands in for it (the checkpoint
has none of its tensors, as inferd reads none).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.models.tiny import VOCAB, write_tokenizer

WINDOW = 8
S, G = "sliding_attention", "full_attention"
LAYER_TYPES = [S, S, G, S, S, G, S, G]
WIDTHS = [96, 128, 96, 128, 96, 128, 96, 128]
SPARSITY = [0.95, 0.95, 0.95, 0.0, 0.0, 0.0, 0.0, 0.0]
PLE_VOCAB = 256  # ids 256..319 are past the per-layer table

# A MatFormer slice of the tiny model, in the published CSV's format: layers 3 and 6 skipped
# (6 shares K/V, 3 does not), the others' MLPs cut to these widths.
SLICE_NAME = "Config for tiny E0.5"
SKIPPED = [3, 6]
SLICE_WIDTHS = [48, 128, 64, 96, 64, 128]
MATFORMER_CSV = (
    "name,# Layers,# Effective Params (B),MMLU PT accuracy,FFN Hidden Dims,Layers Skipped\n"
    'Main model,8,0.01,1.00%,"[16 * 6, 16 * 8, 16 * 6, 16 * 8, 16 * 6, 16 * 8, 16 * 6, 16 * 8]",\n'
    f'{SLICE_NAME},6,0.005,0.50%,"[16 * 3, 128, 16 * 4, 16 * 6, 64, 16 * 8]","[3, 6]"\n'
)


def text_config(**overrides: Any) -> Any:
    from transformers import Gemma3nTextConfig

    settings: dict[str, Any] = dict(
        vocab_size=VOCAB,
        vocab_size_per_layer_input=PLE_VOCAB,
        hidden_size=64,
        hidden_size_per_layer_input=8,
        intermediate_size=WIDTHS,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=LAYER_TYPES,
        num_kv_shared_layers=3,
        activation_sparsity_pattern=SPARSITY,
        altup_num_inputs=4,
        laurel_rank=8,
        final_logit_softcapping=30.0,
        max_position_embeddings=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
        },
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    return Gemma3nTextConfig(**settings)


def randomize_gemma3n(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random; Gemma 3n's norms scale by ``w``, so theirs lie around one, and
    AltUp's mixing coefficients stay small enough that the streams do not blow up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("coefs.weight"):
                p.copy_(0.3 * noise)
            elif name.endswith("correct_output_scale"):
                p.copy_(1 + 0.3 * noise)
            else:
                p.copy_(noise * (2.4 / p.shape[-1] ** 0.5))


def build_tiny_gemma3n(seed: int = 0, **overrides: Any) -> Any:
    """The randomized tiny Gemma3nForCausalLM, float32, eval mode, eager attention."""
    from transformers import Gemma3nForCausalLM

    torch.manual_seed(seed)
    model = Gemma3nForCausalLM(text_config(**overrides)).float()
    randomize_gemma3n(model, seed)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.config._attn_implementation = "eager"
    return model.eval()


def save_tiny_gemma3n_text(directory: Path, seed: int = 0, **overrides: Any) -> Any:
    """The randomized tiny decoder saved in ``directory`` with a tokenizer; returns it."""
    model = build_tiny_gemma3n(seed, **overrides)
    model.save_pretrained(str(directory))
    write_tokenizer(directory)
    return model


# --- Gemma3nForConditionalGeneration: the decoder above under the audio encoder -------------

# Its vocabulary: text below 336 (the tokenizer's BPE and chat markers, the PLE table's ids),
# then the image range 336..367 and the audio range 368..399, each embedded by its encoder's
# own table; the end-of-media markers and soft tokens open each range, as in the real one.
MM_VOCAB, MM_TEXT = 400, 336
MEDIA_VOCAB = {"embed_vision": (336, 8), "embed_audio": (368, 12)}  # offset, table width
MEDIA_VOCAB_SIZE = 32
BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
BOA, AUDIO, EOA = "<start_of_audio>", "<audio_soft_token>", "<end_of_audio>"
SENTENCEPIECE = "tokenizer.model"  # a SentencePiece model, as Gemma's checkpoints ship it
TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]
MEL_BINS = 16
AUDIO_SOFT_TOKENS = 188  # the real processor's and model's: every clip fills as many tokens
# Gemma's turns over content parts, an audio part written as the audio token.
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image_soft_token>' }}"
    "{% elif part['type'] == 'audio' %}{{ '<audio_soft_token>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def mm_token_id(name: str, gemma: bool = False) -> int:
    return int(_mm_tokenizer(gemma).convert_tokens_to_ids(name))


def _mm_tokenizer(gemma: bool = False) -> Any:
    """``MM_TEXT`` text ids (the chat and begin-of-media markers among their specials), then
    the image range's end marker and soft token, fillers to the audio range, and its end marker
    and soft token at its first two ids. The text ids: a byte-level BPE, or with ``gemma``
    Gemma's own kind, transformers' GemmaTokenizer of a SentencePiece model
    (``gemma_sentencepiece``; its ``<bos>`` written by the template)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tests.models.tiny import byte_level_tokenizer

    media = [EOI, IMAGE, *(f"<unused_image_{i}>" for i in range(MEDIA_VOCAB_SIZE - 2)), EOA, AUDIO]
    tok = (
        _gemma_text_tokenizer()
        if gemma
        else byte_level_tokenizer(MM_TEXT, [*TURN_TOKENS, BOI, BOA])
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in media])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>" if gemma else None,
        add_bos_token=gemma,
        unk_token="<unk>" if gemma else None,
        eos_token="<end_of_turn>",
        pad_token="<pad>" if gemma else "<|endoftext|>",
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
    assert fast.convert_tokens_to_ids(EOA) == MEDIA_VOCAB["embed_audio"][0]
    return fast


def gemma_sentencepiece() -> bytes:
    """A SentencePiece model (``tokenizer.model``) of ``MM_TEXT`` pieces made as Gemma's is:
    BPE with byte fallback over text whose spaces are ``▁`` (no dummy prefix, runs of spaces
    kept, digits split), ``<pad>``, ``<eos>``, ``<bos>`` and ``<unk>`` first, then the chat
    and begin-of-media markers as control pieces; trained on the tiny corpus. llama.cpp's
    converter reads only this kind for Gemma 3n."""
    import io

    import sentencepiece

    from tests.models.tiny import CORPUS

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        model_type="bpe",
        vocab_size=MM_TEXT,
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        control_symbols=[*TURN_TOKENS, BOI, BOA],
        minloglevel=2,
    )
    return model.getvalue()


def _gemma_text_tokenizer() -> Any:
    """The text ids of Gemma's kind: transformers' GemmaTokenizer converted from
    ``gemma_sentencepiece``'s model."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SENTENCEPIECE).write_bytes(gemma_sentencepiece())
        config = {"tokenizer_class": "GemmaTokenizer", "mask_token": None}
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        tokenizer = AutoTokenizer.from_pretrained(tmp).backend_tokenizer
    assert tokenizer.get_vocab_size() == MM_TEXT
    return tokenizer


def audio_config(**overrides: Any) -> dict[str, Any]:
    """Two conformer layers 32 wide, chunks of 4 frames seeing 4 back (itself included), as
    the real one's 12 and 13; conv channels unlike the mel bins; a logit cap and a clipping
    bound low enough to bend some values."""
    settings: dict[str, Any] = dict(
        hidden_size=32,
        input_feat_size=MEL_BINS,
        conf_num_hidden_layers=2,
        conf_num_attention_heads=2,
        sscp_conv_channel_size=[8, 6],
        conf_attention_chunk_size=4,
        conf_attention_context_left=5,
        conf_attention_context_right=0,
        conf_attention_logit_cap=5.0,
        gradient_clipping=4.0,
        vocab_offset=MEDIA_VOCAB["embed_audio"][0],
        vocab_size=MEDIA_VOCAB_SIZE,
        rms_norm_eps=1e-6,
    )
    settings.update(overrides)
    return settings


def mm_config(audio_overrides: dict[str, Any] | None = None, gemma: bool = False) -> Any:
    """The ConditionalGeneration's config, its markers' ids those of ``_mm_tokenizer(gemma)``."""
    from transformers import Gemma3nConfig

    tokenizer = _mm_tokenizer(gemma)

    def token(name: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(name))

    text = text_config(
        vocab_size=MM_VOCAB,
        vocab_size_per_layer_input=MM_TEXT,
        eos_token_id=token("<end_of_turn>"),
    )
    vision = {
        "hidden_size": MEDIA_VOCAB["embed_vision"][1],
        "vocab_offset": MEDIA_VOCAB["embed_vision"][0],
        "vocab_size": MEDIA_VOCAB_SIZE,
    }
    return Gemma3nConfig(
        text_config=text.to_dict(),
        vision_config=vision,
        audio_config=audio_config(**(audio_overrides or {})),
        audio_soft_tokens_per_image=AUDIO_SOFT_TOKENS,
        vision_soft_tokens_per_image=16,
        boi_token_id=token(BOI),
        eoi_token_id=token(EOI),
        image_token_id=token(IMAGE),
        boa_token_id=token(BOA),
        eoa_token_id=token(EOA),
        audio_token_id=token(AUDIO),
        tie_word_embeddings=True,
    )


def build_tiny_gemma3n_multimodal(
    seed: int = 0, audio_overrides: dict[str, Any] | None = None, *, llama_cpp: bool = False
) -> Any:
    """The randomized tiny Gemma3nForConditionalGeneration in float32 eval mode, eager
    attention, less its image encoder: transformers builds that MobileNet with timm (absent
    here), so an empty module stands in for it (the audio and text paths never call it).
    ``llama_cpp``: its markers' ids Gemma's tokenizer's (``_mm_tokenizer``), its weights on
    Q8_0's grid (``on_q8_0_grid``)."""
    from unittest import mock

    from transformers import Gemma3nForConditionalGeneration
    from transformers.models.gemma3n import modeling_gemma3n

    from tests.models.tiny_gemma4 import on_q8_0_grid

    build = modeling_gemma3n.AutoModel.from_config

    def without_vision(config: Any, **kwargs: Any) -> Any:
        if config.model_type == "gemma3n_vision":
            return torch.nn.Module()
        return build(config, **kwargs)

    config = mm_config(audio_overrides, gemma=llama_cpp)
    torch.manual_seed(seed)
    with mock.patch.object(modeling_gemma3n.AutoModel, "from_config", without_vision):
        model = Gemma3nForConditionalGeneration(config).float()
    randomize_gemma3n(model, seed)
    if llama_cpp:
        on_q8_0_grid(model)
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.config._attn_implementation = "eager"
    model.config.get_text_config()._attn_implementation = "eager"
    return model.eval()


def save_tiny_gemma3n_multimodal(
    directory: Path,
    seed: int = 0,
    audio_overrides: dict[str, Any] | None = None,
    *,
    llama_cpp: bool = False,
) -> tuple[Any, Any]:
    """The tiny Gemma3nForConditionalGeneration (``build_tiny_gemma3n_multimodal``) and its
    processor (audio feature extractor at ``MEL_BINS`` mel bins, image processor, tokenizer)
    saved in ``directory``; returns both. ``llama_cpp``: as llama.cpp's converter takes it,
    Gemma's kind of tokenizer with its SentencePiece model beside it and the weights on Q8_0's
    grid, so that its float32, float16 and Q8_0 files all hold this very model."""
    from transformers import Gemma3nAudioFeatureExtractor, Gemma3nProcessor
    from transformers.models.siglip import SiglipImageProcessorPil

    model = build_tiny_gemma3n_multimodal(seed, audio_overrides, llama_cpp=llama_cpp)
    model.save_pretrained(str(directory))
    tokenizer = _mm_tokenizer(gemma=llama_cpp)
    processor = Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(feature_size=MEL_BINS),
        image_processor=SiglipImageProcessorPil(),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
        audio_seq_length=AUDIO_SOFT_TOKENS,
        image_seq_length=16,
    )
    processor.save_pretrained(str(directory))
    if llama_cpp:
        (directory / SENTENCEPIECE).write_bytes(gemma_sentencepiece())
        _list_added_tokens(directory, tokenizer)
    return model, processor


def _list_added_tokens(directory: Path, tokenizer: Any) -> None:
    """``added_tokens_decoder`` in tokenizer_config.json, as Gemma's checkpoints (saved by
    transformers v4) carry it: where llama.cpp's converter finds the tokens past the
    SentencePiece model (the media markers), which transformers v5 leaves to tokenizer.json."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "special": t.special}
        for i, t in tokenizer.added_tokens_decoder.items()
    }
    path.write_text(json.dumps(config, indent=1))


def text_model(full: Any) -> Any:
    """transformers' Gemma3nForCausalLM on the decoder of the ConditionalGeneration ``full``
    (its weights shared): the model its MatFormer slices cut."""
    from transformers import Gemma3nForCausalLM

    model = Gemma3nForCausalLM(full.config.get_text_config()).float()
    model.model = full.model.language_model
    model.lm_head = full.lm_head
    model.generation_config.eos_token_id = None
    return model.eval()


def media_embedders(full: Any) -> dict[str, Any]:
    """The ConditionalGeneration ``full``'s embedders of its media ranges of ids."""
    return {name: getattr(full.model, name) for name in MEDIA_VOCAB}


def multimodal_logits(hf: Any, embedders: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """The logits Gemma3nForConditionalGeneration gives a text prompt: ids of the media ranges
    embedded by their embedders, the PLE of the ids, then ``hf``'s text model and head (a
    MatFormer slice of the decoder under the whole model's embedders)."""
    input_ids = torch.tensor([ids])
    model = hf.model
    with torch.no_grad():
        embeds = model.embed_tokens(input_ids)
        for e in embedders.values():
            inside = (input_ids >= e.vocab_offset) & (input_ids < e.vocab_offset + e.vocab_size)
            rows = e(input_ids=torch.where(inside, input_ids, e.vocab_offset))
            embeds = torch.where(inside.unsqueeze(-1), rows, embeds)
        per_layer = model.get_per_layer_inputs(input_ids)
        hidden = model(inputs_embeds=embeds, per_layer_inputs=per_layer).last_hidden_state
        logits = hf.lm_head(hidden)[0]
    cap = hf.config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap


def multimodal_greedy(hf: Any, embedders: dict[str, Any], ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(multimodal_logits(hf, embedders, out)[-1].argmax()))
    return out[len(ids) :]


def slice_reference(full: Any) -> Any:
    """transformers' model of the MatFormer slice ``SLICE_NAME`` of ``full``: the sliced
    config written out by hand, the weights copied and cut from the full model."""
    from transformers import Gemma3nForCausalLM

    kept = [i for i in range(len(LAYER_TYPES)) if i not in SKIPPED]
    cfg = text_config(
        vocab_size=full.config.vocab_size,
        vocab_size_per_layer_input=full.config.vocab_size_per_layer_input,
        eos_token_id=full.config.eos_token_id,
        num_hidden_layers=len(kept),
        layer_types=[LAYER_TYPES[i] for i in kept],
        intermediate_size=SLICE_WIDTHS,
        activation_sparsity_pattern=[SPARSITY[i] for i in kept],
        num_kv_shared_layers=2,  # 3 less the skipped layer 6, which shared
    )
    sliced = Gemma3nForCausalLM(cfg).float()
    state = full.state_dict()
    per = cfg.hidden_size_per_layer_input
    out: dict[str, torch.Tensor] = {}
    for name, target in sliced.state_dict().items():
        if name.startswith("model.layers."):
            ours = int(name.split(".")[2])
            source = name.replace(f"layers.{ours}.", f"layers.{kept[ours]}.", 1)
            tensor = state[source]
            width = SLICE_WIDTHS[ours]
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                tensor = tensor[:width]
            elif name.endswith("down_proj.weight"):
                tensor = tensor[:, :width]
        elif name == "model.embed_tokens_per_layer.weight":
            blocks = state[name].view(state[name].shape[0], len(LAYER_TYPES), per)
            tensor = blocks[:, kept].reshape(target.shape)
        elif name == "model.per_layer_model_projection.weight":
            blocks = state[name].view(len(LAYER_TYPES), per, -1)
            tensor = blocks[kept].reshape(target.shape)
        else:
            tensor = state[name]
        out[name] = tensor
    sliced.load_state_dict(out)
    sliced.generation_config.eos_token_id = None
    sliced.config._attn_implementation = "eager"
    return sliced.eval()


# --- The ``llama_cpp`` checkpoint as llama.cpp ships it ---------------------------------------

# Its language model at each of the converter's types (``convert_files``' specs). The converter
# writes no projector for Gemma 3n: it cannot map the audio encoder's conv norms
# (``subsample_conv_projection.conv_N.norm``), which every Gemma 3n checkpoint has.
GGUF_FILES = (("lm-f32", "f32", False), ("lm-f16", "f16", False), ("lm-q8_0", "q8_0", False))


@dataclass(frozen=True)
class TinyGemma3nGguf:
    """A ``llama_cpp`` checkpoint (its directory and transformers model) and llama.cpp's files
    of it, by name (``GGUF_FILES``)."""

    directory: Path
    hf: Any
    files: dict[str, Path]
