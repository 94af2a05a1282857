"""Tokenizers of Hugging Face directories: the byte table (byte-level BPE and SentencePiece byte
fallback), special tokens, BOS/EOS, chat templates and generation stops."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from inferd.config import EngineConfig
from inferd.loading.hf_model import generation_stop_ids
from inferd.loading.hf_tokenizer import chat_template_source, tokenizer_from_hf
from inferd.serving.served import load_model
from tests.models.tiny import CHATML, CORPUS, VOCAB, save_tiny, with_byte_fallback, write_tokenizer

TEXTS = [
    "The quick brown fox.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Émile a écrit 三个字 and an emoji 🙂 — then stopped.",
    "<|im_start|>user\nhi<|im_end|>",
]


def _joined(ids: list[int], table: Callable[[int], bytes]) -> bytes:
    return b"".join(table(i) for i in ids)


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("bpe")
    write_tokenizer(directory)
    return directory


def test_byte_level_matches_transformers(byte_level_dir: Path) -> None:
    from transformers import AutoTokenizer

    bundle = tokenizer_from_hf(byte_level_dir)
    theirs = AutoTokenizer.from_pretrained(str(byte_level_dir))
    assert bundle.model_type == "gpt2" and not bundle.add_bos and bundle.vocab_size == VOCAB
    for text in TEXTS:
        ids = bundle.encode(text, add_special=True)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        assert _joined(ids, bundle.id_to_bytes).decode() == text
    start, end = (bundle.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert {start, end} <= bundle.special_ids
    assert bundle.eos_token == "<|im_end|>" and bundle.eos_token_id == end
    assert bundle.id_to_bytes(start) == b"<|im_start|>"


def test_byte_table_covers_the_model_vocabulary(byte_level_dir: Path) -> None:
    """Embedding rows past the tokenizer (padding) decode to nothing instead of failing."""
    bundle = tokenizer_from_hf(byte_level_dir, vocab_size=VOCAB + 64)
    assert bundle.vocab_size == VOCAB + 64 and bundle.id_to_bytes(VOCAB + 10) == b""


def _spm_tokenizer() -> Tokenizer:
    """Llama 2 / Mistral style: BPE on ▁-joined text, byte fallback, ▁-prefix on each text."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator([t for t in CORPUS if t.isascii()], trainer)
    spm = with_byte_fallback(tok)
    spm.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return spm


def test_sentencepiece_byte_fallback(tmp_path: Path) -> None:
    tok = _spm_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    bundle = tokenizer_from_hf(tmp_path)
    assert bundle.model_type == "llama" and bundle.add_space_prefix and bundle.add_bos
    assert (bundle.bos_token_id, bundle.eos_token_id) == (1, 2)
    text = "héllo 🙂 the fox"
    ids = bundle.encode(text, add_special=True)
    assert ids[0] == 1
    pieces = [bundle.tokenizer.id_to_token(i) for i in ids]
    assert "<0xC3>" in pieces and "<0xF0>" in pieces  # non-ASCII fell back to bytes
    assert bundle.id_to_bytes(bundle.tokenizer.token_to_id("<0xC3>")) == b"\xc3"
    raw = _joined(ids[1:], bundle.id_to_bytes)
    assert raw == b" " + text.encode()  # the byte table keeps the prefix space
    assert bundle.decode(ids) == text


def test_add_bos_follows_the_post_processor(tmp_path: Path) -> None:
    from tokenizers.processors import TemplateProcessing

    tok = _spm_tokenizer()
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert tokenizer_from_hf(tmp_path).add_bos
    tok.post_processor = None
    tok.save(str(tmp_path / "tokenizer.json"))
    assert not tokenizer_from_hf(tmp_path).add_bos


def test_chat_template_sources(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "T"},
                    {"name": "default", "template": "D"},
                ]
            }
        )
    )
    assert chat_template_source(tmp_path) == "D"
    (tmp_path / "chat_template.jinja").write_text("J")  # transformers v5 writes this file
    assert chat_template_source(tmp_path) == "J"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert chat_template_source(tmp_path) is None


def test_generation_config_stops_reach_the_engine(tmp_path: Path) -> None:
    save_tiny("llama", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5, 7]}))
    assert generation_stop_ids(tmp_path) == [2, 5, 7]
    served = load_model(tmp_path, EngineConfig(dtype="f32", kv_cache_tokens=64), progress=False)
    try:
        assert {2, 5, 7} <= served.engine.codec.eos_token_ids
        assert served.chat_template.source == CHATML
        assert served.tokenizer.eos_token == "<|im_end|>"
    finally:
        served.shutdown()
