"""The tiny random Idefics3 checkpoint (tests/models/tiny_vlm.py) as llama.cpp ships a
vision-language model: a language model GGUF (the Llama decoder, the tokenizer with the image
tokens, the chat template) and a multimodal projector GGUF (``mmproj``: the SigLIP encoder and
the connector), both written with ``gguf``'s writer in the names and keys llama.cpp's
convert_hf_to_gguf.py gives a SmolVLM (``--mmproj`` for the projector)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from tests.models.tiny import write_gguf
from tests.models.tiny_vlm import VLM_TEMPLATE, vlm_tokenizer

# transformers' names under model.vision_model.encoder.layers.N -> llama.cpp's under v.blk.N
_LAYER_NAMES = {
    "layer_norm1": "ln1",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "layer_norm2": "ln2",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}


def write_language_model(hf: Any, path: Path, tokenizer: Tokenizer | None = None) -> None:
    """The decoder of ``hf`` (an Idefics3ForConditionalGeneration) as a Llama GGUF, with the
    VLM tokenizer (or ``tokenizer``) and template, as llama.cpp converts SmolVLM's text
    model."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        llama = LlamaForCausalLM(hf.config.text_config)
    llama.model = hf.model.text_model
    llama.lm_head = hf.lm_head
    write_gguf(llama, path, tokenizer=tokenizer or vlm_tokenizer(), chat_template=VLM_TEMPLATE)


def mmproj_tensors(hf: Any) -> dict[str, torch.Tensor]:
    """The encoder and connector of ``hf`` under llama.cpp's projector names."""
    v, c = hf.model.vision_model, hf.model.connector
    out = {
        "v.patch_embd.weight": v.embeddings.patch_embedding.weight,
        "v.patch_embd.bias": v.embeddings.patch_embedding.bias,
        "v.position_embd.weight": v.embeddings.position_embedding.weight,
        "v.post_ln.weight": v.post_layernorm.weight,
        "v.post_ln.bias": v.post_layernorm.bias,
        "mm.model.fc.weight": c.modality_projection.proj.weight,
    }
    for i, layer in enumerate(v.encoder.layers):
        for ours, theirs in _LAYER_NAMES.items():
            module = layer.get_submodule(ours)
            out[f"v.blk.{i}.{theirs}.weight"] = module.weight
            out[f"v.blk.{i}.{theirs}.bias"] = module.bias
    return {name: t.detach().float() for name, t in out.items()}


def write_mmproj(
    hf: Any,
    image_processor: Any,
    path: Path,
    *,
    projector_type: str = "idefics3",
    longest_edge: bool = True,
    connector_width: int | None = None,
    feed_forward_length: int | None = None,
    f16: bool = False,
) -> None:
    """``hf``'s projector file, its image settings from ``image_processor`` as the converter
    takes them (``size.longest_edge`` -> ``preproc_image_size``). The keywords make broken
    files: another ``projector_type``, no ``preproc_image_size`` (an older converter), a
    connector of ``connector_width`` outputs, metadata saying another
    ``feed_forward_length`` than the tensors have; ``f16`` stores the matrices in half precision,
    as the converter does by default."""
    import gguf

    vc, text = hf.config.vision_config, hf.config.text_config
    tensors = mmproj_tensors(hf)
    width = connector_width or text.hidden_size
    tensors["mm.model.fc.weight"] = tensors["mm.model.fc.weight"][:width]
    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector_type)
    writer.add_vision_projection_dim(width)
    writer.add_vision_image_size(vc.image_size)
    writer.add_vision_patch_size(vc.patch_size)
    writer.add_vision_embedding_length(vc.hidden_size)
    writer.add_vision_feed_forward_length(feed_forward_length or vc.intermediate_size)
    writer.add_vision_block_count(vc.num_hidden_layers)
    writer.add_vision_head_count(vc.num_attention_heads)
    writer.add_vision_image_mean(list(image_processor.image_mean))
    writer.add_vision_image_std(list(image_processor.image_std))
    writer.add_vision_attention_layernorm_eps(vc.layer_norm_eps)
    writer.add_vision_projector_scale_factor(hf.config.scale_factor)
    writer.add_vision_use_gelu(True)
    if longest_edge:
        writer.add_vision_preproc_image_size(image_processor.size["longest_edge"])
    for name, t in tensors.items():
        # the converter keeps the embeddings, norms and biases in f32 (tensor_force_quant)
        half = f16 and t.ndim >= 2 and "embd" not in name
        writer.add_tensor(name, (t.half() if half else t).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_smolvlm_ggufs(hf: Any, image_processor: Any, directory: Path) -> tuple[Path, Path]:
    """``lm.gguf`` and ``mmproj.gguf`` in ``directory``; returns their paths."""
    lm, proj = directory / "lm.gguf", directory / "mmproj.gguf"
    write_language_model(hf, lm)
    write_mmproj(hf, image_processor, proj)
    return lm, proj
