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
"""

from __future__ import annotations

import json
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


# The ConditionalGeneration model's media ranges of the vocabulary: ids 256..287 (image) and
# 288..319 (audio) are embedded by the encoders' own tables, of these widths.
MEDIA_VOCAB = {"embed_vision": (256, 8), "embed_audio": (288, 12)}
MEDIA_VOCAB_SIZE = 32


def media_embedders(seed: int = 0) -> dict[str, Any]:
    """transformers' Gemma3nMultimodalEmbedder of each media range, randomized."""
    from types import SimpleNamespace

    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nMultimodalEmbedder

    out = {}
    for n, (name, (offset, width)) in enumerate(MEDIA_VOCAB.items()):
        media = SimpleNamespace(
            hidden_size=width, rms_norm_eps=1e-6, vocab_offset=offset, vocab_size=MEDIA_VOCAB_SIZE
        )
        embedder = Gemma3nMultimodalEmbedder(media, SimpleNamespace(hidden_size=64)).float()
        randomize_gemma3n(embedder, seed + 1 + n)
        out[name] = embedder.eval()
    return out


def multimodal_logits(hf: Any, embedders: dict[str, Any], ids: list[int]) -> torch.Tensor:
    """The logits Gemma3nForConditionalGeneration gives a text prompt: ids of the media ranges
    embedded by their embedders, the PLE of the ids, then ``hf``'s text model and head."""
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


def save_tiny_gemma3n_multimodal(directory: Path, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """The same decoder as a Gemma3nForConditionalGeneration directory: its weights under
    ``model.language_model.``, the media ranges' embedders beside it, a config.json with
    vision and audio configs and an encoder tensor (transformers builds its MobileNet tower
    with timm, absent here, so the directory is written by hand). Returns the text model and
    the embedders (``multimodal_logits`` runs them as the whole model would)."""
    from safetensors.torch import save_file

    model = build_tiny_gemma3n(seed)
    embedders = media_embedders(seed)
    tensors = {
        "model.language_model." + name.removeprefix("model."): p.detach().contiguous()
        for name, p in model.named_parameters()
        if name.startswith("model.")
    }
    for name, embedder in embedders.items():
        for key, p in embedder.named_parameters():
            tensors[f"model.{name}.{key}"] = p.detach().contiguous()
    tensors["model.audio_tower.conformer.0.norm.weight"] = torch.ones(8)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Gemma3nForConditionalGeneration"],
        "model_type": "gemma3n",
        "text_config": {**model.config.to_dict(), "model_type": "gemma3n_text"},
        **{
            key: {
                "model_type": f"gemma3n_{kind}",
                "hidden_size": MEDIA_VOCAB[name][1],
                "vocab_size": MEDIA_VOCAB_SIZE,
                "vocab_offset": MEDIA_VOCAB[name][0],
                "rms_norm_eps": 1e-6,
            }
            for key, kind, name in (
                ("vision_config", "vision", "embed_vision"),
                ("audio_config", "audio", "embed_audio"),
            )
        },
        "tie_word_embeddings": True,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory)
    return model, embedders


def slice_reference(full: Any) -> Any:
    """transformers' model of the MatFormer slice ``SLICE_NAME`` of ``full``: the sliced
    config written out by hand, the weights copied and cut from the full model."""
    from transformers import Gemma3nForCausalLM

    kept = [i for i in range(len(LAYER_TYPES)) if i not in SKIPPED]
    cfg = text_config(
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
