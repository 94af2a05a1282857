"""Tool-call syntaxes, one module per family, and the choice of one for a model.

A model's chat template decides both how tools reach the prompt and how the model writes a
call: a template that takes a ``tools`` variable renders them (and the history's tool turns)
itself, and its source shows the family (``[TOOL_CALLS]``: Mistral; ``<tool_call>``: Hermes;
``<|python_tag|>`` or ``"parameters"``: Llama 3 JSON; ``name(param=`` examples: pythonic). A
template that takes no tools gets inferd's documented generic block (Hermes unless a parser is
forced). ``--tool-call-parser`` (``tool_call_parser`` in a models file) forces the family.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferd.structured.tool_syntax.base import (
    CallPiece,
    CallReader,
    ParsedCall,
    ToolSpec,
    ToolSyntax,
    calls_constraint,
)
from inferd.structured.tool_syntax.hermes import Hermes
from inferd.structured.tool_syntax.llama3_json import Llama3Json
from inferd.structured.tool_syntax.mistral import Mistral
from inferd.structured.tool_syntax.pythonic import Pythonic

__all__ = [
    "PARSERS",
    "CallPiece",
    "CallReader",
    "ParsedCall",
    "ToolFormat",
    "ToolSpec",
    "ToolSyntax",
    "calls_constraint",
    "choose",
    "syntax_named",
]

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")

_TAKES_TOOLS = re.compile(r"\btools\b")
_PYTHONIC = re.compile(r"\[\s*\w+\(\s*\w+\s*=")  # an example call: [func_name(param=...


def syntax_named(name: str, template: str = "") -> ToolSyntax:
    """The syntax ``name`` (one of PARSERS); ``template`` picks Mistral's form."""
    if name == "hermes":
        return Hermes()
    if name == "llama3_json":
        return Llama3Json()
    if name == "mistral":
        return Mistral(named_form="[ARGS]" in template)
    if name == "pythonic":
        return Pythonic()
    raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(PARSERS)}")


def detect(template: str) -> str:
    """The family a template's source shows; hermes when it shows none."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    if _PYTHONIC.search(template):
        return "pythonic"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How one model is offered tools and writes calls."""

    syntax: ToolSyntax = field(default_factory=Hermes)
    in_template: bool = False  # the chat template renders tools and tool turns itself

    def reader(self, tools: Sequence[ToolSpec], most: int | None = None) -> CallReader:
        """A reader of calls to ``tools``, ``most`` of them at most (None: any number)."""
        return CallReader(self.syntax, self.syntax.triggers(tools), most=most)


def choose(template: str, forced: str | None = None) -> ToolFormat:
    """The format for a model whose chat template is ``template`` ("" for none);
    ``forced``: a parser named by the operator, which wins over what the template shows."""
    in_template = bool(_TAKES_TOOLS.search(template))
    if forced is not None:
        return ToolFormat(syntax_named(forced, template), in_template)
    if not in_template:
        return ToolFormat(Hermes(), False)
    return ToolFormat(syntax_named(detect(template), template), True)
