"""inferd doctor, GET /v1/system/info, and inferd tune."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from inferd.cli import main
from inferd.config import EngineConfig
from inferd.doctor import CPU_FLAGS, cpu_info
from inferd.kernels import kernel_isa
from inferd.loading.dequant import FLOAT_TYPES, INT4_GROUP_TYPES
from inferd.loading.gguf import GGUFFile
from inferd.server.app import build_app
from inferd.serving.loading import load_spec
from inferd.serving.served import load_model
from inferd.serving.spec import load_models_file
from inferd.source import resolve_source
from inferd.store import ModelStore
from inferd.tune import model_shape, recommend
from tests.models.tiny import save_tiny


def test_doctor_json(smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"]["version"] == torch.__version__
    assert info["torch"]["threads"] == torch.get_num_threads()
    assert set(info["cpu"]["features"]) == set(CPU_FLAGS)
    assert info["cpu"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["memory"]["total_mb"] > 0 and info["cuda"]["available"] is torch.cuda.is_available()
    manifest = ModelStore().manifest("smollm2")
    assert manifest is not None
    (smol,) = [m for m in info["store"]["models"] if m["name"] == "smollm2"]
    assert smol["digest"] == f"sha256:{manifest.digest}" and smol["complete"]
    assert info["choices"]["dtype"] in ("bf16", "f32")
    table = info["choices"]["isa_table"]
    assert [row["isa"] for row in table] == ["avx512", "avx2", "baseline"]
    (mine,) = [row for row in table if row["this_machine"]]
    isa = kernel_isa()
    assert mine["isa"] == (isa.name if isa else "baseline")
    assert info["choices"]["kernel_isa"] == mine["isa"]
    # The dtype each ISA gets is the one auto picks here, and so are the packed copies.
    assert mine["dtype"] == info["choices"]["dtype"]
    assert ("inferd's AVX2" in info["choices"]["packed_kernels"]) == (mine["isa"] == "avx2")


def test_doctor_under_the_forced_avx2_kernels(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What an AVX2 machine would be told: f32, inferd's packed kernels, the avx2 build."""
    monkeypatch.setenv("INFERD_KERNEL_ISA", "avx2")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "dtype      auto -> f32" in out
    assert "this machine: avx2 (forced by INFERD_KERNEL_ISA)" in out
    assert "* avx2     (AVX2 + FMA + F16C): dtype f32" in out
    assert "decode ops: fused CPU kernels, avx2 build" in out
    monkeypatch.setenv("INFERD_KERNEL_ISA", "sse9")  # a bad name: said, not a crash
    assert main(["doctor"]) == 0
    assert "plain PyTorch ops (build failed: INFERD_KERNEL_ISA='sse9'" in capsys.readouterr().out


def test_doctor_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for head in (
        "torch ",
        "cpu ",
        "threads ",
        "memory ",
        "store ",
        "dtype      auto -> ",
        " fused ",
    ):
        assert head in out


def test_cpu_features_come_from_cpuinfo(tmp_path: Path) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("model name\t: Test CPU\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n")
    cpu = cpu_info(fake)
    assert cpu["model"] == "Test CPU"
    assert cpu["features"]["amx_bf16"] and cpu["features"]["avx512f"]
    assert not cpu["features"]["avx512_bf16"]


def test_system_info_of_a_running_server(tmp_path: Path) -> None:
    save_tiny("qwen3", tmp_path)
    served = load_model(
        resolve_source(str(tmp_path)),
        EngineConfig(dtype="f32", isq="q8", kv_cache_tokens=64),
        progress=False,
    )
    try:

        async def get() -> httpx.Response:
            transport = httpx.ASGITransport(app=build_app([served]))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                return await client.get("/v1/system/info")

        response = asyncio.run(get())
    finally:
        served.shutdown()
    assert response.status_code == 200
    info = response.json()
    assert {"torch", "cpu", "cuda", "memory", "store", "choices"} <= set(info)
    (model,) = info["server"]["models"]
    assert model["id"] == tmp_path.name and model["architecture"] == "qwen3"
    assert model["isq"] == "q8" and model["dtype"] == "float32"
    assert model["deterministic"] is False
    assert model["kernels"] == {
        "linear_layers": 9,
        "packed_int4": 0,
        "packed_int8": 9,
        "dense_dropped": 9,
        "fused": "fused CPU kernels",
    }


def test_tune_json_and_emitted_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_tiny("mistral", tmp_path / "m")
    for name in ("models.json", "models.toml"):
        emitted = tmp_path / name
        args = ["tune", "-m", str(tmp_path / "m"), "--json", "--emit-config", str(emitted)]
        assert main(args) == 0
        rec = json.loads(capsys.readouterr().out)
        assert rec["estimate"] is True and rec["model"]["kind"] == "Plain"
        r = rec["recommended"]
        assert r["dtype"] in ("bf16", "f32") and r["isq"] is None  # a tiny model fits as is
        assert r["block_size"] == 16 and r["kv_cache_tokens"] % 16 == 0
        assert 1 <= r["max_seqs"] <= 64 and r["max_seq_len"] == 128
        (spec,) = load_models_file(emitted)  # serve --config reads what tune wrote
        assert (spec.kind, spec.model_id, spec.max_seqs) == (
            "Plain",
            str(tmp_path / "m"),
            r["max_seqs"],
        )
        assert spec.dtype == r["dtype"] and spec.max_seq_len == 128
    assert "ESTIMATE" in (tmp_path / "models.toml").read_text()


