"""The scripted tiny Qwen3 (tests/models/tiny_qwen3.py) against transformers: logits within
1e-4 in float32, the greedy reply the script promises under both, and Qwen3's chat template
rendering (thinking on and off, reasoning in history, tools) to the same token ids as
transformers' ``apply_chat_template``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.config import EngineConfig
from inferd.loading.hf_model import load_safetensors_model
from inferd.serving.served import ServedModel, load_model
from tests.models.test_llama_parity import full_forward
from tests.models.tiny_qwen3 import REPLY, THINKING_REPLY, save_tiny_qwen3

USER = {"role": "user", "content": "What comes next: 1, 1, 2, 3?"}
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    USER,
    {"role": "assistant", "content": "<think>\nadd the two before\n</think>\n\n5"},
    {"role": "user", "content": "And then?"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "next_term",
        "description": "The next Fibonacci number.",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
}
CALLED: list[dict[str, Any]] = [
    USER,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "next_term", "arguments": {"n": 5}}}],
    },
    {"role": "tool", "content": "5"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("qwen3")
    return directory, save_tiny_qwen3(directory)


@pytest.fixture(scope="module")
def served(checkpoint: tuple[Path, Any]) -> Any:
    model = load_model(
        checkpoint[0],
        EngineConfig(dtype="f32", block_size=4, kv_cache_tokens=512, max_num_seqs=2),
        progress=False,
    )
    yield model
    model.shutdown()


def _hf_ids(directory: Path, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _ours(model: ServedModel, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    rendered = model.render_chat(messages, **kwargs)
    return model.tokenizer.encode(rendered.text, literal_spans=rendered.literal_spans)


def test_logits_match_transformers(checkpoint: tuple[Path, Any]) -> None:
    directory, hf = checkpoint
    model, cfg = load_safetensors_model(directory, torch.float32, progress=False)
    assert cfg.architecture == "qwen3" and cfg.qk_norm
    ids = _hf_ids(directory, HISTORY)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    for block_size in (4, 16):
        torch.testing.assert_close(full_forward(model, ids, block_size), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "messages,kwargs",
    [
        ([USER], {}),
        ([USER], {"enable_thinking": False}),
        ([USER], {"enable_thinking": True}),
        (HISTORY, {}),
        (CALLED, {"tools": [TOOL]}),
    ],
)
def test_template_renders_as_transformers_does(
    checkpoint: tuple[Path, Any], served: ServedModel, messages: Any, kwargs: dict[str, Any]
) -> None:
    tools = kwargs.pop("tools", None)
    ours = _ours(served, messages, tools=tools, variables=kwargs)
    assert ours == _hf_ids(checkpoint[0], messages, tools=tools, **kwargs)
    # the earlier turn's reasoning is dropped (it came before the last user query)
    if messages is HISTORY:
        assert "add the two" not in served.tokenizer.decode(ours)


@pytest.mark.parametrize("thinking,reply", [(True, THINKING_REPLY), (False, REPLY)])
def test_greedy_reply_follows_the_script(
    checkpoint: tuple[Path, Any], thinking: bool, reply: str
) -> None:
    """Under transformers as well: the script is in the weights, not in inferd."""
    directory, hf = checkpoint
    ids = _hf_ids(directory, [USER], enable_thinking=thinking)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=12,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(str(directory)).decode(out[0, len(ids) :])
    assert isinstance(text, str) and text.startswith(reply + "<|im_end|>")
