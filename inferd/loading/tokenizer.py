"""Build a HF ``tokenizers.Tokenizer`` from the tokenizer metadata stored in a GGUF file.

A GGUF carries no ``tokenizer.json``; llama.cpp's converter stores the vocabulary, the
merges (or scores) and token types under ``tokenizer.ggml.*`` keys instead. This module
rebuilds an equivalent fast tokenizer from those keys, following llama.cpp's reading of
them (which is what the GGUF's author tested against):

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE. ``tokenizer.ggml.pre`` names the
  pre-tokenizer split that the merges were learned with; we map the common names to the
  split the original ``tokenizer.json`` used.
* ``tokenizer.ggml.model == "llama"``: SentencePiece BPE with byte fallback; merges are
  derived from the token scores, as SentencePiece merges the highest-scoring pair first.
* ``tokenizer.ggml.model == "gemma4"``: Gemma 4's BPE over text whose spaces are ``▁``, with
  byte fallback and the file's merges, no space prefix; llama.cpp splits the text into runs of
  newlines and runs of anything else first (no merge crosses them), and always adds BOS.

Token types (llama.cpp ``llama_token_type``): 1 normal, 2 unknown, 3 control,
4 user-defined, 5 unused, 6 byte.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.processors import TemplateProcessing

__all__ = ["TokenizerBundle", "TokenizerError", "tokenizer_from_gguf"]

TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenizerError(ValueError):
    """The GGUF metadata does not describe a tokenizer we can build."""


# --- pre-tokenizer splits, keyed by ``tokenizer.ggml.pre`` -----------------------------------
#
# Each family is the split of the original tokenizer.json, as llama.cpp groups them in
# llama-vocab.cpp. Splitting differently from training silently changes token ids for some
# inputs (e.g. whitespace runs before digits), so an unknown name is an error, not a guess.

_GPT2_NAMES = frozenset({"default", "gpt2", "gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo"})
# GPT-2 regex, but every digit is its own piece first (StarCoder-style vocabularies).
_DIGITS_NAMES = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}
)
_LLAMA3_NAMES = frozenset(
    {
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "dbrx",
        "smaug-bpe",
    }
)
_QWEN2_NAMES = frozenset({"qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"})

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's split with single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """The pre-tokenizer for ``tokenizer.ggml.pre`` and whether BPE should ignore merges.

    ``ignore_merges`` (look a whole piece up in the vocabulary before merging) is what the
    Llama 3 tokenizer.json sets and what llama.cpp does for that family.
    """
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre is None or pre in _GPT2_NAMES:
        return gpt2, False
    if pre in _DIGITS_NAMES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2]), False
    for names, split, ignore_merges in (
        (_LLAMA3_NAMES, _LLAMA3_SPLIT, True),
        (_QWEN2_NAMES, _QWEN2_SPLIT, False),
    ):
        if pre in names:
            return _regex_then_bytes(split), ignore_merges
    known = sorted(_GPT2_NAMES | _DIGITS_NAMES | _LLAMA3_NAMES | _QWEN2_NAMES)
    raise TokenizerError(
        f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 tokenizer; known: {known}"
    )


def _regex_then_bytes(split: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# --- byte-level spelling ------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map, inverted (character -> byte).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100+
    so that every byte has a visible, non-whitespace spelling.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


_CHAR_TO_BYTE = _byte_level_alphabet()


def _byte_level_token_bytes(token: str) -> bytes:
    """Raw bytes of a byte-level token, the way the ByteLevel decoder reads it.

    A token spelled outside the byte alphabet (a user-defined token stored as plain text)
    stands for its own UTF-8, which is also what the ByteLevel decoder falls back to.
    """
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _spm_token_bytes(token: str, token_type: int) -> bytes:
    if token_type == TOKEN_BYTE and (m := _BYTE_TOKEN.match(token)):
        return bytes([int(m.group(1), 16)])
    return token.replace(_SPM_SPACE, " ").encode("utf-8")


# --- the bundle ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TokenizerBundle:
    """A fast tokenizer plus what the engine needs around it.

    ``id_to_bytes`` returns a token's raw bytes, special tokens included (as their text);
    an incremental detokenizer that hides special tokens should test ``special_ids`` first.
    With ``add_space_prefix`` (SentencePiece), the first token of a whole text carries a
    leading space that ``decode`` strips; the byte table keeps it.
    """

    tokenizer: Tokenizer = field(repr=False)
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    special_ids: frozenset[int]
    token_bytes: tuple[bytes, ...] = field(repr=False)
    model_type: str = "gpt2"
    add_space_prefix: bool = False

    def encode(
        self,
        text: str,
        *,
        add_special: bool = False,
        literal_spans: Sequence[tuple[int, int]] = (),
    ) -> list[int]:
        """Token ids for ``text``; special-token text like ``<|im_start|>`` becomes that token,
        except inside ``literal_spans`` ([start, end) character ranges), where it is plain text.

        ``add_special`` prepends BOS when the model asks for it (``add_bos``) and the text does
        not already begin with it.
        """
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = encoding.ids
        if literal_spans:
            ids = self._literal(text, ids, encoding.offsets, literal_spans)
        bos = self.bos_token_id
        # A chat template that writes the BOS text itself (Gemma's do) must not get a second.
        if add_special and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def _literal(
        self,
        text: str,
        ids: list[int],
        offsets: Sequence[tuple[int, int]],
        spans: Sequence[tuple[int, int]],
    ) -> list[int]:
        """``ids`` with every special token matched inside ``spans`` undone.

        The tokenizer splits text at special tokens and encodes each piece between them on its
        own, so the pieces around the special tokens that stay are re-encoded, with special-token
        matching off, only where one was undone; everything else keeps its ids exactly.
        """
        special = self.special_token_ids
        out: list[int] = []
        piece: list[int] = []  # ids since the last special token kept
        start = 0  # where that piece starts in text
        forged = False
        for token, (a, b) in zip(ids, offsets, strict=True):
            if token not in special:
                piece.append(token)
            elif any(lo < b and a < hi for lo, hi in spans):
                forged = True
            else:
                out.extend(self._plain_piece(text[start:a]) if forged else piece)
                out.append(token)
                piece, start, forged = [], b, False
        out.extend(self._plain_piece(text[start:]) if forged else piece)
        return out

    def _plain_piece(self, text: str) -> list[int]:
        ids: list[int] = self._plain_tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    @functools.cached_property
    def _plain_tokenizer(self) -> Tokenizer:
        """A copy that reads special-token text as plain text (built on first use: ~1 s)."""
        plain = Tokenizer.from_str(self.tokenizer.to_str())
        plain.encode_special_tokens = True
        return plain

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        """Ids the tokenizer matches as special text (``<|im_start|>``), never merges into."""
        added = self.tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, t in added.items() if t.special)

    @functools.cached_property
    def special_token_pattern(self) -> re.Pattern[str] | None:
        """Matches the text of every special token (longest first), or None when there is none."""
        added = self.tokenizer.get_added_tokens_decoder().values()
        texts = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for, or None when no such bound holds.

        A token stands for at most its own bytes, and a character is at least one byte, so a
        text of c characters needs at least c / (longest token in bytes) tokens, provided the
        tokenizer drops no characters and cannot swallow a whole unknown word into one token:
        byte-level or byte-fallback BPE whose normalizer and pre-tokenizer only add or swap
        characters (the ones GGUF tokenizers and common tokenizer.json files use).
        """
        if self.model_type not in ("gpt2", "llama") or not _keeps_every_character(self.tokenizer):
            return None
        return max(1, max(map(len, self.token_bytes), default=1))

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def id_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token, O(1); may be an incomplete UTF-8 sequence."""
        if not 0 <= token_id < len(self.token_bytes):
            raise IndexError(f"token id {token_id} out of range [0, {len(self.token_bytes)})")
        return self.token_bytes[token_id]

    @property
    def vocab_size(self) -> int:
        """Number of token ids in the GGUF vocabulary (the model's embedding rows)."""
        return len(self.token_bytes)


# Normalizer and pre-tokenizer steps that never remove characters from the text.
_KEEPING_NORMALIZERS = frozenset({"Sequence", "Prepend", "Replace"})
_KEEPING_PRE_TOKENIZERS = frozenset({"Sequence", "ByteLevel", "Split", "Digits", "Metaspace"})


def _keeps_every_character(tok: Tokenizer) -> bool:
    model = tok.model
    if not isinstance(model, BPE) or (model.unk_token is not None and not model.byte_fallback):
        return False
    steps = [
        (tok.normalizer, "normalizers", _KEEPING_NORMALIZERS),
        (tok.pre_tokenizer, "pretokenizers", _KEEPING_PRE_TOKENIZERS),
    ]
    for component, key, keeping in steps:
        if component is None:
            continue
        spec = json.loads(component.__getstate__())
        parts = [spec, *spec.get(key, [])]
        for part in parts:
            if part.get("type") not in keeping or part.get("behavior") == "Removed":
                return False
            if part.get("type") == "Replace" and not part.get("content"):
                return False
    return True


# --- metadata parsing ---------------------------------------------------------------------------


def _key(name: str) -> str:
    return f"tokenizer.ggml.{name}"


def _str_list(metadata: Mapping[str, Any], name: str) -> list[str] | None:
    value = metadata.get(_key(name))
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise TokenizerError(f"{_key(name)} must be a list of strings")
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in value]


