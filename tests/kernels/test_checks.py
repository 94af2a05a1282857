"""The fused kernels refuse what they cannot take (an error, never a read out of bounds), and a
kernel build that died leaves nothing that blocks the next start."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from inferd.kernels import _staged_source, build_lock
from inferd.kernels.ops import KernelOps, Rotation
from inferd.layers.rotary import RopeScaling, RotaryEmbedding, inverse_frequencies
from tests.kernels.choice import ops_named

HEADS, KV_HEADS, DIM, BS, BLOCKS = 4, 2, 16, 4, 6


@pytest.fixture(scope="module")
def fused() -> KernelOps:
    return ops_named("fused")


def _caches(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.zeros(BLOCKS, BS, KV_HEADS, DIM, dtype=dtype),
        torch.zeros(BLOCKS, BS, KV_HEADS, DIM, dtype=dtype),
    )


def _rotation(positions: list[int]) -> Rotation:
    """Positions past the table of 32, as a --max-seq-len beyond the model's would give."""
    rotary = RotaryEmbedding(DIM, 32, inverse_frequencies(DIM, 10000.0, RopeScaling()))
    unused = torch.empty(0)  # the kernel reads the positions and the tables only
    return Rotation(unused, unused, torch.tensor(positions), rotary.cos, rotary.signed_sin)


