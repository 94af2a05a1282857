"""``--max-loras``: more adapters served than attached at once. Each request's adapter is loaded
on demand into the slot of the least recently used idle one, a request waits while every slot
runs requests, and none of it changes any adapter's output (peft's greedy tokens)."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.lora_slots import LoraSlots
from inferd.engine.sampling import SamplingParams
from inferd.layers.linear import Linear
from inferd.serving.lora import serve_adapters, withdraw_adapter
from inferd.serving.served import ServedModel, load_model
from tests.models.lora_tiny import save_random_adapter
from tests.models.tiny import save_tiny

PROMPT = [(13 * i + 7) % 300 + 3 for i in range(11)]
ADAPTERS = {"r8": 8, "r16": 16, "r64": 64}
TOKENS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_slots")


@pytest.fixture(scope="module")
def refs(folder: Path) -> dict[str, list[int]]:
    """Each adapter's greedy tokens under transformers + peft."""
    out = {}
    for i, (name, rank) in enumerate(ADAPTERS.items()):
        hf = save_tiny("llama", folder / f"hf_{name}")  # a fresh copy: peft wraps what it gets
        peft_model = save_random_adapter(hf, folder / name, rank, seed=20 + i)
        with torch.inference_mode():
            ids = peft_model.generate(
                torch.tensor([PROMPT]),
                max_new_tokens=TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            )
        out[name] = list(ids[0, len(PROMPT) :].tolist())
    assert len({tuple(t) for t in out.values()}) == len(out)  # every adapter changes the output
    save_tiny("llama", folder / "base")
    return out


def _serve(folder: Path, max_loras: int) -> tuple[ServedModel, dict[str, ServedModel]]:
    cfg = EngineConfig(dtype="f32", block_size=4, kv_cache_tokens=512, max_loras=max_loras)
    served = load_model(folder / "base", cfg, progress=False)
    views = serve_adapters(served, [(name, folder / name) for name in ADAPTERS])
    return served, {v.id: v for v in views}


@pytest.fixture
def one_slot(folder: Path, refs: Any) -> Iterator[tuple[ServedModel, dict[str, ServedModel]]]:
    served, views = _serve(folder, 1)
    yield served, views
    served.shutdown()


@pytest.fixture
def two_slots(folder: Path, refs: Any) -> Iterator[tuple[ServedModel, dict[str, ServedModel]]]:
    served, views = _serve(folder, 2)
    yield served, views
    served.shutdown()


def _run(views: list[ServedModel]) -> list[tuple[list[int], str | None]]:
    """Greedy tokens and finish reason of one request per view, all submitted at once."""
    return [(tokens, reason) for tokens, reason, _ in _outcomes(views)]


