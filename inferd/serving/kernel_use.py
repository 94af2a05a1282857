"""Which kernels a served model's decoder really runs, for ``GET /v1/system/info``: the server
asks the question, the layers below serving hold the answer."""

from __future__ import annotations

from inferd.layers.linear import Linear, PackedKind
from inferd.serving.served import ServedModel

_INT4 = (PackedKind.INT4, PackedKind.INT4_ROWS, PackedKind.INT4_VNNI)
_INT8 = (PackedKind.INT8, PackedKind.INT8_VNNI)


def kernel_use(model: ServedModel) -> dict[str, int | str]:
    """The decoder's linear layers by packed weight kind, how many dropped their dense copy,
    and the kernel set it runs on."""
    decoder = model.engine.engine.model
    linears = [m for m in decoder.modules() if isinstance(m, Linear)]
    return {
        "linear_layers": len(linears),
        "packed_int4": sum(m.packed_kind in _INT4 for m in linears),
        "packed_int8": sum(m.packed_kind in _INT8 for m in linears),
        "dense_dropped": sum(not m.dense for m in linears),
        "fused": decoder.ops.description,
    }