def _rope(
    fused: KernelOps,
    positions: list[int],
    slots: list[int],
    heads: int = HEADS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    n = len(positions)
    qkv = torch.randn(n, (heads + 2 * KV_HEADS) * DIM).to(dtype)
    k_cache, v_cache = _caches(dtype)
    return fused.rope_write_kv(
        qkv, _rotation(positions), torch.tensor(slots), k_cache, v_cache, heads
    )


def test_rope_accepts_the_last_position_and_slot(fused: KernelOps) -> None:
    assert _rope(fused, [0, 31], [0, BLOCKS * BS - 1]).shape == (2, HEADS, DIM)


@pytest.mark.parametrize(
    ("positions", "slots", "message"),
    [
        ([3, 32], [0, 1], r"positions\[1\] = 32 is outside the rotary table \[0, 32\)"),
        ([-1, 2], [0, 1], r"positions\[0\] = -1 is outside the rotary table"),
        ([0, 1], [0, BLOCKS * BS], r"slots\[1\] = 24 is outside the KV pool \[0, 24\)"),
        ([0, 1], [-5, 1], r"slots\[0\] = -5 is outside the KV pool"),
    ],
)
def test_rope_refuses_positions_and_slots_out_of_range(
    fused: KernelOps, positions: list[int], slots: list[int], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        _rope(fused, positions, slots)


def test_rope_refuses_heads_that_do_not_group(fused: KernelOps) -> None:
    with pytest.raises(RuntimeError, match="3 query heads are not a multiple of 2 KV heads"):
        _rope(fused, [0], [0], heads=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_kernels_refuse_other_dtypes(fused: KernelOps, dtype: torch.dtype) -> None:
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        _rope(fused, [0], [0], dtype=dtype)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        fused.rms_norm(torch.ones(2, 8, dtype=dtype), torch.ones(8, dtype=dtype), 1e-5)
    with pytest.raises(RuntimeError, match="must be float32 or bfloat16"):
        fused.silu_mul(torch.ones(2, 8, dtype=dtype))


def test_kernels_refuse_tensors_off_the_cpu(fused: KernelOps) -> None:
    # The meta device stands for any device that is not the CPU (no data to read at all).
    x = torch.empty(2, 8, device="meta")
    with pytest.raises(RuntimeError, match="x must be a CPU tensor, not on meta"):
        fused.silu_mul(x)
    with pytest.raises(RuntimeError, match="must be a CPU tensor"):
        fused.rms_norm(x, torch.ones(8), 1e-5)


def test_rms_norm_refuses_a_weight_of_another_width(fused: KernelOps) -> None:
    with pytest.raises(RuntimeError, match="weight has 7 entries for rows of 8"):
        fused.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)


def test_add_rms_norm_refuses_rows_of_another_shape(fused: KernelOps) -> None:
    with pytest.raises(RuntimeError, match=r"delta \[2, 4\] and x \[2, 8\] differ in shape"):
        fused.add_rms_norm(torch.ones(2, 8), torch.ones(2, 4), torch.ones(8), 1e-5)


def _decode(
    fused: KernelOps, tables: list[list[int]], lens: list[int], heads: int = HEADS
) -> torch.Tensor:
    k_cache, v_cache = _caches()
    q = torch.randn(len(lens), heads, DIM)
    return fused.decode_attention(
        q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens), 0.25, None, 0
    )


def test_decode_ignores_padding_past_the_keys_it_reads(fused: KernelOps) -> None:
    # Block 99 does not exist, but the sequence's 5 keys end in block 4.
    assert _decode(fused, [[2, 4, 99]], [5]).shape == (1, HEADS, DIM)


@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        ([[2, 6]], [5], r"block_tables\[0, 1\] = 6 is outside the KV pool \[0, 6\)"),
        ([[2, -1]], [5], r"block_tables\[0, 1\] = -1 is outside the KV pool"),
        ([[2, 3]], [9], r"lens\[0\] = 9 is outside the block tables' keys \[1, 9\)"),
        ([[2, 3]], [0], r"lens\[0\] = 0 is outside the block tables' keys"),
    ],
)
def test_decode_refuses_blocks_and_lengths_out_of_range(
    fused: KernelOps, tables: list[list[int]], lens: list[int], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        _decode(fused, tables, lens)


def test_decode_refuses_heads_that_do_not_group(fused: KernelOps) -> None:
    with pytest.raises(RuntimeError, match="3 query heads are not a multiple of 2 KV heads"):
        _decode(fused, [[1]], [2], heads=3)


def test_int8_linear_refuses_a_float_weight(fused: KernelOps) -> None:
    with pytest.raises(RuntimeError, match="weight must be int8"):
        fused.int8_linear(torch.ones(1, 8), torch.ones(4, 8), torch.ones(4))
    with pytest.raises(RuntimeError, match=r"weight .* and scale .* for rows of 8"):
        fused.int8_linear(torch.ones(1, 8), torch.ones(4, 8, dtype=torch.int8), torch.ones(3))


def test_a_lock_left_by_a_killed_build_is_cleared(tmp_path: Path) -> None:
    (tmp_path / "lock").touch()  # torch's marker of a build in progress, its builder gone
    with build_lock(tmp_path, wait_s=5):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for_within_a_bound(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time\n"
            f"f = open({str(tmp_path / 'inferd-build.lock')!r}, 'a')\n"
            "fcntl.flock(f, fcntl.LOCK_EX)\n"
            "open(sys.argv[1], 'w').close()\n"
            "time.sleep(60)\n",
            str(tmp_path / "ready"),
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.05)
        (tmp_path / "lock").touch()  # the live builder's marker
        waiting = pytest.raises(TimeoutError, match="another process has held the kernel build")
        with waiting, build_lock(tmp_path, wait_s=0.5):
            pass
        assert (tmp_path / "lock").exists()  # a live build's marker is left alone
    finally:
        holder.kill()
        holder.wait()
    with build_lock(tmp_path, wait_s=10):  # its holder died: the lock is free, the marker stale
        assert not (tmp_path / "lock").exists()


def test_a_start_after_an_interrupted_build_loads_the_kernels(fused: KernelOps) -> None:
    """The real build directory with torch's marker left behind: a fresh process still loads
    the kernels (before, it waited for the marker to go, forever)."""
    _, source = _staged_source()
    marker = source.parent / "lock"
    with build_lock(source.parent, wait_s=600):  # no build of ours is running meanwhile
        marker.touch()
    script = (
        "import torch\n"
        "from inferd.kernels import load_ops\n"
        "print(load_ops(torch.float32).description)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "fused CPU kernels"
    assert not marker.exists()
