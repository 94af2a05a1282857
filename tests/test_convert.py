"""inferd convert: the real default model (a Q4_1 GGUF) out as a Hugging Face directory, and back
in with identical logits; transformers reads the directory as the same model. The same for the
tiny Gemma 4 (dense, and with experts) and Gemma 3n as llama.cpp's converter writes them (Q8_0),
which become transformers' text models; a config transformers cannot say, and an architecture
convert does not write, are refused with the reason."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.cli import main
from inferd.convert import ConvertError, hf_config_dict
from inferd.loading.gguf import GGUFFile
from inferd.loading.gguf_model import load_gguf_model
from inferd.loading.hf_model import load_safetensors_model, load_tokenizer
from inferd.loading.tokenizer import tokenizer_from_gguf
from tests.models.test_llama_parity import PROMPTS, full_forward


@pytest.fixture(scope="module")
def converted(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("convert") / "smollm2-hf"
    assert main(["convert", str(smollm2_gguf), str(out)]) == 0
    return out


def test_layout_is_transformers(converted: Path) -> None:
    names = sorted(p.name for p in converted.iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert config["num_key_value_heads"] == 3 and config["rope_parameters"]["rope_theta"] == 1e5
    tok_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"] and tok_config["eos_token"] == "<|im_end|>"
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2


def test_round_trip_logits_are_identical(smollm2_gguf: Path, converted: Path) -> None:
    gguf = GGUFFile(smollm2_gguf)
    original, _ = load_gguf_model(gguf, torch.float32, progress=False)
    again, cfg = load_safetensors_model(converted, torch.float32, progress=False)
    tokenizer = tokenizer_from_gguf(gguf.metadata)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert torch.equal(full_forward(original, ids), full_forward(again, ids))
    reread = load_tokenizer(converted, cfg)
    assert reread.token_bytes == tokenizer.token_bytes
    assert reread.special_ids == tokenizer.special_ids
    assert (reread.bos_token_id, reread.eos_token_id, reread.add_bos) == (1, 2, False)
    for prompt in PROMPTS:
        assert reread.encode(prompt, add_special=True) == tokenizer.encode(prompt, add_special=True)


def test_transformers_reads_the_directory(smollm2_gguf: Path, converted: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, _ = load_gguf_model(GGUFFile(smollm2_gguf), torch.float32, progress=False)
    hf: Any = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    tok: Any = AutoTokenizer.from_pretrained(str(converted))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_forward(ours, ids), ref, atol=2e-4, rtol=1e-4)


def test_refuses_a_non_empty_directory(
    smollm2_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["convert", str(smollm2_gguf), str(tmp_path)]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize(
    ("fixture", "architecture"),
    [
        ("tiny_gemma4_gguf", "Gemma4ForCausalLM"),
        ("tiny_gemma4_moe_gguf", "Gemma4ForCausalLM"),
        ("tiny_gemma3n_gguf", "Gemma3nForCausalLM"),
    ],
)
def test_a_gemma_gguf_becomes_the_transformers_text_model(
    fixture: str, architecture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = request.getfixturevalue(fixture).files["lm-q8_0"]
    out = tmp_path / "hf"
    assert main(["convert", str(gguf), str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    original, cfg = load_gguf_model(GGUFFile(gguf), torch.float32, progress=False)
    again, read_back = load_safetensors_model(out, torch.float32, progress=False)
    assert read_back == cfg
    tok: Any = AutoTokenizer.from_pretrained(str(out))
    content = [{"type": "text", "text": "The storm rolled in over the grey sea, wave by wave."}]
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer_from_gguf(GGUFFile(gguf).metadata).encode(text)
    logits = full_forward(original, ids)
    assert torch.equal(full_forward(again, ids), logits)
    hf: Any = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=2e-4, rtol=1e-4)


def test_a_gemma_shape_transformers_cannot_say_is_refused(tiny_gemma4_gguf: Any) -> None:
    """Global layers with a K/V head count of their own, their values not their keys: Gemma 4's
    config names that count only for ``attention_k_eq_v``."""
    from inferd.loading.gguf_model import gguf_config

    cfg = gguf_config(GGUFFile(tiny_gemma4_gguf.files["lm-f32"]))
    assert cfg.gemma4 is not None and cfg.gemma4.global_kv_heads != cfg.num_kv_heads
    hf_config_dict(cfg)  # as converted: it reads back
    apart = replace(cfg, gemma4=replace(cfg.gemma4, k_eq_v=False))
    with pytest.raises(ConvertError, match="gemma4_text config cannot express this model"):
        hf_config_dict(apart)


def test_an_architecture_convert_does_not_write_is_refused(
    gemma3_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["convert", str(gemma3_gguf), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "convert does not write gemma3 models yet" in err and "Traceback" not in err
    assert not (tmp_path / "hf").exists()
