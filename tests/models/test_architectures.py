"""Every supported architecture against transformers, on tiny random checkpoints saved with
``save_pretrained``: logits through the paged path, and greedy generations through the engine
(two requests at once, small KV blocks, prompts longer than the sliding windows)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.config import EngineConfig
from inferd.convert import hf_config_dict
from inferd.engine.sampling import SamplingParams
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import load_safetensors_model
from inferd.models.config import ModelConfigError, config_from_hf
from inferd.serving.served import load_model
from tests.kernels.choice import OPS_NAMES, ops_named
from tests.models.test_llama_parity import full_forward
from tests.models.tiny import ARCHITECTURES, SLIDING_WINDOW, save_tiny, write_gguf

PROMPT = [{"role": "user", "content": "The quick brown fox jumps over 12345 lazy dogs."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """arch -> (checkpoint directory, the transformers model that wrote it)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: (root / arch, save_tiny(arch, root / arch)) for arch in ARCHITECTURES}


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return list(out[0, len(ids) :].tolist())


@pytest.mark.parametrize("ops_name", OPS_NAMES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers(
    arch: str, ops_name: str, tiny: dict[str, tuple[Path, Any]]
) -> None:
    directory, hf = tiny[arch]
    model, cfg = load_safetensors_model(directory, torch.float32, progress=False)
    model.use_kernels(ops_named(ops_name))
    assert cfg.architecture == arch
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(3 * SLIDING_WINDOW + 5)]
    ref = _hf_logits(hf, ids)
    for block_size in (4, 16):  # several blocks per sequence, and one
        torch.testing.assert_close(full_forward(model, ids, block_size), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ops_name", OPS_NAMES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_greedy_equals_transformers_generate(
    arch: str, ops_name: str, tiny: dict[str, tuple[Path, Any]]
) -> None:
    directory, hf = tiny[arch]
    served = load_model(
        directory,
        EngineConfig(dtype="f32", block_size=4, kv_cache_tokens=512, max_num_seqs=4),
        progress=False,
    )
    try:
        # The engine picked the fused ops; the decoder is switched before any request runs.
        served.engine.engine.model.use_kernels(ops_named(ops_name))
        prompt = served.chat_prompt(PROMPT).ids
        short = prompt[: SLIDING_WINDOW + 3]
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

        async def generate(ids: list[int]) -> list[int]:
            return [t async for out in served.engine.generate(ids, params) for t in out.token_ids]

        async def both() -> list[list[int]]:
            return list(await asyncio.gather(generate(prompt), generate(short)))

        ours = asyncio.run(both())
    finally:
        served.shutdown()
    assert len(prompt) > 2 * SLIDING_WINDOW
    assert ours == [_hf_greedy(hf, prompt, 10), _hf_greedy(hf, short, 10)]


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    hf = save_tiny("qwen3", tmp_path / "src", seed=3)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    (tmp_path / "sharded" / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model, _ = load_safetensors_model(tmp_path / "sharded", torch.float32, progress=False)
    ids = list(range(1, 20))
    torch.testing.assert_close(full_forward(model, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


# GGUF files as llama.cpp's converter writes them. Not Mistral: llama.cpp converts it as a
# Llama and drops the sliding window. Gemma 2 GGUFs carry no query_pre_attn_scalar (llama.cpp
# uses the head size, as Gemma 2 2B/9B do), so the checkpoint uses that value.
GGUF_CASES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "gemma2": {"query_pre_attn_scalar": 32},
    "phi3": {},
}


@pytest.mark.parametrize("arch", GGUF_CASES)
def test_gguf_and_its_conversion(arch: str, tmp_path: Path) -> None:
    """Our GGUF reading against the model that wrote it; then `convert` back to a HF directory
    that transformers itself loads as the very same model."""
    from transformers import AutoModelForCausalLM

    from inferd.convert import convert_gguf

    hf = save_tiny(arch, tmp_path / "src", **GGUF_CASES[arch])
    write_gguf(hf, tmp_path / "tiny.gguf")
    model, cfg = load_gguf_model(GGUFFile(tmp_path / "tiny.gguf"), torch.float32, progress=False)
    ids = [(5 * i + 1) % cfg.vocab_size for i in range(3 * SLIDING_WINDOW)]
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(full_forward(model, ids, 4), ref, atol=1e-4, rtol=1e-4)

    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32, attn_implementation="eager"
    )
    torch.testing.assert_close(_hf_logits(theirs, ids), ref, atol=1e-5, rtol=1e-5)
    again, _ = load_safetensors_model(tmp_path / "out", torch.float32, progress=False)
    assert torch.equal(full_forward(again, ids, 4), full_forward(model, ids, 4))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_reads_our_gguf_files_alike(arch: str, tmp_path: Path) -> None:
    """transformers' own GGUF reader (which follows llama.cpp; it handles these two fully)
    agrees the test files are the models: the writer's layout is llama.cpp's."""
    from transformers import AutoModelForCausalLM

    hf = save_tiny(arch, tmp_path / "src")
    write_gguf(hf, tmp_path / "tiny.gguf")
    theirs = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32
    )
    ids = list(range(3, 30))
    torch.testing.assert_close(_hf_logits(theirs, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_json_round_trip(arch: str, tiny: dict[str, tuple[Path, Any]]) -> None:
    """What convert writes reads back as the same config."""
    directory, _ = tiny[arch]
    hf = json.loads((directory / "config.json").read_text())
    cfg = config_from_hf(hf, has_lm_head=not hf.get("tie_word_embeddings"))
    assert config_from_hf(hf_config_dict(cfg)) == cfg


def test_feature_flags_read_from_config(tiny: dict[str, tuple[Path, Any]]) -> None:
    def cfg(arch: str) -> Any:
        return config_from_hf(json.loads((tiny[arch][0] / "config.json").read_text()))

    gemma, mistral, phi3 = cfg("gemma2"), cfg("mistral"), cfg("phi3")
    assert gemma.sliding_layers == (0,) and gemma.sliding_window == SLIDING_WINDOW
    assert (gemma.attn_softcap, gemma.final_softcap, gemma.hidden_act) == (2.0, 5.0, "gelu_tanh")
    assert gemma.attention_scale == pytest.approx(24**-0.5)
    assert mistral.sliding_layers == (0, 1)
    assert cfg("qwen2").attention_bias and cfg("qwen2").tie_word_embeddings
    assert cfg("qwen3").qk_norm and cfg("qwen3").head_dim == 32
    assert phi3.rotary_dim == 8 and phi3.rotary_size == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt_neox"}, "model_type 'gpt_neox' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
        ({"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_unsupported_configs_say_why(
    change: dict[str, Any], message: str, tiny: dict[str, tuple[Path, Any]]
) -> None:
    hf = json.loads((tiny["llama"][0] / "config.json").read_text()) | change
    with pytest.raises(ModelConfigError, match=message):
        config_from_hf(hf)


def test_missing_tensor_is_named(tmp_path: Path, tiny: dict[str, tuple[Path, Any]]) -> None:
    from safetensors.torch import load_file, save_file

    directory, _ = tiny["qwen2"]
    target = tmp_path / "broken"
    target.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (target / f).write_bytes((directory / f).read_bytes())
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_safetensors_model(target, torch.float32, progress=False)