def _num_list(metadata: Mapping[str, Any], name: str, n: int, kind: type) -> list[Any] | None:
    value = metadata.get(_key(name))
    if value is None:
        return None
    out = [kind(v) for v in value]
    if len(out) != n:
        raise TokenizerError(f"{_key(name)} has {len(out)} entries, expected {n} (one per token)")
    return out


def _token_id(metadata: Mapping[str, Any], name: str, n: int) -> int | None:
    value = metadata.get(_key(name))
    if value is None:
        return None
    token_id = int(value)
    # Some converters write -1 (as an unsigned wrap-around) for "no such token".
    if token_id < 0 or token_id >= 2**31:
        return None
    if token_id >= n:
        raise TokenizerError(f"{_key(name)} = {token_id} is outside the vocabulary of {n}")
    return token_id


def _flag(metadata: Mapping[str, Any], name: str, default: bool) -> bool:
    value = metadata.get(_key(name))
    return default if value is None else bool(value)


@dataclass(frozen=True)
class _Vocab:
    """The parts of the metadata both tokenizer kinds share."""

    model: str
    tokens: list[str]
    types: list[int]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None

    def ids_to_map(self) -> dict[str, int]:
        # Keep the first id of a duplicated spelling; later duplicates stay decodable through
        # the byte table but cannot be produced by encoding.
        vocab: dict[str, int] = {}
        for i, token in enumerate(self.tokens):
            vocab.setdefault(token, i)
        return vocab

    def special_ids(self) -> frozenset[int]:
        """Control tokens, plus BOS/EOS even if a converter typed them normal."""
        ids = {i for i, t in enumerate(self.types) if t == TOKEN_CONTROL}
        ids.update(i for i in (self.bos_id, self.eos_id) if i is not None)
        return frozenset(ids)

    def user_defined_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.types) if t == TOKEN_USER_DEFINED]


