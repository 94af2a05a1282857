"""Tool output is untrusted text: it must never become chat-template control tokens.

The server already keeps special-token text in message content from becoming control tokens
(``loading/chat_template.py``: the spans are tokenized as plain text), unless the operator
turned that off (``--allow-special-tokens-in-content``). Tool output gets the same treatment
whatever that flag says, and earlier, in the text itself: each occurrence of a special token's
text (longest first, the tokenizer's ``special_token_pattern``) and of any other marker the
caller names (a tool-call parser's ``<tool_call>``) is broken by a WORD JOINER after its first
character. The model still reads the characters; the tokenizer no longer matches the token,
and no parser matches the marker.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

BREAK = "\u2060"  # WORD JOINER: invisible, and no tokenizer's special token contains it


def control_pattern(
    special: re.Pattern[str] | None, markers: Iterable[str] = ()
) -> re.Pattern[str] | None:
    """One pattern for the tokenizer's special tokens and extra ``markers`` (longest first)."""
    texts = sorted({m for m in markers if m}, key=len, reverse=True)
    parts = [re.escape(t) for t in texts]
    if special is not None:
        parts.append(f"(?:{special.pattern})")
    return re.compile("|".join(parts)) if parts else None


def neutralize(text: str, pattern: re.Pattern[str] | None) -> str:
    """``text`` with every match of ``pattern`` broken so it reads as plain characters.

    A broken occurrence holds the break character, which no token contains, so one pass
    suffices; a second pass checks that, and anything still matching (a pattern built to
    match across the break) is dropped rather than passed through.
    """
    if pattern is None:
        return text
    text = pattern.sub(_break, text)
    return pattern.sub("", text) if pattern.search(text) else text


def _break(match: re.Match[str]) -> str:
    found = match.group()
    # a one-character token cannot be broken apart: it is dropped
    return found[0] + BREAK + found[1:] if len(found) > 1 else ""
