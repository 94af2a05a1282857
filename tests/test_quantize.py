"""In-situ quantization (--isq q8|q4): quality on the real default model, the kernels, the store.

Perplexity of SmolLM2-135M-Instruct (the default model, float32 compute) on a fixed ~300-token
text. Measured on this code: unquantized 30.021, q8 30.082 (+0.20%), q4 30.047 (+0.09%).
Bounds: q8 within 1% (the requirement). q4 within 1% as well: the default model's projections
are already Q4_1 (int4 in groups of 32) in the GGUF, and q4 uses the same groups, so it re-packs
them almost losslessly (what remains is the kernel's bf16 scales and bf16 activations); a q4
that lost the group layout would land far outside 1%. q8 loses more than q4 here because one
int8 scale per row cannot follow Q4_1's per-group offsets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.cli import main
from inferd.config import EngineConfig
from inferd.doctor import store_info
from inferd.layers.linear import Linear, PackedKind, pack_int4, pack_int8
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import load_safetensors_model
from inferd.loading.quantize import Isq, QuantizeError, isq_for, linear_modules, quantize_weight
from inferd.loading.tokenizer import tokenizer_from_gguf
from inferd.models.llama import LlamaForCausalLM
from inferd.serving.served import load_model
from inferd.source import resolve_source
from tests.models.test_llama_parity import full_forward
from tests.models.tiny import save_tiny

TEXT = """\
The lighthouse stood at the end of a long stone pier, and for forty years the same family had \
kept its lamp burning. Every evening at dusk the keeper climbed the one hundred and twelve steps \
of the spiral staircase, trimmed the wick, polished the great lens, and wound the clockwork that \
turned the light. Ships passing along the coast counted the flashes to know which headland they \
were passing: three short flashes and a long pause meant the rocks of the northern point, where \
many vessels had been lost before the tower was built.

In the winter the storms came from the west. Waves broke over the pier and threw spray as high \
as the gallery, and the keeper would sit by the window with a cup of tea, listening to the wind \
and writing in the logbook. He recorded the direction of the wind, the state of the sea, the \
ships he saw, and anything unusual: a flock of birds resting on the rail, a fishing boat that \
came in late, a strange light far out on the water that never came closer.

When electricity finally reached the village, engineers arrived to install an automatic lamp. \
The keeper showed them the old machinery, explained how the weights fell through the centre of \
the tower, and asked whether the new light would still flash three times and pause. They \
assured him that it would. He stayed one more winter to be sure, and then moved into a small \
house on the hill, from which he could still see the beam sweep across the bay every night.
"""


@pytest.fixture(scope="module")
def text_ids(smollm2_gguf: Path) -> list[int]:
    ids = tokenizer_from_gguf(GGUFFile(smollm2_gguf).metadata).encode(TEXT)
    assert 250 < len(ids) < 400
    return ids


def _perplexity(model: LlamaForCausalLM, ids: list[int]) -> float:
    logits = full_forward(model, ids)
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())


@pytest.fixture(scope="module")
def perplexities(smollm2_gguf: Path, text_ids: list[int]) -> dict[str | None, float]:
    gguf = GGUFFile(smollm2_gguf)
    out = {}
    for method in (None, "q8", "q4"):
        isq = Isq(method) if method else None
        model, _ = load_gguf_model(gguf, torch.float32, progress=False, isq=isq)
        out[method] = _perplexity(model, text_ids)
    return out


def test_q8_perplexity_within_one_percent(perplexities: dict[str | None, float]) -> None:
    base, q8 = perplexities[None], perplexities["q8"]
    assert 25 < base < 35  # the model reads English
    assert abs(q8 / base - 1) < 0.01, perplexities


def test_q4_perplexity_within_measured_bound(perplexities: dict[str | None, float]) -> None:
    assert abs(perplexities["q4"] / perplexities[None] - 1) < 0.01, perplexities


@pytest.mark.parametrize("kind", [PackedKind.INT4, PackedKind.INT8])
def test_portable_form_gives_the_kernels_of_linear_pack(kind: PackedKind) -> None:
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(0))
    mine = quantize_weight(w, kind).kernel_tensors(torch.bfloat16)
    theirs = (pack_int4 if kind is PackedKind.INT4 else pack_int8)(w, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    # and the integer form dequantizes to what the kernel multiplies by
    layer = Linear(128, 96).to(torch.bfloat16)
    layer.use_packed_only(kind, *mine)
    eye = torch.eye(128, dtype=torch.bfloat16)
    torch.testing.assert_close(
        layer(eye).T.float(), quantize_weight(w, kind).dequantize(), atol=2e-2, rtol=1e-2
    )


def test_int4_falls_back_to_int8_where_the_kernel_cannot_pack() -> None:
    assert quantize_weight(torch.randn(72, 64), PackedKind.INT4).kind is PackedKind.INT8
    assert quantize_weight(torch.randn(64, 48), PackedKind.INT4).kind is PackedKind.INT8
    assert quantize_weight(torch.randn(64, 64), PackedKind.INT4).kind is PackedKind.INT4


@pytest.mark.parametrize("method", ["q8", "q4"])
def test_isq_drops_dense_weights_and_serves_every_batch(method: str, tmp_path: Path) -> None:
    save_tiny("qwen2", tmp_path)  # q/k/v biases, tied embeddings
    dense, _ = load_safetensors_model(tmp_path, torch.float32, progress=False)
    model, _ = load_safetensors_model(tmp_path, torch.float32, progress=False, isq=Isq(method))
    kinds = {name: layer.packed_kind for name, layer in linear_modules(model)}
    assert kinds.pop("lm_head") is None  # tied: the dense embedding serves as the head
    assert set(kinds.values()) == {PackedKind.INT4 if method == "q4" else PackedKind.INT8}
    assert all(not layer.dense for name, layer in linear_modules(model) if name != "lm_head")
    ids = list(range(3, 3 + 40))  # one prefill of 40 rows, well past the small-batch limit
    ref = full_forward(dense, ids)
    # What the kernels must compute: the dense model with the quantized weights put back.
    with torch.no_grad():
        for name, layer in linear_modules(dense):
            if name != "lm_head":
                layer.weight.copy_(quantize_weight(layer.weight, kinds[name]).dequantize())
    expected, got = full_forward(dense, ids), full_forward(model, ids)
    assert _cosine(expected, got) > 0.9995  # only the kernels' bf16 arithmetic differs
    # int4 of random Gaussian weights (no structure to keep) costs more than int8 of them
    assert _cosine(ref, got) > (0.99 if method == "q8" else 0.8)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()


def test_isq_through_the_engine(tmp_path: Path) -> None:
    import asyncio

    from inferd.engine.sampling import SamplingParams

    save_tiny("llama", tmp_path)  # untied head: q8 under both methods
    served = load_model(
        resolve_source(str(tmp_path)),
        EngineConfig(dtype="bf16", isq="q4", kv_cache_tokens=128),
        progress=False,
    )
    try:
        assert served.isq == "q4"
        head = served.engine.engine.model.lm_head
        assert head.packed_kind is PackedKind.INT8 and not head.dense

        async def run() -> list[int]:
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            prompt = served.chat_prompt([{"role": "user", "content": "hello"}]).ids
            return [t async for o in served.engine.generate(prompt, params) for t in o.token_ids]

        assert len(asyncio.run(run())) == 6
    finally:
        served.shutdown()


class _ReadLog(GGUFFile):
    """A GGUF file that remembers which tensors were read."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.read: list[str] = []

    def load_tensor(self, name: str) -> torch.Tensor:  # type: ignore[override]
        self.read.append(name)
        return super().load_tensor(name)


