"""Huge-page memory for what a decode step reads all of (host_memory.py): the KV pool and the
packed weights are advised onto 2 MiB pages (``madvise(MADV_HUGEPAGE)``), with the values they
would have had in plain memory.

Whether the kernel backs advised memory with huge pages at once depends on how fragmented the
RAM is (the suite's other worker loads models meanwhile): the tests check the advice, which is
inferd's part, through the ``hg`` flag of the mapping (/proc/self/smaps), not the backing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM
from inferd.host_memory import HUGE_PAGE, HugePageArena, huge_page_zeros
from inferd.layers.linear import Linear, PackedKind, packed_on_huge_pages
from tests.machine import NOT_LINUX


def advised_huge(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s first byte is advised onto huge pages (VmFlags
    ``hg``, /proc/self/smaps)."""
    address = t.data_ptr()
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def test_huge_page_zeros_are_zeros_on_aligned_memory() -> None:
    t = huge_page_zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    assert t.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(NOT_LINUX is not None, reason=str(NOT_LINUX))
def test_a_buffer_of_whole_huge_pages_is_advised() -> None:
    t = huge_page_zeros((2 * HUGE_PAGE + 4096,), torch.uint8)
    assert advised_huge(t) and advised_huge(t[2 * HUGE_PAGE - 1 :])
    # (Its last, partial page is left on small pages; that it is not advised cannot be checked
    # here: freed heap memory keeps the advice of what it held before.)


def test_the_arena_places_copies_side_by_side() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7, dtype=torch.int8), torch.randn(2).half()]
    arena = HugePageArena([t.numel() * t.element_size() for t in tensors])
    copies = [arena.place(t) for t in tensors]
    for t, c in zip(tensors, copies, strict=True):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.data_ptr() % 64 == 0
    # one buffer: each copy starts after the one before it, 64-byte aligned
    assert copies[1].data_ptr() - copies[0].data_ptr() == 64
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    with pytest.raises(ValueError, match="no room"):
        arena.place(torch.zeros(100))


def test_packed_weights_move_and_keep_their_outputs() -> None:
    model = torch.nn.Sequential(Linear(64, 48), Linear(48, 64))
    for m in model:
        m.pack(PackedKind.INT4)
    x = torch.randn(3, 64)
    before = model(x)
    old = [m._packed for m in model]
    packed_on_huge_pages(model)
    assert all(m._packed is not o for m, o in zip(model, old, strict=True))
    assert torch.equal(model(x), before)


@pytest.mark.skipif(NOT_LINUX is not None, reason=str(NOT_LINUX))
def test_the_served_kv_pool_and_packed_weights_are_advised_huge(smollm2_gguf: Path) -> None:
    with LLM(str(smollm2_gguf), kv_cache_tokens=16384) as llm:  # 6 MiB a K or V tensor
        engine = llm.model.engine.engine
        k_cache, v_cache = engine._core.runner.kv_caches[-1]
        block: Any = engine.model.layers[3]
        gate_up: Linear = block.mlp.gate_up_proj
        assert gate_up._packed is not None
        for t in (k_cache, v_cache, gate_up._packed):
            assert advised_huge(t)