def _read_vocab(metadata: Mapping[str, Any]) -> _Vocab:
    model = metadata.get(_key("model"))
    if not isinstance(model, str):
        raise TokenizerError(f"{_key('model')} is missing; this GGUF has no tokenizer")
    tokens = _str_list(metadata, "tokens")
    if not tokens:
        raise TokenizerError(f"{_key('tokens')} is missing or empty")
    n = len(tokens)
    types = _num_list(metadata, "token_type", n, int) or [TOKEN_NORMAL] * n
    return _Vocab(
        model=model,
        tokens=tokens,
        types=types,
        bos_id=_token_id(metadata, "bos_token_id", n),
        eos_id=_token_id(metadata, "eos_token_id", n),
        unk_id=_token_id(metadata, "unknown_token_id", n),
    )


# --- building -----------------------------------------------------------------------------------


def _add_special_tokens(tok: Tokenizer, vocab: _Vocab, special: frozenset[int]) -> None:
    """Register control and user-defined tokens so their text is matched whole, never split.

    Control tokens are flagged special (hidden by ``decode(skip_special=True)``); user-defined
    ones (e.g. ``<think>``) are matched whole too but, as in llama.cpp, are ordinary text when
    decoding. Their spellings are already in the model vocabulary, so they keep their GGUF ids.
    """
    tok.add_special_tokens(
        [AddedToken(vocab.tokens[i], special=True, normalized=False) for i in sorted(special)]
    )
    user = [i for i in vocab.user_defined_ids() if i not in special]
    if user:
        tok.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False) for i in user])


def _file_merges(metadata: Mapping[str, Any], model: str) -> list[tuple[str, str]]:
    """The merges the file lists, which a ``model`` tokenizer needs."""
    merges = _str_list(metadata, "merges")
    if merges is None:
        raise TokenizerError(f"a {model} tokenizer needs {_key('merges')}")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        parts = merge.split(" ")
        if len(parts) != 2:
            raise TokenizerError(f"malformed merge {merge!r} in {_key('merges')}")
        pairs.append((parts[0], parts[1]))
    return pairs


