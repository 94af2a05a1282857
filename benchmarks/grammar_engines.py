"""llguidance (what inferd uses) against xgrammar on the default model's 49k vocabulary.

    .venv/bin/pip install xgrammar==0.2.9   # for this script only: not a dependency of inferd
    PYTHONPATH=. .venv/bin/python benchmarks/grammar_engines.py [ROUNDS] [--json FILE]

For each schema of the proof test (tests/server/test_structured_proof_live.py) and the Lark
grammar a tool call is held to: the compile time (no cache; best of ROUNDS), then the time of
each next-token mask along a valid output (the output tokenized as the model would write it),
median and p99 over every step. Both engines run single-threaded in this process and are given
the same JSON layout (", " and ": ", no free whitespace). Then which of the features inferd
needs each one compiles: regex, Lark, a tool-call grammar with an embedded JSON schema, and a
lazy grammar that starts at a trigger string. Prints a markdown table; ``--json`` writes it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from inferd.loading.gguf import GGUFFile
from inferd.loading.tokenizer import tokenizer_from_gguf
from inferd.store import DEFAULT_MODEL, ModelStore
from inferd.structured.tool_syntax import ToolSpec
from inferd.structured.tool_syntax.base import calls_constraint
from inferd.structured.tool_syntax.hermes import Hermes
from tests.server.test_structured_proof_live import DEPTH1, DEPTH3, DEPTH5, TOOL_SCHEMAS

VOCAB = 49152
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# One valid output per schema (json.dumps writes the layout both engines are held to).
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "json_object": ({"type": "object"}, {"name": "Ann", "tags": ["a", "b"], "n": {"x": 1}}),
    "depth1": (DEPTH1, {"name": "Ann Lee", "age": 31, "member": True, "color": "green"}),
    "depth3": (
        DEPTH3,
        {
            "order": {
                "id": 42,
                "customer": {"name": "Bob", "vip": False},
                "tags": ["red", "blue"],
            },
            "total": 19.5,
        },
    ),
    "depth5": (
        DEPTH5,
        {
            "company": {
                "name": "Acme",
                "office": {
                    "city": "Oslo",
                    "team": {
                        "lead": "Kari",
                        "member": {"name": "Ola", "level": 2},
                        "size": 7,
                    },
                },
                "tags": ["green"],
            }
        },
    ),
}
TOOLS = [ToolSpec(n, n, s) for n, s in TOOL_SCHEMAS.items()]
CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)


def load_tokenizer() -> tuple[str, int]:
    path = ModelStore().entry_path(DEFAULT_MODEL)
    if path is None:
        raise SystemExit(f"pull the default model first: inferd pull {DEFAULT_MODEL}")
    bundle = tokenizer_from_gguf(GGUFFile(path).metadata)
    assert bundle.eos_token_id is not None
    return bundle.tokenizer.to_str(), bundle.eos_token_id


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=[eos])

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema,
            overrides=LAYOUT,  # type: ignore[arg-type]
        )
        return self._matcher(grammar)

    def compile_lark(self, text: str) -> Any:
        return self._matcher(llguidance.LLMatcher.grammar_from_lark(text))

    def compile_regex(self, pattern: str) -> Any:
        return self._matcher(llguidance.LLMatcher.grammar_from_regex(pattern))

    def _matcher(self, grammar: str) -> Any:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        matcher.compute_bitmask()  # inferd's compile step includes the first mask
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def step_times(self, matcher: Any, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.compute_bitmask()
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token), matcher.get_error()
        return times


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        self.info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=VOCAB, stop_token_ids=[eos])
        self.bitmask = xgr.allocate_token_bitmask(1, VOCAB)

    def compiler(self) -> Any:
        # A fresh compiler without its cache each time: compile times, not cache hits.
        return xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile_schema(self, schema: dict[str, Any]) -> Any:
        return xgr.GrammarMatcher(
            self.compiler().compile_json_schema(
                json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
            )
        )

    def compile_lark(self, text: str) -> Any:
        return xgr.GrammarMatcher(self.compiler().compile_lark(text))

    def compile_regex(self, pattern: str) -> Any:
        return xgr.GrammarMatcher(self.compiler().compile_regex(pattern))

    def step_times(self, matcher: Any, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(self.bitmask)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token)
        return times


def best_of(rounds: int, build: Callable[[], Any]) -> tuple[float, Any]:
    best, built = float("inf"), None
    for _ in range(rounds):
        start = time.perf_counter()
        built = build()
        best = min(best, time.perf_counter() - start)
    return best, built


def supports(build: Callable[[], Any]) -> str:
    try:
        build()
    except Exception as exc:  # the engine's refusal is the finding
        return f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})"
    return "yes"


def main(rounds: int = 5, out: Path | None = None) -> None:
    torch.set_num_threads(1)
    tokenizer_json, eos = load_tokenizer()
    encode = Tokenizer.from_str(tokenizer_json)
    rows: list[dict[str, Any]] = []
    lark = calls_constraint(Hermes(), TOOLS, parallel=False, lazy=False).source
    for engine_class in (Llguidance, Xgrammar):
        start = time.perf_counter()
        engine = engine_class(tokenizer_json, eos)
        setup = time.perf_counter() - start
        cases: list[tuple[str, Callable[[], Any], str]] = [
            (name, lambda s=schema, e=engine: e.compile_schema(s), json.dumps(doc))
            for name, (schema, doc) in CASES.items()
        ]
        cases.append(("tool call (Lark)", lambda e=engine: e.compile_lark(lark), CALL))
        for name, build, text in cases:
            try:
                compile_s, matcher = best_of(rounds, build)
            except Exception as exc:
                rows.append({"engine": engine.name, "case": name, "error": str(exc)[:120]})
                continue
            tokens = encode.encode(text, add_special_tokens=False).ids
            steps = engine.step_times(matcher, tokens)
            rows.append(
                {
                    "engine": engine.name,
                    "case": name,
                    "setup_s": setup,
                    "compile_ms": compile_s * 1e3,
                    "tokens": len(tokens),
                    "mask_us_p50": statistics.median(steps) * 1e6,
                    "mask_us_p99": sorted(steps)[min(len(steps) - 1, int(0.99 * len(steps)))] * 1e6,
                }
            )
    features = feature_support(tokenizer_json, eos)
    print_table(rows, features)
    if out is not None:
        out.write_text(json.dumps({"rows": rows, "features": features}, indent=2) + "\n")


def feature_support(tokenizer_json: str, eos: int) -> dict[str, dict[str, str]]:
    """Which constraint forms each engine compiles (inferd needs all four)."""
    ll, xg = Llguidance(tokenizer_json, eos), Xgrammar(tokenizer_json, eos)
    ours = calls_constraint(Hermes(), TOOLS, parallel=True, lazy=False).source
    lazy_lark = 'start: /(.|\\n)*/ call\ncall: "<tool_call>" /[a-z]+/ "</tool_call>"'
    trigger_tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": [
                {
                    "begin": "<tool_call>\n",
                    "content": {"type": "json_schema", "json_schema": TOOL_SCHEMAS["get_weather"]},
                    "end": "\n</tool_call>",
                }
            ],
        },
    }
    return {
        "regex [0-9]{3}-[0-9]{4}": {
            "llguidance": supports(lambda: ll.compile_regex("[0-9]{3}-[0-9]{4}")),
            "xgrammar": supports(lambda: xg.compile_regex("[0-9]{3}-[0-9]{4}")),
        },
        "Lark with inline %json (inferd's tool-call grammar)": {
            "llguidance": supports(lambda: ll.compile_lark(ours)),
            "xgrammar": supports(lambda: xg.compile_lark(ours)),
        },
        "GBNF (llama.cpp's grammar syntax)": {
            "llguidance": supports(
                lambda: ll._matcher(llguidance.grammar_from("grammar", 'root ::= "a" [b-c]'))
            ),
            "xgrammar": supports(
                lambda: xgr.GrammarMatcher(
                    xg.compiler().compile_grammar(xgr.Grammar.from_ebnf('root ::= "a" [b-c]'))
                )
            ),
        },
        "lazy: free text, then a grammar from a trigger": {
            # inferd watches for the trigger itself (structured/matcher.py LazyMatcher); both
            # engines can also express it in the grammar.
            "llguidance": supports(lambda: ll.compile_lark(lazy_lark)),
            "xgrammar": supports(
                lambda: xgr.GrammarMatcher(xg.compiler().compile_structural_tag(trigger_tag))
            ),
        },
    }


def print_table(rows: list[dict[str, Any]], features: dict[str, dict[str, str]]) -> None:
    print("| engine | case | vocab setup s | compile ms | tokens | mask p50 us | mask p99 us |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | {r['case']} | error: {r['error']} | | | | |")
            continue
        print(
            f"| {r['engine']} | {r['case']} | {r['setup_s']:.2f} | {r['compile_ms']:.1f} | "
            f"{r['tokens']} | {r['mask_us_p50']:.0f} | {r['mask_us_p99']:.0f} |"
        )
    print("\n| feature | llguidance | xgrammar |\n|---|---|---|")
    for name, by in features.items():
        print(f"| {name} | {by['llguidance']} | {by['xgrammar']} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    target = None
    if "--json" in args:
        at = args.index("--json")
        target = Path(args[at + 1])
        del args[at : at + 2]
    main(*(int(a) for a in args), out=target)
