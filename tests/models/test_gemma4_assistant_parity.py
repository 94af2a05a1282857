"""Gemma 4's drafting assistant (models/gemma4_assistant.py, engine/draft_model.py's
AssistantDrafter) against transformers' Gemma4AssistantForCausalLM, on the tiny random decoder
of tests/models/tiny_gemma4.py and a tiny random assistant for it (its own sliding window; with
and without the ordered head that scores only some token clusters).

The oracle is transformers' own multi-token candidate generator's first round after a prompt:
the served model's normed last hidden state and the embedding of the token it chose, at that
token's position, over the served model's stored keys and values; each next draft from the
assistant's own projected hidden state and the drafted token. Our assistant reads the keys and
values from our decoder's paged cache, as the engine runs it: every draft's logits within f32
tolerance, and the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inferd.engine.draft_model import AssistantDrafter
from inferd.engine.sampling import SamplingParams
from inferd.layers.attention import AttentionMetadata, PrefillChunk
from inferd.loading.hf_model import load_gemma4_assistant, load_safetensors_model
from inferd.models.gemma4 import Gemma4ForCausalLM
from tests.engine.helpers import make_request
from tests.models.tiny_gemma4 import save_tiny_gemma4_assistant, save_tiny_gemma4_text

LOGIT_TOLERANCE = 1e-4  # float32 on both sides: only summation order differs
DRAFTS = 4
BLOCK = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Gemma4ForCausalLM]:
    directory: Path = tmp_path_factory.mktemp("gemma4_target")
    hf = save_tiny_gemma4_text(directory, seed=3)
    ours, _ = load_safetensors_model(directory, torch.float32, progress=False)
    assert isinstance(ours, Gemma4ForCausalLM)
    return hf, ours


def _prompt(n: int) -> list[int]:
    return torch.randint(5, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _reference(hf: Any, assistant: Any, ids: list[int]) -> tuple[int, list[torch.Tensor]]:
    """transformers: the served model's greedy token after ``ids`` and the assistant's logits
    for each draft of the round that follows it."""
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = hf(input_ids, output_hidden_states=True, return_shared_kv_states=True)
        token = out.logits[0, -1].argmax().view(1, 1)
        hidden = out.hidden_states[-1][:, -1:]
        steps = []
        for _ in range(DRAFTS):
            embedded = hf.get_input_embeddings()(token)
            drafted = assistant(
                inputs_embeds=torch.cat([embedded, hidden], dim=-1),
                attention_mask=torch.ones(1, len(ids) + 1, dtype=torch.long),
                position_ids=torch.tensor([[len(ids)]]),
                shared_kv_states=out.shared_kv_states,
                use_cache=False,
            )
            steps.append(drafted.logits[0, -1])
            token, hidden = drafted.logits.argmax(-1), drafted.last_hidden_state
    return int(out.logits[0, -1].argmax()), steps


def _prefill(model: Gemma4ForCausalLM, ids: list[int]) -> tuple[torch.Tensor, list, list[int]]:
    """Our decoder over the prompt in paged blocks: its normed hidden states, its caches and
    the prompt's block table."""
    n = len(ids)
    blocks = -(-n // BLOCK) + 1  # room for the token after the prompt
    caches = []
    for layer in range(model.config.num_layers):
        shape = (blocks + 1, BLOCK, *model.config.kv_shape(layer))
        caches.append((torch.zeros(shape), torch.zeros(shape)))
    table, pos = torch.arange(1, blocks + 1), torch.arange(n)
    meta = AttentionMetadata(
        slot_mapping=table[pos // BLOCK] * BLOCK + pos % BLOCK,
        decode_rows=None,
        decode_block_tables=None,
        decode_lens=None,
        prefills=(PrefillChunk(0, n, 0, table, None),),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), pos, meta, caches)
    return hidden, [caches[s] for s in model.kv_sources], table.tolist()


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered-head", "plain-head"])
@pytest.mark.parametrize("length", [3, 23])  # inside and past both sliding windows
def test_drafts_match_transformers(
    target: tuple[Any, Gemma4ForCausalLM],
    tmp_path: Path,
    ordered: bool,
    length: int,
) -> None:
    hf, ours = target
    hf_assistant = save_tiny_gemma4_assistant(tmp_path, ordered=ordered)
    assistant = load_gemma4_assistant(tmp_path, torch.float32, progress=False)
    drafter = AssistantDrafter(assistant, ours)
    ids = _prompt(length)
    first, expected = _reference(hf, hf_assistant, ids)

    hidden, caches, table = _prefill(ours, ids)
    drafter.share(None, caches)  # type: ignore[arg-type]  # reads the caches only
    assert int(ours.compute_logits(hidden[-1:])[0].argmax()) == first
    request = make_request("r", 0, prompt=ids)
    request.params = SamplingParams(max_tokens=DRAFTS + 1, temperature=0)
    request.output_token_ids = [first]
    request.num_computed_tokens = length
    request.block_ids = table
    request.draft_hidden = hidden[-1]
    after = drafter.round(request)
    assert after is not None
    token, tokens = first, []
    for want in expected:
        logits = after(token)
        assert (logits - want).abs().max() < LOGIT_TOLERANCE
        token = int(logits.argmax())
        tokens.append(token)
    assert drafter.propose(request, DRAFTS).tokens == tokens
    assert tokens == [int(w.argmax()) for w in expected]
