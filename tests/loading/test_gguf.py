"""inferd.loading.gguf: the real SmolLM2 file, small synthetic files, and bad inputs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from inferd.loading.gguf import GGUFError, GGUFFile, GGUFTensorInfo, GGUFTensorNotFound

Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> GGUFFile:
    return GGUFFile(smollm2_gguf)


@pytest.fixture(scope="module")
def stock_reader(smollm2_gguf: Path) -> Iterator[GGUFReader]:
    """gguf-py's own reader, the oracle for what GGUFFile decodes."""
    yield GGUFReader(smollm2_gguf)


def _is_plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(_is_plain(item) for item in value)
    return type(value) in (str, int, float, bool)


# --------------------------------------------------------------------------------------------
# The real file.
# --------------------------------------------------------------------------------------------


def test_smollm2_metadata(smollm2: GGUFFile) -> None:
    assert smollm2.architecture == "llama"
    assert smollm2.get("llama.block_count") == 30
    assert smollm2.get("llama.embedding_length") == 576
    assert smollm2.get("llama.attention.head_count_kv") == 3
    assert smollm2.get("llama.rope.freq_base") == 100000.0
    assert smollm2.get("llama.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert smollm2.get("tokenizer.ggml.add_bos_token") is False
    assert smollm2.get("tokenizer.ggml.model") == "gpt2"
    assert smollm2.get("no.such.key") is None
    assert smollm2.get("no.such.key", 7) == 7


def test_smollm2_tokenizer_lists(smollm2: GGUFFile) -> None:
    tokens = smollm2.get("tokenizer.ggml.tokens")
    token_types = smollm2.get("tokenizer.ggml.token_type")
    merges = smollm2.get("tokenizer.ggml.merges")

    assert len(tokens) == 49152 == smollm2.get("llama.vocab_size")
    assert all(type(t) is str for t in tokens)
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(token_types) == 49152
    assert all(type(t) is int for t in token_types)
    assert len(merges) == 48900
    assert merges[0] == "Ġ t"
    template = smollm2.get("tokenizer.chat_template")
    assert isinstance(template, str)
    assert "<|im_start|>" in template


def test_smollm2_metadata_is_plain_python_and_matches_gguf(
    smollm2: GGUFFile, stock_reader: GGUFReader
) -> None:
    expected = {
        k: f.contents() for k, f in stock_reader.fields.items() if not k.startswith("GGUF.")
    }
    assert smollm2.metadata == expected
    assert not any(key.startswith("GGUF.") for key in smollm2.metadata)
    assert all(_is_plain(value) for value in smollm2.metadata.values())


def test_smollm2_tensor_infos(smollm2: GGUFFile, stock_reader: GGUFReader) -> None:
    infos = smollm2.tensor_infos()

    assert len(infos) == 272
    assert infos[0] == GGUFTensorInfo("token_embd.weight", Q.Q8_0, (49152, 576))
    by_name = {info.name: info for info in infos}
    assert by_name["blk.0.ffn_down.weight"] == GGUFTensorInfo(
        "blk.0.ffn_down.weight", Q.Q4_1, (576, 1536)
    )
    assert by_name["output_norm.weight"].shape == (576,)
    assert {t.name: t.tensor_type for t in stock_reader.tensors} == {
        info.name: info.qtype for info in infos
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        infos[0].name = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.3.attn_k.weight", "blk.7.ffn_norm.weight"]
)
def test_smollm2_load_tensor_matches_gguf(
    smollm2: GGUFFile, stock_reader: GGUFReader, name: str
) -> None:
    (tensor,) = (t for t in stock_reader.tensors if t.name == name)
    expected = gguf_quants.dequantize(tensor.data, tensor.tensor_type)

    got = smollm2.load_tensor(name)

    assert got.dtype == torch.float32
    assert got.is_contiguous()
    np.testing.assert_array_equal(got.numpy(), expected)


def test_loaded_tensor_is_private(smollm2: GGUFFile) -> None:
    """In-place ops on a result must not touch the (read-only) mapping or later loads."""
    first = smollm2.load_tensor("output_norm.weight")
    before = first.clone()
    first.mul_(2)
    assert torch.equal(smollm2.load_tensor("output_norm.weight"), before)


def test_missing_tensor(smollm2: GGUFFile) -> None:
    with pytest.raises(GGUFTensorNotFound) as info:
        smollm2.load_tensor("blk.99.attn_q.weight")
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, GGUFError)
    assert str(info.value).startswith("tensor 'blk.99.attn_q.weight' not found in ")


# --------------------------------------------------------------------------------------------
# Small synthetic files: every metadata value type, the float and a block tensor type.
# --------------------------------------------------------------------------------------------

