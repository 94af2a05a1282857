"""Candidate releases for the gate's tests: a GGUF rewritten with another chat template, a
changed tokenizer, or its 4-bit tensors requantized to another 4-bit format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def rewrite(
    src: Path,
    dst: Path,
    *,
    metadata: dict[str, Any] | None = None,
    requantize: tuple[GGMLQuantizationType, GGMLQuantizationType] | None = None,
) -> Path:
    """``src`` copied to ``dst`` with ``metadata``'s keys replaced and, with ``requantize``
    (from, to), every tensor of the first type stored in the second."""
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    replaced = metadata or {}
    for name, field in reader.fields.items():
        if name == "general.architecture" or name.startswith("GGUF."):
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(name, replaced.get(name, field.contents()), kind, sub_type=sub)
    tensors = []
    for tensor in reader.tensors:
        data, qtype = tensor.data, tensor.tensor_type
        if requantize is not None and qtype == requantize[0]:
            data, qtype = quantize(dequantize(data, qtype), requantize[1]), requantize[1]
        tensors.append(data)
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return dst
