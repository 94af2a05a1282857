"""Chat template rendering: parity with transformers, and hostile templates failing safely."""

from __future__ import annotations

import json
import resource
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import pytest
import transformers

from inferd.loading.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    NoChatTemplateError,
)

SYSTEM = {"role": "system", "content": "You are terse."}
USER = {"role": "user", "content": "Hi! Où est la gare? 你好 👋"}
ASSISTANT = {"role": "assistant", "content": "Bonjour.\nTout droit."}
USER_2 = {"role": "user", "content": "  Thanks\t{{ not a template }} <|im_end|>"}

CONVERSATIONS: dict[str, list[dict[str, str]]] = {
    "user_only": [USER],
    "with_system": [SYSTEM, USER],
    "multi_turn": [USER, ASSISTANT, USER_2],
    "system_multi_turn": [SYSTEM, USER, ASSISTANT, USER_2],
}

# Exercises trim_blocks/lstrip_blocks, namespace, loop controls, tojson, strftime_now, and
# raise_exception on a path the conversations above do not take.
FEATURE_TEMPLATE = """\
{% set ns = namespace(system='', count=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    <{{ message['role'] }} n={{ ns.count }}>{{ message['content'] | trim }}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('bad role ' ~ message['role']) }}
    {% endif %}
    {% if ns.count >= 3 %}{% break %}{% endif %}
{% endfor %}
{{ {'system': ns.system, 'tools': tools, 'ü': 'é'} | tojson(indent=2) }}
{{ messages | map(attribute='role') | join(',') }}|{{ bos_token }}|{{ eos_token }}
{% if add_generation_prompt %}<assistant>{% endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def _gguf_chat_template(path: Path) -> str:
    template = gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()
    assert isinstance(template, str)
    return template


@pytest.fixture(scope="module")
def smollm2_template(smollm2_gguf: Path) -> ChatTemplate:
    return ChatTemplate.from_metadata(
        {"tokenizer.chat_template": _gguf_chat_template(smollm2_gguf)},
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )


@pytest.fixture(scope="module")
def hf(smollm2_gguf: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )


# --- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_matches_transformers(
    smollm2_template: ChatTemplate,
    hf: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = smollm2_template.render(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected


@pytest.mark.parametrize("source", [FEATURE_TEMPLATE, CHATML_TEMPLATE], ids=["features", "chatml"])
def test_other_templates_match_transformers(hf: Any, source: str) -> None:
    messages = CONVERSATIONS["system_multi_turn"] + [ASSISTANT, USER]
    expected = hf.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=True, tools=TOOLS
    )
    ours = ChatTemplate(source, bos_token=hf.bos_token, eos_token=hf.eos_token)
    assert ours.render(messages, tools=TOOLS) == expected


def test_smollm2_default_system_prompt(smollm2_template: ChatTemplate) -> None:
    assert smollm2_template.render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_metadata_without_a_template_refuses_to_render_and_names_the_flag() -> None:
    template = ChatTemplate.from_metadata({}, bos_token=None, eos_token=None)
    assert template.missing and template.source == CHATML_TEMPLATE  # ChatML for convert only
    with pytest.raises(NoChatTemplateError, match="--chat-template FILE"):
        template.render([USER])
    with pytest.raises(NoChatTemplateError):
        template.render_chat([USER], special=None)


def test_chatml_renders_as_transformers_does() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    assert template.render([USER], add_generation_prompt=False) == (
        f"<|im_start|>user\n{USER['content']}<|im_end|>\n"
    )
    # transformers refuses an empty conversation; rendering one is harmless.
    assert template.render([]) == "<|im_start|>assistant\n"


def test_extra_variables_reach_the_template() -> None:
    template = ChatTemplate("{{ bos_token }}{{ tools | length }}{{ custom }}", bos_token="<s>")
    assert template.render([], tools=TOOLS, custom="!") == "<s>1!"
    assert template.render([], tools=[], custom="", bos_token="[B]") == "[B]0"


def test_tojson_is_hf_style() -> None:
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2, sort_keys=true) }}")
    value = {"z": "é<&>", "a": [1, None]}
    first, second = template.render([], x=value).split("|")
    assert first == json.dumps(value, ensure_ascii=False)
    assert second == json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True)


def test_strftime_now() -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert rendered in {before, datetime.now().strftime("%Y-%m-%d")}


def test_generation_tag_renders_its_body() -> None:
    source = (
        "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    )
    assert (
        ChatTemplate(source).render([USER, ASSISTANT])
        == f"[{USER['content']}][{ASSISTANT['content']}]"
    )


def test_end_of_turn_tokens(smollm2_template: ChatTemplate) -> None:
    assert smollm2_template.end_of_turn_tokens() == ("<|im_end|>",)
    llama3 = "{{ '<|start_header_id|>' + m + '<|end_header_id|>' + c + '<|eot_id|>' }}"
    assert ChatTemplate(llama3).end_of_turn_tokens() == ("<|eot_id|>",)
    gemma = "<start_of_turn>user\n{{ c }}<end_of_turn>\n"
    assert ChatTemplate(gemma).end_of_turn_tokens() == ("<end_of_turn>",)
    mistral = "[INST] {{ c }} [/INST]{{ a }}{{ eos_token }}"
    assert ChatTemplate(mistral, eos_token="</s>").end_of_turn_tokens() == ("</s>",)
    assert ChatTemplate("{{ c }}").end_of_turn_tokens() == ()


# --- errors and hostile templates ---------------------------------------------------------------


def test_raise_exception_becomes_chat_template_error() -> None:
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first must be user') }}"
        "{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        ChatTemplate(source).render([ASSISTANT])
    with pytest.raises(ChatTemplateError, match="bad role tool"):
        ChatTemplate(FEATURE_TEMPLATE).render([{"role": "tool", "content": "x"}], tools=[])


def test_syntax_error_is_reported_at_load() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 2") as info:
        ChatTemplate("ok\n{% if %}")
    assert isinstance(info.value, ValueError)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")


def test_render_errors_become_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 // 0 }}").render([])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate(CHATML_TEMPLATE).render([{"role": "user", "content": ["not", "text"]}])
    with pytest.raises(ChatTemplateError, match="no loader"):
        ChatTemplate("{% include 'other.jinja' %}").render([])


# Each must stop with ChatTemplateError, fast, without executing anything or eating memory.
HOSTILE: dict[str, tuple[str, str]] = {
    "mro_subclasses": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    "class_alone": ("{{ ''.__class__ }}", "unsafe"),
    "cycler_globals_popen": (
        "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
        "unsafe",
    ),
    "function_globals": ("{{ strftime_now.__globals__['sys'] }}", "unsafe"),
    "getitem_globals": ("{{ raise_exception['__globals__'] }}", "unsafe"),
    "format_globals": ("{{ '{0.__globals__}'.format(raise_exception) }}", "unsafe"),
    "messages_append": ("{{ messages.append(1) }}", "unsafe"),
    "message_update": ("{{ messages[0].update({'role': 'system'}) }}", "unsafe"),
    "namespace_private": (
        "{% set ns = namespace() %}{% set ns._Namespace__attrs = 1 %}",
        "underscore",
    ),
    "huge_range": ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    "str_times": ("{{ 'x' * 10**9 }}", "size limit"),
    "list_times": ("{{ ([0] * 10**5) * 10**5 }}", "size limit"),
    "int_power": ("{{ 10 ** 100000000 }}", "integer power"),
    "ljust": ("{{ 'x'.ljust(10**9) }}", "size limit"),
    "printf_width": ("{{ '%1000000000s' % 'x' }}", "size limit"),
    "format_width": ("{{ '{:>1000000000}'.format('x') }}", "size limit"),
    "center_filter": ("{{ 'x' | center(10**9) }}", "size limit"),
    "indent_filter": ("{{ ('a\n' * 100000) | indent(100000) }}", "size limit"),
    "join_separator": ("{{ range(100000) | join('x' * 100000) }}", "size limit"),
    "replace_blowup": ("{{ ('x' * 1000000) | replace('x', 'yyyyyyyyyyyyyyyy') }}", "size limit"),
    "concat_doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s | length }}",
        "size limit",
    ),
    "shared_list_doubling": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}"
        "{% endfor %}{{ ns.l }}",
        "size limit",
    ),
    "block_accumulation": (
        "{% set b %}{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}{% endset %}",
        "characters of output",
    ),
    "output_flood": ("{% for i in range(100000) %}{{ 'y' * 10000 }}{% endfor %}", "output exceeds"),
    "nested_loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "took longer",
    ),
    "recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
}


@pytest.mark.parametrize(("source", "message"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_fails_safely(
    source: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    messages = [dict(USER)]
    trace_before = sys.gettrace()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source, timeout_s=0.5).render(messages)
    assert time.monotonic() - start < 5
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 400
    assert not (tmp_path / "MARKER").exists()
    assert messages == [USER]
    assert sys.gettrace() is trace_before


def test_limits_are_per_template() -> None:
    source = "{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "x" * 600}] * 2
    assert len(ChatTemplate(source).render(messages)) == 1200
    with pytest.raises(ChatTemplateError, match="output exceeds 1000"):
        ChatTemplate(source, max_output_chars=1000).render(messages)