def test_quantize_command_stores_and_a_restart_reuses_it(
    smollm2_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    text_ids: list[int],
) -> None:
    monkeypatch.setenv("INFERD_HOME", str(tmp_path))
    assert main(["quantize", "-m", str(smollm2_gguf), "--isq", "q4"]) == 0
    (folder,) = (tmp_path / "quantized").iterdir()
    manifest: dict[str, Any] = json.loads((folder / "manifest.json").read_text())
    source = resolve_source(str(smollm2_gguf))
    assert manifest["source_digest"] == source.digest
    assert (manifest["method"], manifest["group_size"], manifest["format"]) == (
        "q4",
        32,
        "inferd-isq/1",
    )
    assert main(["quantize", "-m", str(smollm2_gguf), "--isq", "q4"]) == 0
    assert "already in the store" in capsys.readouterr().out
    (listed,) = store_info(tmp_path)["quantized"]  # what `inferd doctor` reports
    assert listed["source_digest"] == f"sha256:{source.digest}" and listed["group_size"] == 32

    # A restart: the projections come from the store, their GGUF tensors are never read.
    isq = isq_for("q4", source.digest)
    assert isq is not None and len(isq.stored) == 30 * 4
    gguf = _ReadLog(smollm2_gguf)
    stored, _ = load_gguf_model(gguf, torch.float32, progress=False, isq=isq)
    assert not [n for n in gguf.read if n.startswith("blk.") and "norm" not in n]
    in_situ, _ = load_gguf_model(
        GGUFFile(smollm2_gguf), torch.float32, progress=False, isq=Isq("q4")
    )
    assert torch.equal(full_forward(stored, text_ids[:64]), full_forward(in_situ, text_ids[:64]))

    # ... and so does a served model; the model card names the method
    served = load_model(
        source, EngineConfig(dtype="f32", isq="q4", kv_cache_tokens=64), progress=False
    )
    try:
        assert served.isq == "q4"
        assert not served.engine.engine.model.layers[0].mlp.down_proj.dense
    finally:
        served.shutdown()

    # A store file that no longer matches its manifest is refused, not half-used.
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(QuantizeError, match="sha256"):
        isq_for("q4", source.digest)


def test_isq_names_are_checked() -> None:
    with pytest.raises(ValueError, match="isq must be q8 or q4"):
        EngineConfig(isq="q5")
