"""Re-quantizing a loaded model in place (mistral.rs's re-ISQ: ``POST /re_isq``,
``ServedModel.requantize``).

The new weights come from the model's files, read again as a load reads them (a GGUF's blocks
dequantized to float32, a checkpoint's tensors in float32), and quantized as ``--isq`` quantizes
them at load time (``Isq``), never from what the model holds now: a GGUF-quantized or already
ISQ'd model is not quantized a second time on top of its rounding, and the result is the
model a load under ``--isq METHOD`` would have built, projection for projection.

``prepare`` does all of that without touching the model, so it runs while the model still
serves and a failure leaves it as it was; ``Requantized.install`` then swaps every projection's
kernel tensors (assignments only) and must run between two engine steps with no request
mid-way (``ServedModel.swap_weights`` does both).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inferd.layers.linear import Linear, PackedWeight, packed_on_huge_pages
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import decoder_sources as gguf_sources
from inferd.loading.hf_model import decoder_sources as hf_sources
from inferd.loading.projector import open_projector
from inferd.loading.quantize import Isq, QuantizeError, kernel_form
from inferd.loading.safetensors import SafetensorsCheckpoint
from inferd.loading.weights import WeightSource, isq_projections
from inferd.models.llama import LlamaForCausalLM
from inferd.source import ModelSource


@dataclass(frozen=True, slots=True)
class Requantized:
    """Every projection ``isq`` quantizes, with the kernel tensors it will serve from."""

    isq: Isq
    layers: tuple[tuple[Linear, PackedWeight], ...]

    def install(self, model: LlamaForCausalLM) -> None:
        """Serve every projection from its new tensors (between two engine steps)."""
        for layer, packed in self.layers:
            layer.use_packed_only(*packed)
        # The decode stack (models/decode_stack.py) holds the old copies: built again on the
        # same ops at the next decode step.
        model.use_kernels(model.ops)
        packed_on_huge_pages(model)  # side by side, as a load under --isq leaves them


def prepare(
    model: LlamaForCausalLM, source: ModelSource, isq: Isq, projector: Path | None = None
) -> Requantized:
    """The projections of ``model`` (loaded from ``source``, its encoders from the ``--mmproj``
    file ``projector`` where it had one) quantized by ``isq``, read from the files; the model
    is not touched. QuantizeError (and the readers' errors) when the files no longer hold them."""
    layers = []
    for src in _sources(model, source, projector):
        projections = isq_projections(model, src.target, isq)
        if projections:
            weight = src.read()  # one projection's, or an expert stack's (every expert's)
            layers += [
                (p.layer, kernel_form(p.layer, isq.weight(p.name, p.weight(weight))))
                for p in projections
            ]
    if not layers:
        raise QuantizeError(f"{source.name} has no projection in-situ quantization applies to")
    return Requantized(isq, tuple(layers))


def _sources(
    model: LlamaForCausalLM, source: ModelSource, projector: Path | None
) -> list[WeightSource]:
    """How the load read each parameter, for the model as it is now configured."""
    if source.path.is_dir():
        return hf_sources(source.path, SafetensorsCheckpoint(source.path), model)
    gguf = GGUFFile(source.path)
    sources = gguf_sources(gguf, model.config)
    if projector is not None:  # Gemma 4's encoders hold projections too (an --isq load's)
        sources += open_projector(projector, gguf.metadata).weight_sources()
    return sources
