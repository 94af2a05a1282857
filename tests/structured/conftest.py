from __future__ import annotations

from pathlib import Path

import pytest

from inferd.loading.gguf import GGUFFile
from inferd.loading.tokenizer import TokenizerBundle, tokenizer_from_gguf
from inferd.structured.vocabulary import Vocabulary


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: Path) -> TokenizerBundle:
    return tokenizer_from_gguf(GGUFFile(smollm2_gguf).metadata)


@pytest.fixture(scope="session")
def smollm2_vocabulary(smollm2_tokenizer: TokenizerBundle) -> Vocabulary:
    """The default model's vocabulary, with its end-of-text token as the only EOS."""
    eos = smollm2_tokenizer.eos_token_id
    assert eos is not None
    return Vocabulary.of(smollm2_tokenizer.tokenizer.to_str, 49152, [eos])
