"""Re-quantizing a loaded model in place (POST /re_isq; ``ServedModel.requantize``,
``ModelSlot.requantize``, ``inferd.LLM.requantize``).

The oracle is a load under ``--isq``: a model re-quantized to a method holds, module for module,
the weights a load with that method builds, from the model's files (so an already quantized
model is not rounded twice). Around the swap: no request ever runs on two sets of weights (a
running one is drained, or the swap refused), and a refused swap changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd import LLM
from inferd.config import EngineConfig
from inferd.engine.driver import CallerLoop
from inferd.engine.sampling import SamplingParams
from inferd.layers.linear import Linear
from inferd.loading.model import load
from inferd.loading.quantize import Isq, QuantizeError, isq_method
from inferd.loading.requantize import prepare
from inferd.serving.interface import EngineStoppedError, RequestOutput
from inferd.serving.registry import ConflictError, ModelSlot, ModelStatus
from inferd.serving.served import ServedModel, load_model
from inferd.source import resolve_source
from tests.models.tiny import save_tiny
from tests.models.tiny_gemma4 import TinyGemma4Gguf

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 61]


def weights(model: torch.nn.Module) -> dict[str, Any]:
    """Every parameter, and every projection's packed copy and its kind, by name."""
    out: dict[str, Any] = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.packed_kind is not None:
            out[f"{name}.<kind>"] = module.packed_kind
            out[f"{name}.<packed>"] = module._packed
            out[f"{name}.<scales>"] = module._scales
    return out


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    a, b = weights(got), weights(want)
    assert a.keys() == b.keys()
    for name, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[name].dtype and torch.equal(value, b[name]), name
        else:
            assert value == b[name], name


# -- names ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "method"),
    [
        ("q8", "q8"),
        ("q4", "q4"),
        ("8", "q8"),
        ("Q8_0", "q8"),
        ("q8_1", "q8"),
        ("Q8K", "q8"),
        ("4", "q4"),
        ("Q4_0", "q4"),
        ("Q4_1", "q4"),
        ("q4k", "q4"),
    ],
)
def test_mistralrs_names_map_onto_what_inferd_serves(name: str, method: str) -> None:
    assert isq_method(name) == method


@pytest.mark.parametrize("name", ["Q6K", "q5_0", "Q2K", "3", "HQQ4", "FP8", "AFQ4", "Q8", "int8"])
def test_other_names_are_refused_naming_the_accepted_ones(name: str) -> None:
    with pytest.raises(QuantizeError) as info:
        isq_method(name)
    message = str(info.value)
    assert repr(name) in message
    assert "q8 or q4" in message and "Q8_0" in message and "Q4K" in message


