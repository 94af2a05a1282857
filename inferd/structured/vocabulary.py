"""The model's vocabulary as llguidance needs it, built once per model on first use (~0.2 s)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import llguidance


@dataclass(slots=True)
class Vocabulary:
    """``tokenizer_json``: the HF ``tokenizers`` JSON of the model's tokenizer (called once).

    ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's: padding
    rows are never allowed); ``eos_token_ids`` are the tokens that end a turn, which the masks
    allow once the constraint is satisfied.
    """

    tokenizer_json: Callable[[], str]
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    _built: llguidance.LLTokenizer | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @classmethod
    def of(
        cls, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int]
    ) -> Vocabulary:
        return cls(tokenizer_json, vocab_size, tuple(sorted(set(eos_token_ids))))

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._built is None:
                self._built = llguidance.LLTokenizer(
                    self.tokenizer_json(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self.eos_token_ids),
                )
            return self._built
