"""LoRA adapters through the engine: a step mixing three adapters and the base model gives each
request what it gets alone, each adapter's greedy output is peft's, and the prefix cache keeps
adapters apart."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from inferd.config import EngineConfig
from inferd.engine.sampling import SamplingParams
from inferd.loading.lora import attach, read_adapter
from inferd.serving.served import ServedModel, load_model
from tests.models.lora_tiny import save_random_adapter
from tests.models.tiny import save_tiny

PROMPT = [(11 * i + 5) % 300 + 3 for i in range(13)]
ADAPTERS = ("a8", "b16", "c64")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("lora")
    refs: dict[str | None, list[int]] = {None: _greedy(save_tiny("llama", root / "base"), 8)}
    for i, name in enumerate(ADAPTERS):
        hf = save_tiny("llama", root / f"hf{i}")  # a fresh copy: peft wraps the model it gets
        rank = int(name[1:])
        refs[name] = _greedy(save_random_adapter(hf, root / name, rank, seed=i + 1), 8)
    served = load_model(
        root / "base",
        EngineConfig(dtype="f32", block_size=4, kv_cache_tokens=512, max_num_seqs=8),
        progress=False,
    )
    model = served.engine.engine.model
    keys: dict[str | None, str | None] = {None: None}  # rows name an adapter by its key
    for name in ADAPTERS:
        adapter = read_adapter(name, root / name, model)
        attach(model, adapter)
        keys[name] = adapter.key
    yield served, refs, keys
    served.shutdown()


def _greedy(hf: Any, n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        )
    return list(out[0, len(PROMPT) :].tolist())


def _run(
    served: ServedModel, loras: list[str | None], prompt: list[int] = PROMPT
) -> list[tuple[list[int], list[float]]]:
    async def one(lora: str | None) -> tuple[list[int], list[float]]:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0, lora=lora)
        tokens: list[int] = []
        logprobs: list[float] = []
        async for out in served.engine.generate(prompt, params):
            tokens.extend(out.token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs or ())
        return tokens, logprobs

    async def every() -> list[tuple[list[int], list[float]]]:
        return list(await asyncio.gather(*(one(lora) for lora in loras)))

    return asyncio.run(every())


def test_mixed_batch_equals_each_alone_and_peft(setup: Any) -> None:
    served, refs, keys = setup
    loras: list[str | None] = [*ADAPTERS, None]
    mixed = _run(served, [keys[lora] for lora in loras])
    alone = [_run(served, [keys[lora]])[0] for lora in loras]
    for lora, (tokens, logprobs), (alone_tokens, alone_logprobs) in zip(
        loras, mixed, alone, strict=True
    ):
        assert tokens == alone_tokens == refs[lora], lora
        # Not bit-equal: without --deterministic a decode's matmul kernel follows the batch
        # size (layers/linear.py), for the base rows as for the adapters'.
        assert logprobs == pytest.approx(alone_logprobs, abs=1e-4)
    assert len({tuple(t) for t, _ in mixed}) == len(loras)  # every adapter changes the output


def test_prefix_cache_keeps_adapters_apart(setup: Any) -> None:
    served, _, keys = setup
    prompt = [(5 * i + 1) % 300 + 3 for i in range(17)]  # in no other test: nothing cached

    def hits(lora: str | None) -> int:
        before = served.engine.engine.stats().prefix_cache_hits
        _run(served, [keys[lora]], prompt)
        return served.engine.engine.stats().prefix_cache_hits - before

    assert hits(None) == 0
    assert hits("a8") == 0  # the base's blocks of the same prompt are not the adapter's
    assert hits("b16") == 0
    assert hits("a8") > 0  # its own are
    assert hits(None) > 0
