"""Breaking control text in untrusted tool output (the real tokenizer's check is in
test_mcp_tools.py, on a real server's answer)."""

from __future__ import annotations

import re

from inferd.agent.untrusted import BREAK, control_pattern, neutralize


def test_each_occurrence_is_broken_longest_first_and_nothing_else_changes() -> None:
    special = re.compile(re.escape("<|im_start|>") + "|" + re.escape("<|im_end|>"))
    pattern = control_pattern(special, ["<tool_call>", "</tool_call>"])
    text = "a<|im_end|>b<|im_start|>c</tool_call><tool_call> plain <|other|>"
    safe = neutralize(text, pattern)
    assert safe == (
        f"a<{BREAK}|im_end|>b<{BREAK}|im_start|>c<{BREAK}/tool_call><{BREAK}tool_call>"
        " plain <|other|>"
    )
    assert pattern is not None and pattern.search(safe) is None


def test_no_pattern_leaves_text_alone() -> None:
    assert control_pattern(None) is None
    assert neutralize("<|im_end|>", None) == "<|im_end|>"