def test_tune_text(smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "-m", str(smollm2_gguf)]) == 0
    out = capsys.readouterr().out
    assert "ESTIMATE" in out and "--kv-cache-mb" in out and "135M params" in out


def test_tune_quantizes_when_memory_is_short(smollm2_gguf: Path) -> None:
    """Without the VNNI kernels the GGUF's weights are dense bf16: ISQ shrinks them."""
    shape = model_shape(str(smollm2_gguf))

    def rec(available_mb: int) -> dict[str, Any]:
        return recommend(
            shape, available_mb=available_mb, usable_cpus=4, dtype=torch.bfloat16, vnni=False
        )

    plenty = rec(16000)
    assert plenty["recommended"]["isq"] is None and plenty["recommended"]["max_seqs"] == 16
    assert rec(600)["recommended"]["isq"] == "q8"
    short = rec(250)
    assert short["recommended"]["isq"] == "q4" and short["memory_mb"]["fits"]
    assert not rec(100)["memory_mb"]["fits"]


def test_tune_counts_the_packed_weights_where_the_vnni_kernels_run(smollm2_gguf: Path) -> None:
    """SmolLM2's Q4_1 file keeps 4-bit groups (0.625 bytes a parameter, scales and mins
    included), its Q6_K/Q8_0 tensors int8 groups (1.0625), its norms bf16: about the file's
    size, which ISQ would only grow, so tune never picks it; the budget adds the pool."""
    shape = model_shape(str(smollm2_gguf))
    gguf = GGUFFile(smollm2_gguf)
    expected = 0.0
    for info in gguf.tensor_infos():
        n = math.prod(info.shape)
        if info.qtype in INT4_GROUP_TYPES:
            expected += n * 0.625
        elif info.qtype in FLOAT_TYPES:
            expected += n * 2
        else:
            expected += n * 1.0625
    for available in (16000, 250, 150):
        rec = recommend(
            shape, available_mb=available, usable_cpus=4, dtype=torch.bfloat16, vnni=True
        )
        mem = rec["memory_mb"]
        assert rec["recommended"]["isq"] is None, available
        assert mem["weights"] == pytest.approx(expected / 2**20, abs=0.1)
        assert mem["weights"] < 1.1 * smollm2_gguf.stat().st_size / 2**20
        assert mem["budget"] == round(mem["weights"] + mem["kv_cache"] + mem["headroom"])


def test_tune_kv_bytes_follow_the_kv_cache_dtype(smollm2_gguf: Path) -> None:
    """Each --kv-cache-dtype is sized as the pool stores it: 2 (K, V) x layers x KV heads x
    (head_dim values of its size; int8: head_dim codes + a 2-byte float16 scale) per token; int8
    holds about twice bf16's tokens in the same memory, and so more sequences."""
    shape = model_shape(str(smollm2_gguf))
    cfg = shape.config
    rows = 2 * cfg.num_layers * cfg.num_kv_heads
    expected = {
        "auto": rows * cfg.head_dim * 2,  # the model computes in bf16 here
        "bf16": rows * cfg.head_dim * 2,
        "f32": rows * cfg.head_dim * 4,
        "int8": rows * (cfg.head_dim + 2),
    }
    recs = {
        kv: recommend(
            shape, available_mb=3000, usable_cpus=16, dtype=torch.bfloat16, kv_cache_dtype=kv
        )
        for kv in expected
    }
    for kv, rec in recs.items():
        r = rec["recommended"]
        assert rec["model"]["kv_bytes_per_token"] == expected[kv], kv
        assert r["kv_cache_dtype"] == ("bf16" if kv == "auto" else kv)
        flags = rec["serve_flags"]
        assert flags[flags.index("--kv-cache-dtype") + 1] == r["kv_cache_dtype"]
        # the memory bound decides here, the same MiB for each: tokens follow bytes per token
        assert r["kv_cache_mb"] == recs["bf16"]["recommended"]["kv_cache_mb"], kv
        assert r["kv_cache_tokens"] == r["kv_cache_mb"] * 2**20 // expected[kv] // 16 * 16, kv
    tokens = {kv: rec["recommended"]["kv_cache_tokens"] for kv, rec in recs.items()}
    assert tokens["f32"] < tokens["bf16"] < tokens["int8"]
    seqs = {kv: rec["recommended"]["max_seqs"] for kv, rec in recs.items()}
    assert seqs["f32"] < seqs["bf16"] < seqs["int8"], seqs


def test_tune_kv_cache_dtype_in_text_json_and_emitted_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tune --kv-cache-dtype int8` says which KV dtype it assumes, and the models file it
    writes carries it: a model served from that file caches K/V in int8."""
    save_tiny("mistral", tmp_path / "m")
    emitted = tmp_path / "models.toml"
    args = ["tune", "-m", str(tmp_path / "m"), "--kv-cache-dtype", "int8"]
    assert main([*args, "--json", "--emit-config", str(emitted)]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["recommended"]["kv_cache_dtype"] == "int8"
    (spec,) = load_models_file(emitted)
    assert spec.kv_cache_dtype == "int8"
    served = load_spec(spec, EngineConfig(kv_cache_tokens=256))
    try:
        assert served.kv_cache_dtype == "int8"
    finally:
        served.shutdown()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokens of int8" in out and "--kv-cache-dtype int8" in out
    with pytest.raises(SystemExit):
        main(["tune", "-m", str(tmp_path / "m"), "--kv-cache-dtype", "int4"])
