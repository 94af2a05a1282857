"""What a request constrains its output to: one frozen, hashable value with a digest.

The source is kept as canonical text (a schema re-serialized without spacing), so equal
constraints share one compiled grammar whatever the spacing of the request. Key order is kept:
properties are generated in the order the schema lists them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inferd.structured.errors import ConstraintError
from inferd.structured.schema_check import check_schema

__all__ = ["Constraint", "ConstraintError", "ConstraintKind"]

MAX_SOURCE_CHARS = 256 * 1024  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# llguidance turns GBNF into Lark in Python, in time quadratic in the rules and holding the GIL
# (measured: 300 rules 0.1 s, 3000 rules 13 s); past this bound a GBNF grammar is refused.
MAX_GBNF_RULES = 256
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z0-9_-]+[ \t]*::=", re.MULTILINE)


class ConstraintKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    CHOICE = "choice"  # exactly one of a list of strings
    GRAMMAR = "grammar"  # Lark, or GBNF (llama.cpp's syntax), told apart by llguidance
    LARK = "lark"  # llguidance's Lark, built by inferd itself (tool calls: %json rules inside)


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    source: str  # canonical text: schema JSON, regex, JSON list of choices, or grammar
    # Non-empty: the output is free until one of these texts appears in it, then the constraint
    # holds from the trigger's first character on (a lazy grammar: tool calls under auto).
    triggers: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        """Key of the compiled grammar: equal constraints compile once."""
        text = f"{self.kind.value}\0{self.source}".encode()
        return hashlib.sha256(text).hexdigest()

    @classmethod
    def lark(cls, text: str, triggers: tuple[str, ...] = ()) -> Constraint:
        """A grammar inferd wrote (not a caller's: those go through ``grammar``)."""
        return cls(ConstraintKind.LARK, text, triggers)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT, "")

    @classmethod
    def json_schema(cls, schema: Any, param: str = "schema") -> Constraint:
        """A JSON schema (a dict or ``true``/``false``); checked before it is accepted."""
        if not isinstance(schema, Mapping | bool):
            raise ConstraintError("a JSON schema must be an object", param)
        check_schema(schema, param)
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        return cls(ConstraintKind.JSON_SCHEMA, _bounded(text, param))

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> Constraint:
        if not isinstance(pattern, str) or not pattern:
            raise ConstraintError("a regex must be a non-empty string", param)
        return cls(ConstraintKind.REGEX, _bounded(pattern, param))

    @classmethod
    def choice(cls, options: Sequence[str], param: str = "choice") -> Constraint:
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise ConstraintError("choice must be a non-empty list of strings", param)
        if len(options) > MAX_CHOICES:
            raise ConstraintError(
                f"choice holds {len(options)} options; at most {MAX_CHOICES}", param
            )
        for option in options:
            if not isinstance(option, str) or not option or len(option) > MAX_CHOICE_CHARS:
                raise ConstraintError(
                    f"each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters", param
                )
        return cls(ConstraintKind.CHOICE, json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def grammar(cls, text: str, param: str = "grammar") -> Constraint:
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("a grammar must be a non-empty string (Lark or GBNF)", param)
        rules = len(_GBNF_RULE.findall(text))
        if rules > MAX_GBNF_RULES:
            raise ConstraintError(
                f"a GBNF grammar of {rules} rules; at most {MAX_GBNF_RULES} are accepted", param
            )
        return cls(ConstraintKind.GRAMMAR, _bounded(text, param))


def _bounded(text: str, param: str) -> str:
    if len(text) > MAX_SOURCE_CHARS:
        raise ConstraintError(
            f"is {len(text)} characters long; at most {MAX_SOURCE_CHARS} are accepted", param
        )
    return text
