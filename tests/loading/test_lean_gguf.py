"""GGUF weights kept in the kernels' packed layout alone (loading/gguf_model.py's
``_packed_reader``): exact 4-bit groups, the file's values back, lookups, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from inferd.config import EngineConfig
from inferd.layers.embedding import Embedding
from inferd.layers.linear import VNNI_KINDS, Linear, PackedKind, dequantize_packed
from inferd.layers.rotary import RotaryEmbedding
from inferd.loading.dequant import INT4_GROUP_TYPES, int4_groups
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model, unpermute_rope
from inferd.loading.weights import build_empty
from inferd.models.config import LLAMA_FAMILY
from inferd.models.llama import LlamaForCausalLM
from inferd.serving.served import load_model
from tests.loading.test_dequant import reference, synthetic
from tests.machine import vnni_missing

Q = GGMLQuantizationType
# The packed-only layout is the VNNI kernels' (elsewhere weights stay dense beside a copy).
NO_VNNI = vnni_missing()
LEAN = pytest.mark.skipif(NO_VNNI is not None, reason=str(NO_VNNI))


@pytest.mark.parametrize("qtype", sorted(INT4_GROUP_TYPES))
def test_int4_groups_are_the_blocks_values(qtype: GGMLQuantizationType) -> None:
    raw = synthetic(qtype, 8)
    values = torch.from_numpy(reference(raw, qtype))
    rows, cols = values.shape
    codes, scale, lo = int4_groups(raw, qtype, (rows, cols))
    assert (
        codes.dtype == torch.uint8 and int(codes.max()) <= 15 and scale.shape == (rows, cols // 32)
    )
    rebuilt = codes.float().view(rows, -1, 32) * scale[..., None] + lo[..., None]
    # Q4_0's d * (q - 8) is q * d - 8 * d here: the same value to a float32 rounding.
    atol = 1e-6 * values.abs().max().item()
    torch.testing.assert_close(rebuilt.view_as(values), values, rtol=1e-6, atol=atol)


def test_rows_read_piecewise_are_the_tensors_rows(gemma3_gguf: Path) -> None:
    gguf = GGUFFile(gemma3_gguf)
    kinds = {info.qtype: info for info in gguf.tensor_infos() if len(info.shape) == 2}
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q5_0):
        info = kinds[qtype]
        whole = gguf.load_tensor(info.name)
        torch.testing.assert_close(gguf.load_rows(info.name, 16, 48), whole[16:48], rtol=0, atol=0)


def _file_weight(gguf: GGUFFile, model: LlamaForCausalLM, name: str) -> torch.Tensor:
    """Our projection ``name`` as the file's dequantized values (parts joined, Q/K rows in
    rotate-half order)."""
    i = int(name.split(".")[1])
    b, cfg = f"blk.{i}.", model.config
    if name.endswith("qkv_proj"):
        q, k = (gguf.load_tensor(b + f"attn_{p}.weight") for p in "qk")
        if cfg.architecture in LLAMA_FAMILY:
            q, k = unpermute_rope(q, cfg.num_heads), unpermute_rope(k, cfg.num_kv_heads)
        return torch.cat((q, k, gguf.load_tensor(b + "attn_v.weight")))
    gate, up = (gguf.load_tensor(b + f"ffn_{p}.weight") for p in ("gate", "up"))
    return torch.cat((gate, up))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def lean(
    request: pytest.FixtureRequest, smollm2_gguf: Path, gemma3_gguf: Path
) -> tuple[GGUFFile, LlamaForCausalLM]:
    """A real model loaded in bf16 (the packed-only path on a VNNI machine), with its file."""
    gguf = GGUFFile(smollm2_gguf if request.param == "smollm2" else gemma3_gguf)
    return gguf, load_gguf_model(gguf, torch.bfloat16, progress=False)[0]


@LEAN
def test_projections_hold_only_the_files_values(lean: tuple[GGUFFile, LlamaForCausalLM]) -> None:
    gguf, model = lean
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(not m.dense and m.packed_kind in VNNI_KINDS for m in linears)
    assert isinstance(model.embed_tokens, Embedding) and model.embed_tokens.packed is not None
    for name in ("layers.1.self_attn.qkv_proj", "layers.2.mlp.gate_up_proj"):
        layer = model.get_submodule(name)
        assert isinstance(layer, Linear)
        ours, theirs = dequantize_packed(layer), _file_weight(gguf, model, name)
        if layer.packed_kind is PackedKind.INT4_VNNI:
            # The blocks' own codes; only each group's scale and min rounded to float16.
            bound = theirs.abs().amax() * 2**-10
        else:  # int8 codes per group of 32: half a step of the group's largest value
            bound = theirs.view(len(theirs), -1, 32).abs().amax(-1).max() / 254 * 1.01
        assert (ours - theirs).abs().max() <= bound


@LEAN
def test_embedding_rows_come_from_the_packed_table(smollm2_gguf: Path) -> None:
    gguf = GGUFFile(smollm2_gguf)
    model = load_gguf_model(gguf, torch.bfloat16, progress=False)[0]
    table = model.embed_tokens.packed
    assert table is not None and model.lm_head is table  # tied: one packed table for both
    ids = torch.tensor([[0, 15, 16, 17], [49151, 31, 1000, 2]])
    rows = model.embed_tokens(ids)
    assert rows.shape == (2, 4, model.config.hidden_size) and rows.dtype == torch.bfloat16
    wanted = dequantize_packed(table)[ids].to(torch.bfloat16)
    torch.testing.assert_close(rows, wanted, rtol=0, atol=0)
    file_rows = gguf.load_tensor("token_embd.weight")[ids]
    assert (rows.float() - file_rows).abs().max() <= file_rows.abs().max() / 100


@LEAN
def test_a_projection_matches_dequantize_then_matmul(
    lean: tuple[GGUFFile, LlamaForCausalLM],
) -> None:
    gguf, model = lean
    layer = model.get_submodule("layers.3.mlp.gate_up_proj")
    w = _file_weight(gguf, model, "layers.3.mlp.gate_up_proj")
    x = torch.randn(40, w.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = layer(x.bfloat16()).float()
    ref = x @ w.T
    # Rows are quantized to int8 per group of 32 on the way in (as llama.cpp's Q8_1).
    rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 0.02, rel.max()


_RSS_SCRIPT = """
import json, sys, torch
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM", "RssAnon")}
gguf = GGUFFile(sys.argv[1])
import inferd.kernels
inferd.kernels.int8_dot(torch.bfloat16)  # the kernels' library mapped before the baseline
before = status()
model = load_gguf_model(gguf, torch.bfloat16, progress=False)[0]
after = status()
tables = sum(b.numel() * b.element_size() for b in model.buffers())
packed = [getattr(m, "_packed", None) for m in model.modules()]
largest = max(t.numel() * t.element_size() for t in packed if t is not None)
print(json.dumps({"before": before, "after": after, "tables": tables, "largest": largest}))
"""


@LEAN
@pytest.mark.parametrize("model_name", ["smollm2", "gemma3"])
def test_loaded_weights_take_about_the_files_size(
    model_name: str, smollm2_gguf: Path, gemma3_gguf: Path
) -> None:
    """Anonymous RSS measured in a fresh process: the weights in at most 1.2x the file's bytes
    (plus the rotary tables and 64 MiB of first-use runtime), and loading never above what
    the loaded model then holds plus one packed tensor (moved onto huge pages one at a
    time: ``packed_on_huge_pages``)."""
    path = smollm2_gguf if model_name == "smollm2" else gemma3_gguf
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    grown = figures["after"]["RssAnon"] - figures["before"]["RssAnon"]
    peak = figures["after"]["VmHWM"] - figures["before"]["VmRSS"]
    assert grown <= 1.2 * path.stat().st_size + figures["tables"] + (64 << 20)
    total_grown = figures["after"]["VmRSS"] - figures["before"]["VmRSS"]
    assert peak <= total_grown + figures["largest"] + (16 << 20)


def test_rotary_tables_hold_the_default_context_and_grow_to_the_served_one(
    gemma3_gguf: Path,
) -> None:
    """Gemma 3 was trained on 32,768 positions: its two tables (head_dim 256) would be 128 MiB
    at load; they hold the default context's 8,192 rows, and serving a longer context grows
    them to it, each row the same as a table built whole."""
    loaded = load_model(
        gemma3_gguf,
        EngineConfig(dtype="bf16", max_model_len=12_000, kv_cache_tokens=12_288, max_num_seqs=1),
        progress=False,
    )
    try:
        model = loaded.engine.engine.model
        assert model.config.max_position == 32_768
        for table in (model.rotary, model.local_rotary):
            assert table.max_position == 12_000
            whole = RotaryEmbedding(table.head_dim, 32_768, table.inv_freq)
            torch.testing.assert_close(table.cos, whole.cos[:12_000], rtol=0, atol=0)
        empty = build_empty(model.config, model.rotary.inv_freq, torch.bfloat16)
        assert empty.rotary.max_position == empty.local_rotary.max_position == 8192
    finally:
        loaded.shutdown()
