"""Qwen3-VL's decoder from a GGUF in llama.cpp's layout (convert_hf_to_gguf.py's
``Qwen3VLTextModel``, ``general.architecture`` ``qwen3vl``; ``Qwen3VLMoeTextModel``,
``qwen3vlmoe``): its config from the file's keys and, for the mixture of experts, its tensors.

The converter writes the text model as llama.cpp's Qwen3 (``Qwen3Model``, ``Qwen3MoeModel``):
the same keys under the file's own name, the tensors as transformers holds them (no Q/K row
permutation, norms scaled by ``w``), plus ``rope.dimension_sections`` (the M-RoPE sections,
padded to four) and ``n_deepstack_layers`` (how many layers the encoder's deep stack feeds).
So the decoder is read as a Qwen3's; the experts of a ``qwen3vlmoe`` layer are its
``ffn_gate_inp`` router and ``ffn_{gate,up,down}_exps`` stacks, each expert's matrix as
transformers 5 holds it (the converter transposed the published checkpoints' stacks).

Alone, the language model serves text as the Qwen3 decoder it is: over text, M-RoPE's three
positions are one and the same, which is plain RoPE. The projector (loading/mmproj_qwen3vl.py)
makes it Qwen3-VL: the encoder, interleaved M-RoPE over these sections, the deep stack.
"""

from __future__ import annotations

from dataclasses import replace

from inferd.loading.gguf import GGUFFile
from inferd.models.config import (
    ModelConfig,
    ModelConfigError,
    MoeConfig,
    config_from_gguf,
    gguf_key,
)

QWEN3VL_ARCHITECTURES = frozenset({"qwen3vl", "qwen3vlmoe"})
_DECODER = "qwen3"  # the llama.cpp architecture whose keys and tensors the text model's are


def qwen3vl_config(gguf: GGUFFile) -> ModelConfig:
    """The text decoder's config (a Qwen3's, with the experts the file holds);
    ModelConfigError for what the file lacks or inferd cannot run."""
    meta = gguf.metadata
    arch = str(meta.get("general.architecture"))
    shapes = {i.name: i.shape for i in gguf.tensor_infos()}
    shared = [n for n in shapes if "_shexp." in n]
    if shared:
        raise ModelConfigError(
            f"{gguf.path}: {arch} with shared experts ({shared[0]}) is not supported"
        )
    as_qwen3 = {_renamed(key, arch): value for key, value in meta.items()}
    as_qwen3["general.architecture"] = _DECODER
    decoder = config_from_gguf(as_qwen3, has_output_tensor="output.weight" in shapes)
    return replace(decoder, moe=_experts(gguf, arch, decoder.num_layers, shapes))


def _renamed(key: str, arch: str) -> str:
    return _DECODER + key[len(arch) :] if key.startswith(arch + ".") else key


def _experts(
    gguf: GGUFFile, arch: str, layers: int, shapes: dict[str, tuple[int, ...]]
) -> MoeConfig | None:
    """The layers whose MLP is a mixture of experts (those with a router), and its shape from
    the ``expert_*`` keys; None without any."""
    sparse = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in shapes)
    if not sparse:
        return None
    shape = {}
    for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
        shape[key] = int(gguf_key(gguf.metadata, arch, key))
    return MoeConfig(
        num_experts=shape["expert_count"],
        top_k=shape["expert_used_count"],
        intermediate_size=shape["expert_feed_forward_length"],
        layers=sparse,
    )
