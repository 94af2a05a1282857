"""Gemma 4's drafting assistant as the draft model of ``--speculative draft`` on the tiny random
Gemma 4 decoder (tests/models/tiny_gemma4.py): the greedy tokens are transformers' generate's,
in process and through ``inferd serve``, whether drafts stand or not, alone and batched; the
drafted and accepted counts are reported (the engine's stats, /metrics); every KV block is
free after; an assistant made for another model is refused at startup."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from inferd import LLM, SamplingParams
from inferd.serving.loading import ModelLoadError
from tests.engine.bits import run_bits
from tests.models.tiny_gemma4 import save_tiny_gemma4_assistant, save_tiny_gemma4_text
from tests.server.live import live_server

NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    target = tmp_path_factory.mktemp("gemma4_target")
    assistant = tmp_path_factory.mktemp("gemma4_assistant")
    hf = save_tiny_gemma4_text(target, seed=3)
    save_tiny_gemma4_assistant(assistant)
    return target, assistant, hf


@pytest.fixture(scope="module")
def engines(checkpoints: tuple[Path, Path, Any]) -> Iterator[dict[str, LLM]]:
    target, assistant, _ = checkpoints
    settings: dict[str, Any] = {"dtype": "f32", "max_model_len": 256}
    with (
        LLM(str(target), speculative="off", **settings) as off,
        LLM(str(target), speculative="draft", draft_model=str(assistant), **settings) as draft,
    ):
        yield {"off": off, "draft": draft}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(5, 300, (n,), generator=g).tolist() for n in (9, 30)]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=NEW, temperature=0, logprobs=1, ignore_eos=True)


def _transformers(hf: Any, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids) :].tolist()


def test_greedy_tokens_are_transformers_whatever_is_drafted(
    engines: dict[str, LLM], checkpoints: tuple[Path, Path, Any]
) -> None:
    prompts = _prompts()
    llm = engines["draft"]
    before = llm.engine.stats()
    alone = [run_bits(llm, [p], [_greedy()])[0] for p in prompts]
    together = run_bits(llm, prompts, [_greedy(), _greedy()])
    after = llm.engine.stats()
    plain = run_bits(engines["off"], prompts, [_greedy(), _greedy()])
    for ids, one, batched, unspeculated in zip(prompts, alone, together, plain, strict=True):
        expected = _transformers(checkpoints[2], ids)
        assert list(one[0]) == list(batched[0]) == list(unspeculated[0]) == expected
    drafted = after.speculative_drafted - before.speculative_drafted
    accepted = after.speculative_accepted - before.speculative_accepted
    assert drafted > 0 and 0 <= accepted <= drafted
    assert after.kv_blocks_used == 0


def test_served_with_the_assistant_through_the_cli(
    checkpoints: tuple[Path, Path, Any], tmp_path: Path
) -> None:
    target, assistant, hf = checkpoints
    args = ["-m", str(target), "--dtype", "f32", "--speculative", "draft"]
    args += ["--draft-model", str(assistant)]
    ids = _prompts()[1]
    with live_server(args, tmp_path / "serve.log") as live:
        reply = httpx.post(
            live.api + "/completions",
            json={
                "model": "default",
                "prompt": ids,
                "max_tokens": NEW,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(live.url + "/metrics", timeout=10).text
    text = Tokenizer.from_file(str(target / "tokenizer.json")).decode(_transformers(hf, ids))
    assert reply.json()["choices"][0]["text"] == text
    counter = r"^inferd_speculative_draft_tokens_total(?:\{[^}]*\})? (\S+)$"
    drafted = re.search(counter, metrics, re.M)
    assert drafted is not None and float(drafted.group(1)) > 0
    assert "inferd_speculative_accepted_tokens_total" in metrics


def test_an_assistant_for_another_model_is_refused(
    checkpoints: tuple[Path, Path, Any], tmp_path: Path
) -> None:
    target, _, _ = checkpoints
    other = tmp_path / "other"
    other.mkdir()
    save_tiny_gemma4_assistant(other, backbone=48)  # made for a model 48 wide
    with pytest.raises(ModelLoadError, match="48 wide"):
        LLM(str(target), speculative="draft", draft_model=str(other), dtype="f32")