F32_VALUES = np.arange(-6, 6, dtype=np.float32).reshape(3, 4) / 4
BLOCK_VALUES = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)


def _write(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    writer = GGUFWriter(path, "testarch", endianess=endian)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.5)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.yes", True)
    writer.add_bool("t.no", False)
    writer.add_string("t.text", "héllo ✓ 世界")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, 1.5])
    writer.add_array("t.strings", ["a", "Ġb", ""])
    writer.add_array("t.bools", [True, False])
    writer.add_tensor("f32", F32_VALUES)
    writer.add_tensor("f16", F32_VALUES.astype(np.float16))
    writer.add_tensor("bf16", gguf_quants.quantize(F32_VALUES, Q.BF16), raw_dtype=Q.BF16)
    writer.add_tensor("q8_0", gguf_quants.quantize(BLOCK_VALUES, Q.Q8_0), raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    return GGUFFile(_write(tmp_path_factory.mktemp("gguf") / "synthetic.gguf"))


def test_synthetic_metadata_types(synthetic: GGUFFile) -> None:
    assert synthetic.architecture == "testarch"
    expected: dict[str, Any] = {
        "t.u8": 200,
        "t.i8": -100,
        "t.u16": 60000,
        "t.i16": -30000,
        "t.u32": 4_000_000_000,
        "t.i32": -2_000_000_000,
        "t.u64": 2**63,
        "t.i64": -(2**62),
        "t.f32": 0.5,
        "t.f64": 0.1,
        "t.yes": True,
        "t.no": False,
        "t.text": "héllo ✓ 世界",
        "t.ints": [1, -2, 3],
        "t.floats": [0.25, 1.5],
        "t.strings": ["a", "Ġb", ""],
        "t.bools": [True, False],
    }
    for key, value in expected.items():
        got = synthetic.get(key)
        assert got == value, key
        assert type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key


def test_synthetic_tensors(synthetic: GGUFFile) -> None:
    assert synthetic.tensor_infos() == [
        GGUFTensorInfo("f32", Q.F32, (3, 4)),
        GGUFTensorInfo("f16", Q.F16, (3, 4)),
        GGUFTensorInfo("bf16", Q.BF16, (3, 4)),
        GGUFTensorInfo("q8_0", Q.Q8_0, (2, 64)),
    ]
    # These values are exact in f16 and bf16.
    for name in ("f32", "f16", "bf16"):
        np.testing.assert_array_equal(synthetic.load_tensor(name).numpy(), F32_VALUES)
    q8 = synthetic.load_tensor("q8_0").numpy()
    np.testing.assert_allclose(q8, BLOCK_VALUES, atol=0.01)


def test_big_endian_file(tmp_path: Path) -> None:
    """Byte-swapped files: metadata and plain float tensors work, block types are refused."""
    big = GGUFFile(_write(tmp_path / "big.gguf", GGUFEndian.BIG))
    assert big.get("t.u32") == 4_000_000_000
    assert big.get("t.strings") == ["a", "Ġb", ""]
    np.testing.assert_array_equal(big.load_tensor("f32").numpy(), F32_VALUES)
    np.testing.assert_array_equal(big.load_tensor("f16").numpy(), F32_VALUES)
    with pytest.raises(GGUFError, match="big-endian"):
        big.load_tensor("q8_0")


# --------------------------------------------------------------------------------------------
# Files that are missing or not GGUF.
# --------------------------------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.gguf"
    with pytest.raises(GGUFError, match="not found") as info:
        GGUFFile(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="not found"):
        GGUFFile(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"GG", id="too-short"),
        pytest.param(b"this is a text file, not a model\n" * 10, id="text"),
        pytest.param(b"GGUF\x63\x00\x00\x00" + bytes(16), id="unknown-version"),
    ],
)
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(GGUFError, match="not a valid GGUF file") as info:
        GGUFFile(path)
    assert str(path) in str(info.value)


def test_truncated_gguf(tmp_path: Path, smollm2_gguf: Path) -> None:
    path = tmp_path / "truncated.gguf"
    with smollm2_gguf.open("rb") as f:
        path.write_bytes(f.read(64 * 1024))  # cuts through the token list
    with pytest.raises(GGUFError, match="not a valid GGUF file"):
        GGUFFile(path)


def test_invalid_utf8_metadata_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad-utf8.gguf"
    writer = GGUFWriter(path, "testarch")
    writer.add_key_value("t.bad", b"\xff\xfe", GGUFValueType.STRING)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"'t\.bad' holds invalid UTF-8"):
        GGUFFile(path)
