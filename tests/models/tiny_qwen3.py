"""A tiny Qwen3 checkpoint that reasons: ``<think>`` and ``</think>`` as Qwen3 has them (added
tokens that are not special, so they stay in decoded text), Qwen3's chat template with its
``enable_thinking`` switch, and weights whose greedy reply is known in advance.

A random model never closes a think block by itself, so the reply is scripted in the weights,
honestly and without touching the server: every layer is random (attention, q/k norms, MLP)
but writes only into hidden dimensions ``SCRIPT_DIMS`` and up, while each scripted token's
embedding is a large one-hot vector in a dimension of its own below that, and the output row
of its successor points the same way. The final hidden state of a scripted token is then
dominated by its own direction, so the next token's logit leads the rest by a wide margin:
a chain of bigrams, the same under transformers and inferd. After the generation prompt
(``...assistant\\n``) the greedy reply is ``<think> fibonacci in</think>\\n\\nThe over the``
and the end of the turn; with ``enable_thinking`` false the template writes the empty block
itself and the reply is ``The over the``.
"""

# ruff: noqa: E501  (Qwen3's template keeps its own long lines)
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer

from tests.models.tiny import CORPUS, VOCAB, byte_level_tokenizer, hf_config, randomize

THINK, END_THINK = "<think>", "</think>"
# Each token is followed by the next, greedily; "Ċ" ends every generation prompt.
SCRIPT = ["Ċ", THINK, "Ġfibonacci", "Ġin", END_THINK, "ĊĊ", "The", "Ġover", "Ġthe", "<|im_end|>"]
SCRIPT_DIMS = 16  # hidden dimensions below this hold the scripted tokens' directions
THINKING_REPLY = "<think> fibonacci in</think>\n\nThe over the"
REPLY = "The over the"
REASONING, CONTENT = " fibonacci in", "\n\nThe over the"
REASONING_TOKENS = 4  # <think>, two words, </think>

# Qwen3's chat template (Qwen/Qwen3-*'s tokenizer_config.json), written out from its behaviour:
# a system turn (with tools: the tool list in <tools>), user turns, assistant turns whose
# reasoning (reasoning_content, or a <think> block in the content) is kept only after the last
# real user query, tool calls in <tool_call>, tool results as a user turn of <tool_response>s,
# and a generation prompt that writes an empty think block when enable_thinking is false.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def qwen3_tokenizer() -> Tokenizer:
    """The tiny byte-level BPE (with "\\n\\n" merged, as Qwen's is) and Qwen3's think markers
    as added, non-special tokens: 320 ids in all."""
    tok = byte_level_tokenizer(VOCAB - 2, corpus=[*CORPUS, *["\n\n"] * 64])
    tok.add_tokens([AddedToken(THINK, normalized=False), AddedToken(END_THINK, normalized=False)])
    assert tok.get_vocab_size() == VOCAB
    return tok


def script_ids(tok: Tokenizer) -> list[int]:
    ids = [tok.token_to_id(t) for t in SCRIPT]
    assert None not in ids, f"the tiny tokenizer lacks a scripted token: {SCRIPT}"
    return ids  # type: ignore[return-value]


def save_tiny_qwen3(directory: Path, seed: int = 0) -> Any:
    """The scripted tiny Qwen3 in ``directory`` (weights, tokenizer, Qwen3's template); returns
    the transformers model in float32 eval mode."""
    from transformers import AutoModelForCausalLM

    tok = qwen3_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        hf_config("qwen3", eos_token_id=tok.token_to_id("<|im_end|>"), max_position_embeddings=512),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    randomize(model, seed)
    _script(model, script_ids(tok))
    model.generation_config.eos_token_id = None
    model.save_pretrained(str(directory))
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": QWEN3_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return model.eval()


def _script(model: Any, chain: list[int]) -> None:
    """Write the bigram chain into the weights (see the module's docstring)."""
    embed = model.model.embed_tokens.weight
    head = model.lm_head.weight
    assert len(chain) - 1 <= SCRIPT_DIMS
    with torch.no_grad():
        # layers write only above the scripted dimensions, and other tokens live there too
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[:SCRIPT_DIMS] = 0
            layer.mlp.down_proj.weight[:SCRIPT_DIMS] = 0
        embed[:, :SCRIPT_DIMS] = 0
        head[:, :SCRIPT_DIMS] = 0
        model.model.norm.weight[:SCRIPT_DIMS] = 1
        for dim, (token, successor) in enumerate(itertools.pairwise(chain)):
            embed[token] = 0
            embed[token, dim] = 400.0
            head[successor, SCRIPT_DIMS:] = 0  # no pull from other tokens' contexts
            head[successor, dim] = 4.0
