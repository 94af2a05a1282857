"""inferd.loading.dequant against gguf-py's numpy reference (gguf.quants.dequantize)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf import quants as gguf_quants

from inferd.loading import dequant
from inferd.loading.dequant import SUPPORTED_TYPES, UnsupportedTensorType, dequantize

Q = GGMLQuantizationType

ALL_TYPES = [
    Q.F32,
    Q.F16,
    Q.BF16,
    Q.Q4_0,
    Q.Q4_1,
    Q.Q5_0,
    Q.Q5_1,
    Q.Q8_0,
    Q.Q2_K,
    Q.Q3_K,
    Q.Q4_K,
    Q.Q5_K,
    Q.Q6_K,
]
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}

# Byte offsets of the f16 scale/min fields inside one block (ggml-common.h). Random bytes there
# would often decode to huge values, inf or NaN; they are overwritten with sane halves instead.
F16_FIELDS: dict[GGMLQuantizationType, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
}

# Types gguf.quants can also quantize, with a bound on the round-trip RMS error relative to
# the RMS of standard-normal data: a sanity check that the values mean something.
ROUND_TRIP_RMS: dict[GGMLQuantizationType, float] = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 5e-3,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.15,
    Q.Q5_0: 0.08,
    Q.Q5_1: 0.08,
    Q.Q8_0: 0.01,
}


def _rng(qtype: GGMLQuantizationType) -> np.random.Generator:
    return np.random.default_rng(1000 + int(qtype))


def _row_len(qtype: GGMLQuantizationType) -> int:
    """Two blocks per row (64 values for the float types), so rows span several blocks."""
    block_size = GGML_QUANT_SIZES[qtype][0]
    return 64 if block_size == 1 else 2 * block_size


def synthetic(qtype: GGMLQuantizationType, rows: int) -> np.ndarray:
    """Random raw data shaped as GGUFReader returns it for a (rows, _row_len) tensor."""
    rng = _rng(qtype)
    cols = _row_len(qtype)
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == Q.F16:
            return values.astype(np.float16)
        if qtype == Q.BF16:  # gguf gives BF16 as raw bytes: 2 per value
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        halves = rng.uniform(-2.0, 2.0, size=(blocks.shape[0],)).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    return np.asarray(gguf_quants.dequantize(raw, qtype), dtype=np.float32)


def test_supported_types_are_exactly_the_documented_ones() -> None:
    assert frozenset(ALL_TYPES) == SUPPORTED_TYPES
    assert set(F16_FIELDS) | FLOAT_TYPES == SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_synthetic_blocks_match_reference(qtype: GGMLQuantizationType) -> None:
    raw = synthetic(qtype, rows=5)
    expected = reference(raw, qtype)
    assert np.isfinite(expected).all()

    got = dequantize(raw, qtype, expected.shape)

    assert got.dtype == torch.float32
    assert got.is_contiguous()
    assert tuple(got.shape) == expected.shape
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_many_chunks_match_one_chunk(
    qtype: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = synthetic(qtype, rows=7)
    expected = reference(raw, qtype)
    # Chunks of 1-3 blocks, and a remainder, exercise the chunk loop.
    monkeypatch.setattr(dequant, "_CHUNK_ELEMENTS", 3 * GGML_QUANT_SIZES[qtype][0] // 2 + 1)
    np.testing.assert_array_equal(dequantize(raw, qtype, expected.shape).numpy(), expected)


@pytest.mark.parametrize("qtype", list(ROUND_TRIP_RMS), ids=lambda t: t.name)
def test_quantized_round_trip(qtype: GGMLQuantizationType) -> None:
    values = _rng(qtype).standard_normal((6, 256)).astype(np.float32)
    raw = gguf_quants.quantize(values, qtype)

    got = dequantize(raw, qtype, values.shape).numpy()

    np.testing.assert_array_equal(got, reference(raw, qtype))
    rms_error = float(np.sqrt(np.mean((got - values) ** 2)))
    assert rms_error <= ROUND_TRIP_RMS[qtype]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
def test_accepts_torch_tensors_and_other_shapes(qtype: GGMLQuantizationType) -> None:
    raw = synthetic(qtype, rows=4)
    expected = reference(raw, qtype)
    flat_bytes = torch.from_numpy(raw.reshape(-1).view(np.uint8).copy())
    as_3d = (2, 2, expected.shape[1])

    got_tensor = dequantize(torch.from_numpy(raw.copy()), qtype, expected.shape)
    got_bytes = dequantize(flat_bytes, qtype, as_3d)

    np.testing.assert_array_equal(got_tensor.numpy(), expected)
    np.testing.assert_array_equal(got_bytes.numpy(), expected.reshape(as_3d))


def test_bf16_as_torch_bfloat16() -> None:
    values = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    as_bf16 = values.to(torch.bfloat16)
    got = dequantize(as_bf16, Q.BF16, (3, 64))
    assert torch.equal(got, as_bf16.to(torch.float32))


def test_big_endian_float_arrays_are_read_by_value() -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = dequantize(values.astype(">f4"), Q.F32, (3, 4))
    got_half = dequantize(values.astype(">f2"), Q.F16, (3, 4))
    np.testing.assert_array_equal(got.numpy(), values)
    np.testing.assert_array_equal(got_half.numpy(), values)


def test_writable_f32_is_shared_read_only_f32_is_copied() -> None:
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    shared = dequantize(values, Q.F32, (2, 4))
    shared[0, 0] = 42.0
    assert values[0, 0] == 42.0

    frozen = values.copy()
    frozen.flags.writeable = False
    copied = dequantize(frozen, Q.F32, (2, 4))
    copied.add_(1)  # must neither warn nor write through to the read-only source
    assert frozen[0, 0] == 42.0


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.Q8_1, Q.TQ1_0, Q.I32], ids=lambda t: t.name)
def test_unsupported_type_is_named(qtype: GGMLQuantizationType) -> None:
    with pytest.raises(UnsupportedTensorType, match=qtype.name) as info:
        dequantize(np.zeros(1024, dtype=np.uint8), qtype, (4, 256))
    assert isinstance(info.value, ValueError)
    assert "Q4_K" in str(info.value)  # lists what is supported


def test_wrong_byte_count_is_rejected() -> None:
    raw = synthetic(Q.Q8_0, rows=2)
    with pytest.raises(ValueError, match="needs 136 bytes, got 135"):
        dequantize(raw.reshape(-1)[:-1], Q.Q8_0, (2, 64))


def test_row_not_a_whole_number_of_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(np.zeros(210, dtype=np.uint8), Q.Q6_K, (2, 128))


# --------------------------------------------------------------------------------------------
# Real tensors from SmolLM2-135M (Q4_1 weights, Q8_0 token embedding, F32 norms).
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tensors(smollm2_gguf: Path) -> Iterator[dict[str, ReaderTensor]]:
    reader = GGUFReader(smollm2_gguf)
    yield {t.name: t for t in reader.tensors}


@pytest.mark.parametrize(
    ("name", "qtype", "rows"),
    [
        pytest.param("token_embd.weight", Q.Q8_0, 64, id="token_embd-Q8_0"),
        pytest.param("blk.0.attn_q.weight", Q.Q4_1, 64, id="attn_q-Q4_1"),
        pytest.param("blk.29.ffn_down.weight", Q.Q4_1, 576, id="ffn_down-Q4_1"),
        pytest.param("blk.0.attn_norm.weight", Q.F32, None, id="attn_norm-F32"),
        pytest.param("output_norm.weight", Q.F32, None, id="output_norm-F32"),
    ],
)
def test_real_tensor_matches_reference(
    smollm2_tensors: dict[str, ReaderTensor],
    name: str,
    qtype: GGMLQuantizationType,
    rows: int | None,
) -> None:
    tensor = smollm2_tensors[name]
    assert tensor.tensor_type == qtype
    raw = tensor.data if rows is None else tensor.data[:rows]
    expected = reference(raw, qtype)

    got = dequantize(raw, qtype, expected.shape)

    np.testing.assert_array_equal(got.numpy(), expected)
    assert got.abs().max() > 0
