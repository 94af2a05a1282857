"""Importance matrices: the collector against transformers' own activations (a mixture of
experts' per expert), llama.cpp's file formats (written and read, and a file laid out as
llama.cpp writes it, built with gguf-py), and quantization weighted by importance against plain
rounding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from inferd.layers.linear import Linear, PackedKind
from inferd.loading.calibration import calibration_chunks, compute_imatrix
from inferd.loading.imatrix import Imatrix, ImatrixCollector, ImatrixError
from inferd.loading.imatrix_file import read_imatrix, write_imatrix
from inferd.loading.model import load
from inferd.loading.quantize import QuantizeError, quantize_weight
from tests.layers.test_moe import EXPERTS, ROWS, TOP_K, qwen_block, rows
from tests.models.tiny import CORPUS, save_tiny

# Our projection -> the transformers Linear that reads the same input (q, k and v share theirs).
HF_INPUTS = {
    "self_attn.qkv_proj": "self_attn.q_proj",
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_up_proj": "mlp.gate_proj",
    "mlp.down_proj": "mlp.down_proj",
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("tiny-llama")
    return directory, save_tiny("llama", directory)  # its own output head: observed too


def _hf_sums(hf: Any, chunks: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each transformers Linear's sum of squared inputs over the chunks, by forward hooks."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Any:
        def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.square().sum(0)

        return record

    handles = [
        m.register_forward_pre_hook(hook(n))
        for n, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]
    with torch.inference_mode():
        for chunk in chunks:
            hf(torch.tensor([chunk]))
    for h in handles:
        h.remove()
    return sums


def test_collector_sums_what_transformers_feeds_each_projection(
    tiny_llama: tuple[Path, Any],
) -> None:
    directory, hf = tiny_llama
    loaded = load(str(directory), dtype="f32", packed_kernels=False, progress=False)
    text = " ".join(CORPUS)
    imatrix = compute_imatrix(
        loaded.model, loaded.tokenizer, text, chunk_size=24, dataset="corpus", progress=False
    )
    chunks = calibration_chunks(loaded.tokenizer, text, 24)
    assert len(chunks) >= 3 and imatrix.chunk_count == len(chunks)
    expected = _hf_sums(hf, chunks)
    theirs = {
        f"layers.{i}.{ours}": f"model.layers.{i}.{name}"
        for i in range(hf.config.num_hidden_layers)
        for ours, name in HF_INPUTS.items()
    } | {"lm_head": "lm_head"}
    assert set(imatrix.sums) == set(theirs)
    for ours, name in theirs.items():
        assert imatrix.counts[ours] == 24 * len(chunks)
        torch.testing.assert_close(imatrix.sums[ours], expected[name], rtol=1e-5, atol=1e-6)
    assert (imatrix.datasets, imatrix.chunk_size) == (("corpus",), 24)


def test_collector_leaves_the_model_as_it_was(tiny_llama: tuple[Path, Any]) -> None:
    loaded = load(str(tiny_llama[0]), dtype="f32", packed_kernels=False, progress=False)
    layer = loaded.model.layers[0].mlp.down_proj
    collector = ImatrixCollector(loaded.model, ["layers.0.mlp.down_proj"])
    with collector:
        assert "forward" in vars(layer)
        x = torch.randn(5, layer.in_features)
        layer.forward(x)
        with pytest.raises(ImatrixError, match="already started"):
            collector.start()
    assert "forward" not in vars(layer)
    layer.forward(x)  # not observed any more
    imatrix = collector.imatrix()
    assert set(imatrix.sums) == {"layers.0.mlp.down_proj"}
    assert imatrix.counts["layers.0.mlp.down_proj"] == 5
    torch.testing.assert_close(imatrix.sums["layers.0.mlp.down_proj"], x.double().square().sum(0))


def test_collector_observes_each_expert_over_the_rows_routed_to_it() -> None:
    """Each expert's projections count and sum the rows its router sends it, no others: against
    transformers' Qwen3-VL-MoE block on the same weights (its router's picks, and each expert's
    down projection input from its own stacks)."""
    theirs, ours = qwen_block()
    x = rows(torch.float32)
    with torch.no_grad(), ImatrixCollector(ours) as collector:
        ours(x)
        _, _, picked = theirs.gate(x)
        stacks = theirs.experts
        imatrix = collector.imatrix()
        for e in range(EXPERTS):
            routed = x[(picked == e).any(-1)]
            gate, up = torch.nn.functional.linear(routed, stacks.gate_up_proj[e]).chunk(2, -1)
            inputs = {"gate_up_proj": routed, "down_proj": torch.nn.functional.silu(gate) * up}
            for projection, seen in inputs.items():
                name = f"experts.{projection}.{e}"
                assert imatrix.counts[name] == len(routed) > 0
                torch.testing.assert_close(
                    imatrix.sums[name], seen.double().square().sum(0), rtol=1e-5, atol=1e-6
                )
    assert sum(imatrix.counts[f"experts.gate_up_proj.{e}"] for e in range(EXPERTS)) == ROWS * TOP_K


def test_the_file_names_llama_cpp_tensors(tiny_llama: tuple[Path, Any], tmp_path: Path) -> None:
    """Read back by gguf-py's own reader: llama.cpp's keys, its tensor names and shapes (q, k and
    v each with the sums of their shared input), and no architecture."""
    directory, hf = tiny_llama
    loaded = load(str(directory), dtype="f32", packed_kernels=False, progress=False)
    imatrix = compute_imatrix(
        loaded.model, loaded.tokenizer, " ".join(CORPUS), chunk_size=24, progress=False
    )
    chunks = calibration_chunks(loaded.tokenizer, " ".join(CORPUS), 24)
    expected = _hf_sums(hf, chunks)
    path = tmp_path / "imatrix.gguf"
    write_imatrix(imatrix, path, loaded.config.architecture)
    reader = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    assert fields["general.type"] == "imatrix" and "general.architecture" not in fields
    assert fields["imatrix.chunk_count"] == len(chunks) and fields["imatrix.chunk_size"] == 24
    tensors = {t.name: t for t in reader.tensors}
    layers = hf.config.num_hidden_layers
    parts = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
    names = {f"blk.{i}.{p}.weight" for i in range(layers) for p in parts} | {"output.weight"}
    assert set(tensors) == {n + s for n in names for s in (".in_sum2", ".counts")}
    hf_of = {"attn_k": "self_attn.k_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for part, module in hf_of.items():
        sums = tensors[f"blk.1.{part}.weight.in_sum2"]
        assert sums.data.shape == (1, expected[f"model.layers.1.{module}"].numel())
        torch.testing.assert_close(
            torch.from_numpy(np.array(sums.data[0])).double(),
            expected[f"model.layers.1.{module}"],
            rtol=1e-5,
            atol=1e-5,
        )
        assert tensors[f"blk.1.{part}.weight.counts"].data.tolist() == [[24.0 * len(chunks)]]


def _matrix(seed: int = 0) -> Imatrix:
    g = torch.Generator().manual_seed(seed)
    modules = {
        "layers.0.self_attn.qkv_proj": 64,
        "layers.0.mlp.down_proj": 96,
        "layers.1.mlp.gate_up_proj": 64,
        "lm_head": 64,
        "vision.merger.proj": 32,  # no llama.cpp name: kept under ours
    }
    sums = {m: torch.rand(n, generator=g, dtype=torch.float64) * 50 for m, n in modules.items()}
    counts = {m: 300 + 7 * i for i, m in enumerate(modules)}
    return Imatrix(sums, counts, ("wiki.train.raw", "more.txt"), 4, 128)


def _as_stored(imatrix: Imatrix) -> dict[str, torch.Tensor]:
    return {m: s.float().double() for m, s in imatrix.sums.items()}


def test_gguf_round_trip(tmp_path: Path) -> None:
    imatrix = _matrix()
    path = tmp_path / "m.gguf"
    write_imatrix(imatrix, path, "llama")
    back = read_imatrix(path)
    assert back.counts == imatrix.counts
    for module, sums in _as_stored(imatrix).items():
        assert torch.equal(back.sums[module], sums)
        # what quantization reads: the same whether collected here or read from the file
        assert torch.equal(back.importance(module), imatrix.importance(module))  # type: ignore[arg-type]
    assert (back.datasets, back.chunk_count, back.chunk_size) == (imatrix.datasets, 4, 128)
    assert back.digest() == imatrix.digest()


def test_phi3_fuses_as_llama_cpp_names_it(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_imatrix(_matrix(), path, "phi3")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_qkv.weight.in_sum2" in names and "blk.1.ffn_up.weight.in_sum2" in names
    assert not any("attn_q." in n or "ffn_gate" in n for n in names)
    assert read_imatrix(path).digest() == _matrix().digest()


def test_legacy_dat_round_trip(tmp_path: Path) -> None:
    """The .dat keeps means, counts in whole chunks and the last dataset's name."""
    imatrix = _matrix()
    path = tmp_path / "m.dat"
    write_imatrix(imatrix, path, "llama", legacy=True)
    assert path.read_bytes()[:4] != b"GGUF"
    back = read_imatrix(path, legacy_chunk_size=128)
    assert set(back.sums) == set(imatrix.sums)
    for module, count in imatrix.counts.items():
        assert back.counts[module] == -(-count // 128) * 128
        mine, theirs = imatrix.importance(module), back.importance(module)
        assert mine is not None and theirs is not None
        torch.testing.assert_close(theirs, mine, rtol=1e-6, atol=0)
    assert (back.datasets, back.chunk_count) == (("more.txt",), 4)


class _LlamaCppWriter(gguf.GGUFWriter):
    def add_architecture(self) -> None:  # llama.cpp's imatrix files name none
        pass


def _llama_cpp_file(path: Path, entries: dict[str, tuple[np.ndarray, float]]) -> None:
    """An imatrix laid out as llama.cpp's tools/imatrix writes it (in_sum too, as newer ones)."""
    writer = _LlamaCppWriter(str(path), arch="")
    writer.add_string("general.type", "imatrix")
    writer.add_array("imatrix.datasets", ["calibration.txt"])
    writer.add_uint32("imatrix.chunk_count", 10)
    writer.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, count) in entries.items():
        writer.add_tensor(f"{name}.in_sum", np.sqrt(sums).astype(np.float32))
        writer.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        writer.add_tensor(f"{name}.counts", np.full((sums.shape[0], 1), count, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reads_a_file_in_llama_cpp_layout(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.random((1, 64)) * 10 for _ in range(3))  # q, k, v unequal: the mean is read
    down, head = rng.random((1, 96)), rng.random((1, 64))
    entries = {
        "blk.0.attn_q.weight": (q, 5120.0),
        "blk.0.attn_k.weight": (k, 5120.0),
        "blk.0.attn_v.weight": (v, 5120.0),
        "blk.0.ffn_down.weight": (down, 5120.0),
        "output.weight": (head, 2560.0),
    }
    path = tmp_path / "llama.imatrix.gguf"
    _llama_cpp_file(path, entries)
    imatrix = read_imatrix(path)
    assert set(imatrix.sums) == {"layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj", "lm_head"}
    qkv = imatrix.importance("layers.0.self_attn.qkv_proj")
    assert qkv is not None
    expected = (q + k + v).astype(np.float32).astype(np.float64)[0] / 3 / 5120
    np.testing.assert_allclose(qkv.numpy(), expected, rtol=1e-6)
    assert imatrix.counts["lm_head"] == 2560
    assert (imatrix.datasets, imatrix.chunk_count, imatrix.chunk_size) == (
        ("calibration.txt",),
        10,
        512,
    )


def test_refuses_what_is_not_a_dense_models_imatrix(tmp_path: Path, smollm2_gguf: Path) -> None:
    experts = tmp_path / "moe.gguf"
    _llama_cpp_file(experts, {"blk.0.ffn_down_exps.weight": (np.ones((4, 32)), 100.0)})
    with pytest.raises(ImatrixError, match="mixture of experts"):
        read_imatrix(experts)
    with pytest.raises(ImatrixError, match="not an importance matrix"):
        read_imatrix(smollm2_gguf)
    garbage = tmp_path / "garbage.dat"
    garbage.write_bytes(b"\x02\x00\x00\x00\xff\xff\xff\x7f")
    with pytest.raises(ImatrixError, match="neither a GGUF nor"):
        read_imatrix(garbage)
    with pytest.raises(ImatrixError, match="cannot read"):
        read_imatrix(tmp_path / "missing.gguf")


# --- weighted quantization ----------------------------------------------------------------------


def _skewed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [128, 256] and an importance spanning ~5 orders of magnitude, a few columns
    dominant (what activations' outlier channels look like)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(128, 256, generator=g)
    importance = torch.exp(2.5 * torch.randn(256, generator=g))
    return w, importance


def _weighted_error(w: torch.Tensor, approx: torch.Tensor, importance: torch.Tensor) -> float:
    return float((importance * (approx - w).square()).sum())


# Measured on seeds 0-2: int4 0.17-0.27 of plain rounding's weighted error, int8 0.69-0.84.
@pytest.mark.parametrize(("kind", "bound"), [(PackedKind.INT4, 0.5), (PackedKind.INT8, 0.9)])
def test_importance_lowers_the_weighted_error(kind: PackedKind, bound: float) -> None:
    w, importance = _skewed()
    plain = quantize_weight(w, kind)
    weighted = quantize_weight(w, kind, importance)
    assert weighted.kind is kind
    ratio = _weighted_error(w, weighted.dequantize(), importance) / _weighted_error(
        w, plain.dequantize(), importance
    )
    assert ratio < bound


def test_weighted_weights_are_what_the_kernel_multiplies_by() -> None:
    w, importance = _skewed(1)
    weight = quantize_weight(w, PackedKind.INT4, importance)
    layer = Linear(256, 128).to(torch.bfloat16)
    layer.use_packed_only(weight.kind, *weight.kernel_tensors(torch.bfloat16))
    eye = torch.eye(256, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(eye).T.float(), weight.dequantize(), atol=3e-2, rtol=1e-2)


def test_no_tokens_means_plain_rounding_and_a_wrong_size_is_refused() -> None:
    w, _ = _skewed()
    for kind in (PackedKind.INT4, PackedKind.INT8):
        plain, unweighted = quantize_weight(w, kind), quantize_weight(w, kind, torch.zeros(256))
        assert torch.equal(plain.q, unweighted.q) and torch.equal(plain.scale, unweighted.scale)
    with pytest.raises(QuantizeError, match="256 inputs"):
        quantize_weight(w, PackedKind.INT4, torch.ones(128))
