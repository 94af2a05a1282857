"""The fused decode kernels against the plain PyTorch ops they replace."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from inferd.kernels import fused, status, unfused
from inferd.layers.attention import (
    AttentionMetadata,
    attend_paged,
    gather_blocks,
    grouped_attention,
    write_kv,
)
from inferd.layers.linear import Linear, PackedKind
from inferd.layers.norm import RMSNorm
from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies

DTYPES = [torch.float32, torch.bfloat16]
HEADS, KV_HEADS, DIM, BS = 6, 2, 16, 4


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def test_the_kernels_build_here() -> None:
    # CI machines have a compiler: a build failure must show, not fall back silently.
    assert fused() is not None, status()
    assert status() == "fused CPU kernels"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x = (torch.randn(5, 96) * 3).to(dtype)
    with unfused():
        expected = norm(x)
    torch.testing.assert_close(norm(x), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_kv_write(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    rotary = RotaryEmbedding(DIM, 64, inverse_frequencies(DIM, 10000.0, RopeScaling()))
    n = 3
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)
    positions, slots = torch.tensor([0, 17, 40]), torch.tensor([9, 2, 30])
    rotation = rotary.at(positions, dtype)
    caches = [torch.zeros(8, BS, KV_HEADS, DIM, dtype=dtype) for _ in range(4)]
    q = fused().rope_write_kv(
        qkv,
        positions,
        slots,
        rotation.cos_table,
        rotation.signed_sin_table,
        caches[0],
        caches[1],
        HEADS,
    )
    # The reference: rotate q and k with the PyTorch ops, then write k and v at the slots.
    q_ref, k_ref, v_ref = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q_ref = rotation.apply(q_ref.reshape(n, HEADS, DIM))
    k_ref = rotation.apply(k_ref.reshape(n, KV_HEADS, DIM))
    meta = AttentionMetadata(slots, None, None, None, ())
    write_kv(caches[2], caches[3], k_ref, v_ref.reshape(n, KV_HEADS, DIM), meta)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(caches[0], caches[2], **_tol(dtype))
    assert torch.equal(caches[1], caches[3])  # v is copied as is


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("softcap", "window"), [(None, 0), (20.0, 0), (None, 5)])
def test_decode_attention(dtype: torch.dtype, softcap: float | None, window: int) -> None:
    torch.manual_seed(2)
    k_cache = torch.randn(12, BS, KV_HEADS, DIM).to(dtype)
    v_cache = torch.randn(12, BS, KV_HEADS, DIM).to(dtype)
    tables = torch.tensor([[3, 9, 0, 0], [1, 4, 7, 2], [11, 0, 0, 0]])  # scattered, padded
    positions = torch.tensor([6, 15, 2])
    # The reference: keys at or before each position (and within the window), by gathered
    # blocks and the plain grouped attention.
    keys = torch.arange(tables.shape[1] * BS)[None, :]
    p = positions[:, None]
    mask = (keys <= p) & (keys > p - window) if window else keys <= p
    q = torch.randn(3, HEADS, DIM).to(dtype)
    expected = grouped_attention(
        q.unsqueeze(2).float(),
        gather_blocks(k_cache, tables).float(),
        gather_blocks(v_cache, tables).float(),
        mask[:, None, None, :],
        0.3,
        softcap,
    ).squeeze(2)
    meta = AttentionMetadata(
        torch.zeros(3, dtype=torch.long), torch.arange(3), tables, positions + 1, (), window
    )
    out = attend_paged(q, k_cache, v_cache, meta, 0.3, softcap=softcap)
    with unfused():
        plain = attend_paged(q, k_cache, v_cache, meta, 0.3, softcap=softcap)
    torch.testing.assert_close(out.float(), expected, **_tol(dtype))
    torch.testing.assert_close(plain.float(), expected, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = (torch.randn(4, 2 * 40) * 4).to(dtype)
    gate, up = x.split(40, dim=-1)
    torch.testing.assert_close(fused().silu_mul(x), F.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_linear_of_one_row(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    layer = Linear(96, 80).to(dtype)
    weight = torch.randn(80, 96)
    layer.pack(PackedKind.INT8, source=weight)
    x = torch.randn(1, 96).to(dtype)
    with unfused():
        expected = layer(x)  # torch's int8 kernel
    torch.testing.assert_close(layer(x), expected, **_tol(dtype))
    assert layer.packed_kind is PackedKind.INT8


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"INFERD_FUSED_KERNELS": "0"}, "plain PyTorch ops (INFERD_FUSED_KERNELS=0)"),
        ({"CXX": "/bin/false"}, "plain PyTorch ops (build failed: "),  # no usable compiler
    ],
)
def test_without_the_kernels_everything_runs_on_plain_ops(
    env: dict[str, str], reason: str, tmp_path: Path
) -> None:
    script = (
        "import torch\n"
        "from inferd.kernels import status\n"
        "from inferd.layers.norm import RMSNorm\n"
        "print(status())\n"
        "print(RMSNorm(8, 1e-5)(torch.ones(2, 8)).sum().item())\n"
    )
    run_env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), **env}
    result = subprocess.run(
        [sys.executable, "-c", script], env=run_env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    line, value = result.stdout.splitlines()
    assert line.startswith(reason)
    assert float(value) == pytest.approx(16.0, rel=1e-4)  # ones normalize to ones (eps aside)