def _outcomes(views: list[ServedModel]) -> list[tuple[list[int], str | None, str | None]]:
    """``_run``'s, with each request's error as "code: message" (its ``error_code``)."""

    async def one(view: ServedModel) -> tuple[list[int], str | None, str | None]:
        params = view.adapted(SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
        tokens: list[int] = []
        reason = error = None
        async for out in view.engine.generate(PROMPT, params):
            tokens.extend(out.token_ids)
            reason = out.finish_reason
            error = None if out.error is None else f"{out.error_code}: {out.error}"
        return tokens, reason, error

    async def every() -> list[tuple[list[int], str | None, str | None]]:
        return list(await asyncio.gather(*(one(v) for v in views)))

    return asyncio.run(every())


def _attached(served: ServedModel) -> set[str]:
    """The adapter keys attached to the decoder's projections now."""
    return {
        key
        for m in served.engine.engine.model.modules()
        if isinstance(m, Linear) and m.lora is not None
        for key in m.lora.deltas
    }


def test_one_slot_alternating_adapters_match_peft(
    one_slot: tuple[ServedModel, dict[str, ServedModel]], refs: dict[str, list[int]]
) -> None:
    served, views = one_slot
    assert _attached(served) == set()  # registered, read again when first asked for
    order = ["r8", "r64", "r8", "r64", "r64", "r8"]
    for name in order:
        [(tokens, reason)] = _run([views[name]])
        assert reason == "length" and tokens == refs[name], name
        assert _attached(served) == {views[name].lora}  # one slot: only the last one used
    stats = served.engine.stats()
    assert stats.lora_resident == 1
    assert stats.lora_loads == 5  # every change of adapter; the repeated r64 stayed resident
    assert stats.lora_evictions == 4
    # The prefix cache survived the evictions: the same adapter's prompt blocks hit again.
    assert stats.prefix_cache_hits > 0


def test_one_slot_concurrent_requests_wait_for_the_slot(
    one_slot: tuple[ServedModel, dict[str, ServedModel]], refs: dict[str, list[int]]
) -> None:
    served, views = one_slot
    names = ["r8", "r16", "r8", "r64", "r16"]
    results = _run([views[n] for n in names])
    for name, (tokens, reason) in zip(names, results, strict=True):
        assert reason == "length" and tokens == refs[name], name  # queued, not failed
    assert len(_attached(served)) == 1


def test_three_adapters_on_two_slots_all_finish_correct(
    two_slots: tuple[ServedModel, dict[str, ServedModel]], refs: dict[str, list[int]]
) -> None:
    served, views = two_slots
    names = [*ADAPTERS, *ADAPTERS, None]
    base = served
    results = _run([views[n] if n is not None else base for n in names])
    base_tokens = results[-1][0]
    for name, (tokens, reason) in zip(names, results, strict=True):
        assert reason == "length", name
        assert tokens == (refs[name] if name is not None else base_tokens), name
    assert base_tokens not in refs.values()
    stats = served.engine.stats()
    assert stats.lora_loads >= 3 and stats.lora_evictions >= 1
    assert stats.lora_resident == len(_attached(served)) == 2


def test_least_recently_used_idle_adapter_is_evicted(
    two_slots: tuple[ServedModel, dict[str, ServedModel]],
) -> None:
    served, views = two_slots
    slots: LoraSlots = served.engine.engine.adapters
    key = {name: v.lora for name, v in views.items()}
    _run([views["r8"]])
    _run([views["r16"]])
    _run([views["r8"]])  # r8 is now the most recently used: r16 goes for r64
    _run([views["r64"]])
    assert list(slots.resident) == [key["r8"], key["r64"]]
    # Both slots held by running requests: a third adapter must wait (admit says no).
    assert not slots.admit(key["r16"], in_use={key["r8"], key["r64"]})
    assert slots.admit(key["r16"], in_use={key["r64"]})  # r8 is idle: it goes
    assert list(slots.resident) == [key["r64"], key["r16"]]


def test_changed_files_fail_the_request_not_the_others(
    folder: Path, refs: dict[str, list[int]], tmp_path: Path
) -> None:
    """An evicted adapter is read again from its files: if they changed, its request fails
    with a message saying so (its digest names other weights), while the others run."""
    copy = tmp_path / "r8"
    shutil.copytree(folder / "r8", copy)
    cfg = EngineConfig(dtype="f32", block_size=4, kv_cache_tokens=512, max_loras=1)
    served = load_model(folder / "base", cfg, progress=False)
    try:
        [view] = serve_adapters(served, [("r8", copy)])
        [other] = serve_adapters(served, [("r16", folder / "r16")])
        shutil.copy(folder / "r64" / "adapter_config.json", copy / "adapter_config.json")
        shutil.copy(
            folder / "r64" / "adapter_model.safetensors", copy / "adapter_model.safetensors"
        )
        (tokens, reason, error), (other_tokens, other_reason, _) = _outcomes([view, other])
        assert reason == "error" and tokens == []
        assert error is not None and error.startswith("lora_adapter_changed: ")
        assert "'r8'" in error and "changed on disk" in error and "load_lora_adapter" in error
        assert other_reason == "length" and other_tokens == refs["r16"]
        withdraw_adapter(other)
        assert _attached(served) == set()
        stale = dataclasses.replace(view, lora=other.lora)  # a view of a withdrawn adapter
        [(_, stale_reason, stale_error)] = _outcomes([stale])
        assert stale_reason == "error" and "not registered" in (stale_error or "")
        assert (stale_error or "").startswith("lora_adapter_unavailable: ")
    finally:
        served.shutdown()