def _build_byte_level(metadata: Mapping[str, Any], vocab: _Vocab) -> Tokenizer:
    merges = _file_merges(metadata, "gpt2")
    pre = metadata.get(_key("pre"))
    pre_tokenizer, ignore_merges = _byte_level_pre_tokenizer(None if pre is None else str(pre))
    tok = Tokenizer(
        BPE(
            vocab=vocab.ids_to_map(),
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=ignore_merges,
        )
    )
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(vocab: _Vocab, scores: list[float]) -> list[tuple[str, str]]:
    """Merges that make BPE reproduce SentencePiece's "merge the best-scoring pair" rule.

    Every normal token that splits into two known tokens yields a merge ranked by the
    token's score, best first; ties go to the longer left part, then to file order.
    """
    index = vocab.ids_to_map()
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, (piece, kind) in enumerate(zip(vocab.tokens, vocab.types, strict=True)):
        if kind != TOKEN_NORMAL or index.get(piece) != token_id:
            continue
        local = [
            (piece[:k], piece[k:])
            for k in range(1, len(piece))
            if piece[:k] in index and piece[k:] in index
        ]
        local.sort(key=lambda lr: (index[lr[0]], index[lr[1]]))
        ranked.extend(
            (-scores[token_id], -len(left), -len(right), left, right) for left, right in local
        )
    ranked.sort(key=lambda r: (r[0], r[1], r[2]))  # stable: file order breaks remaining ties
    return [(left, right) for *_, left, right in ranked]


def _byte_fallback_bpe(vocab: _Vocab, merges: list[tuple[str, str]]) -> Tokenizer:
    """SentencePiece's kind of BPE: a piece missing from the vocabulary falls back to its
    ``<0xNN>`` byte tokens (consecutive unknown tokens fuse into one)."""
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    return Tokenizer(
        BPE(
            vocab=vocab.ids_to_map(),
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )


def _spm_decoders() -> list[decoders.Decoder]:
    """``▁`` back to spaces, byte tokens back to bytes, joined."""
    return [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]


def _build_spm(metadata: Mapping[str, Any], vocab: _Vocab, add_space_prefix: bool) -> Tokenizer:
    scores = _num_list(metadata, "scores", len(vocab.tokens), float)
    if scores is None:
        raise TokenizerError(f"a llama (SentencePiece) tokenizer needs {_key('scores')}")
    tok = _byte_fallback_bpe(vocab, _spm_merges(vocab, scores))
    # llama.cpp prefixes a space to every run of plain text (the start, and after each special
    # token) and keeps spaces the text already has; a normalizer runs once per such run.
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPM_SPACE)]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    chain = _spm_decoders()
    if add_space_prefix:
        chain.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(chain)
    return tok


def _build_gemma4(metadata: Mapping[str, Any], vocab: _Vocab) -> Tokenizer:
    tok = _byte_fallback_bpe(vocab, _file_merges(metadata, "gemma4"))
    tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence(_spm_decoders())
    return tok


def _set_bos_template(tok: Tokenizer, bos: str, bos_id: int) -> None:
    """Make ``Tokenizer.encode(..., add_special_tokens=True)`` agree with ``bundle.encode``."""
    tok.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )


def tokenizer_from_gguf(metadata: Mapping[str, Any]) -> TokenizerBundle:
    """Build the tokenizer described by decoded GGUF metadata (``tokenizer.ggml.*`` keys).

    Raises TokenizerError for a tokenizer model other than ``gpt2`` or ``llama``, or for
    metadata that is missing or inconsistent.
    """
    vocab = _read_vocab(metadata)
    add_space_prefix = False
    if vocab.model == "gpt2":
        tok = _build_byte_level(metadata, vocab)
        token_bytes = tuple(_byte_level_token_bytes(t) for t in vocab.tokens)
        # llama.cpp's default when the key is absent: only the Llama 3 family adds BOS.
        add_bos_default = metadata.get(_key("pre")) in _LLAMA3_NAMES
    elif vocab.model in ("llama", "gemma4"):
        if vocab.model == "llama":
            add_space_prefix = _flag(metadata, "add_space_prefix", True)
            tok = _build_spm(metadata, vocab, add_space_prefix)
        else:
            tok = _build_gemma4(metadata, vocab)
        token_bytes = tuple(
            _spm_token_bytes(t, k) for t, k in zip(vocab.tokens, vocab.types, strict=True)
        )
        add_bos_default = True
    else:
        raise TokenizerError(
            f"unsupported tokenizer model {vocab.model!r} (tokenizer.ggml.model); "
            "supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece), 'gemma4'"
        )

    special = vocab.special_ids()
    _add_special_tokens(tok, vocab, special)
    # llama.cpp adds Gemma 4's BOS whatever the file says (llama-vocab.cpp, "workaround").
    add_bos = vocab.model == "gemma4" or _flag(metadata, "add_bos_token", add_bos_default)
    bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else None
    eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else None
    if add_bos and bos is not None and vocab.bos_id is not None:
        _set_bos_template(tok, bos, vocab.bos_id)
    return TokenizerBundle(
        tokenizer=tok,
        bos_token=bos,
        eos_token=eos,
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
        add_bos=add_bos,
        special_ids=special,
        token_bytes=token_bytes,
        # the byte table's kind: Gemma 4's pieces are SentencePiece's
        model_type="llama" if vocab.model == "gemma4" else vocab.model,
        add_space_prefix=add_space_prefix,
    )