# -- against a load under --isq ------------------------------------------------------------------
def test_the_default_model_requantized_holds_what_a_load_under_isq_builds(
    smollm2_gguf: Path,
) -> None:
    """SmolLM2 (Q4_1 GGUF, the machine's default dtype: on AVX-512 its projections keep only
    their packed copy, nothing to quantize from) to q8: bit for bit the weights of a load under
    --isq q8, from the file's blocks, and it generates on."""
    llm = LLM(smollm2_gguf, kv_cache_tokens=256)
    try:
        change = llm.requantize("q8")
        assert (change.previous, change.method, llm.model.isq) == (None, "q8", "q8")
        q8 = load(resolve_source(str(smollm2_gguf)), isq="q8", progress=False)
        assert_same_weights(llm.engine.model, q8.model)
        assert change.weight_bytes == llm.model.weight_bytes != change.weight_bytes_before
        (out,) = llm.generate(PROMPT, GREEDY, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fixture", ["tiny_gemma4", "tiny_gemma3n_audio", "tiny_qwen3_vl_moe"])
def test_a_quantized_media_model_is_requantized_from_its_checkpoint(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    """q8 to q4 gives the q4 of the checkpoint, not of the q8 rounding; Gemma 4's and Gemma
    3n's encoders (named after the model's parameters) are quantized again with the decoder,
    and Qwen3-VL-MoE's experts, each from its matrix of the checkpoint's stack."""
    directory = request.getfixturevalue(fixture)[0]
    loaded = load(directory, dtype="f32", isq="q8", progress=False)
    prepare(loaded.model, loaded.source, Isq("q4")).install(loaded.model)
    assert_same_weights(loaded.model, load(directory, dtype="f32", isq="q4", progress=False).model)


def test_gemma4_from_gguf_is_requantized_with_its_projectors_encoders(
    tiny_gemma4_gguf: TinyGemma4Gguf,
) -> None:
    """llama.cpp's Q8_0 language model served with its projector (--mmproj): the decoder
    from the GGUF's blocks and the image and audio encoders from the projector, as a load
    reads them."""
    lm, mmproj = tiny_gemma4_gguf.files["lm-q8_0"], tiny_gemma4_gguf.files["mmproj-f32"]
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=256, isq="q8")
    served = load_model(resolve_source(str(lm)), cfg, progress=False, mmproj=mmproj)
    try:
        assert served.requantize("q4").previous == "q8"
        want = load(lm, dtype="f32", isq="q4", mmproj=mmproj, progress=False)
        assert_same_weights(served.engine.engine.model, want.model)
    finally:
        served.shutdown()


# -- around the swap -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("requantize")
    save_tiny("llama", directory)
    return directory


def tiny(directory: Path, **options: Any) -> ServedModel:
    cfg = EngineConfig(dtype="f32", kv_cache_tokens=256, **options)
    return load_model(resolve_source(str(directory)), cfg, progress=False)


@pytest.fixture
def served(tiny_dir: Path) -> Iterator[ServedModel]:
    model = tiny(tiny_dir)
    yield model
    model.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> dict[str | None, list[int]]:
    """Greedy tokens of PROMPT, unquantized and under --isq q8."""
    out: dict[str | None, list[int]] = {}
    for method in (None, "q8"):
        model = tiny(tiny_dir, isq=method)
        out[method] = asyncio.run(_tokens(_submit(model)))
        model.shutdown()
    return out


def _submit(model: ServedModel) -> AsyncIterator[RequestOutput]:
    return model.engine.generate(PROMPT, GREEDY)


async def _tokens(stream: AsyncIterator[RequestOutput]) -> list[int]:
    return [t async for out in stream for t in out.token_ids]


def _dense(model: ServedModel) -> bool:
    layers = model.engine.engine.model.layers
    return all(m.dense for m in layers.modules() if isinstance(m, Linear))


def test_new_requests_wait_while_the_running_ones_finish_on_the_old_weights(
    served: ServedModel, expected: dict[str | None, list[int]]
) -> None:
    slot = ModelSlot.of_loaded(served)

    async def run() -> None:
        running = served.engine.submit(PROMPT, GREEDY)  # in flight until read to its end
        swap = asyncio.create_task(slot.requantize("q8", drain_timeout=600))
        while slot.status is not ModelStatus.REQUANTIZING:  # the new weights are ready
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(slot.ensure_loaded())
        for _ in range(20):
            await asyncio.sleep(0)
        assert not waiting.done() and not swap.done()  # both wait for the running request
        assert served.isq is None and _dense(served)
        assert await _tokens(running) == expected[None]  # all of it on the old weights
        report = await swap
        assert await waiting is served
        assert (report.drained, report.change.method, served.isq) == (1, "q8", "q8")
        assert slot.status is ModelStatus.LOADED and not _dense(served)
        assert await _tokens(_submit(served)) == expected["q8"]

    asyncio.run(run())


def test_a_request_running_past_the_deadline_calls_the_swap_off(
    served: ServedModel, expected: dict[str | None, list[int]]
) -> None:
    slot = ModelSlot.of_loaded(served)

    async def run() -> None:
        running = served.engine.submit(PROMPT, GREEDY)
        with pytest.raises(ConflictError, match="still run"):
            await slot.requantize("q8", drain_timeout=0)
        assert slot.status is ModelStatus.LOADED and served.isq is None and _dense(served)
        assert await _tokens(running) == expected[None]
        assert await _tokens(_submit(served)) == expected[None]  # serving on as it was

    asyncio.run(run())


def test_bad_requests_change_nothing(served: ServedModel) -> None:
    slot = ModelSlot.of_loaded(served)
    with pytest.raises(QuantizeError, match="unknown"):
        asyncio.run(slot.requantize("q5", drain_timeout=0))
    adapter = served.with_adapter("fox", "fox")
    with pytest.raises(QuantizeError, match="LoRA adapter"):
        adapter.prepare_requantize("q8")
    assert slot.status is ModelStatus.LOADED and served.isq is None and _dense(served)


def test_the_swap_is_refused_while_a_request_is_under_way(
    tiny_dir: Path, expected: dict[str | None, list[int]]
) -> None:
    """Called directly, with no drain: a request that has computed tokens keeps the weights
    it started with (the caller steps the engine here, so the swap runs at once)."""
    served = load_model(
        resolve_source(str(tiny_dir)),
        EngineConfig(dtype="f32", kv_cache_tokens=256),
        progress=False,
        loop=CallerLoop(),
    )
    engine = served.engine.engine
    engine.add_request("a", PROMPT, GREEDY)
    tokens = [t for out in engine.step() for t in out.token_ids]  # the prompt, a first token
    with pytest.raises(RuntimeError, match="drain them first"):
        served.requantize("q8")
    assert served.isq is None and _dense(served)
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    assert tokens == expected[None]
    served.shutdown()
    with pytest.raises(EngineStoppedError):
        served.swap_weights(served.prepare_requantize("q8")).result()
