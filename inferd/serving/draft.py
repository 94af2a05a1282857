"""The draft model of ``--speculative draft`` and ``self`` (engine/draft_model.py), built at
startup: a draft model is loaded and checked against the served model's tokenizer (the same
vocabulary, the same special tokens at the same ids, the same logits width), so a mismatch is
a clear error before any request, not wrong drafts. A draft model's weights are RAM the KV
pool cannot have: ``weight_bytes`` says how much, and serving/sizing.py counts it."""

from __future__ import annotations

from inferd import kernels
from inferd.config import EngineConfig
from inferd.engine.draft_model import AssistantDrafter, Drafter, DraftModel, DraftModelError
from inferd.layers.linear import resident_bytes
from inferd.layers.rotary import RotaryEmbedding
from inferd.loading.hf_model import is_gemma4_assistant, load_gemma4_assistant
from inferd.loading.model import LoadedModel, load


def drafter_for(loaded: LoadedModel, cfg: EngineConfig) -> Drafter | None:
    """The draft model the settings ask for (None: no draft model); ``cover`` it once the
    served context is known. A Gemma 4 drafting assistant is its own kind of drafter: it
    reads the served model's cache and hidden states."""
    if cfg.speculative == "self":
        layers = cfg.self_spec_layers or max(1, loaded.config.num_layers // 2)
        return DraftModel(loaded.model, loaded.dtype, layers)
    if cfg.speculative != "draft":
        return None
    assert cfg.draft_model is not None  # EngineConfig checks it
    if is_gemma4_assistant(cfg.draft_model):
        assistant = load_gemma4_assistant(cfg.draft_model, loaded.dtype, progress=False)
        assistant.use_kernels(kernels.load_ops(loaded.dtype))
        return AssistantDrafter(assistant, loaded.model)
    draft = load(
        cfg.draft_model, dtype=cfg.dtype, packed_kernels=cfg.packed_kernels, progress=False
    )
    check_same_tokenizer(loaded, draft)
    draft.model.use_kernels(kernels.load_ops(draft.dtype))  # packed copies count in its bytes
    return DraftModel(draft.model, draft.dtype)


def cover(drafter: Drafter, max_len: int) -> None:
    """Let the draft model's rotary tables reach the served context."""
    for module in drafter.model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cover(max_len)


def weight_bytes(drafter: Drafter | None, served: LoadedModel) -> int:
    """The RAM a draft model's weights take beside the served model's (0 for none, or for
    ``self``, which drafts with the served model's own layers)."""
    if drafter is None or drafter.model is served.model:
        return 0
    return resident_bytes(drafter.model)


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ``DraftModelError`` unless ``draft`` reads and writes the served model's tokens."""
    name = draft.source.name
    if draft.config.vocab_size != target.config.vocab_size:
        raise DraftModelError(
            f"draft model {name} has {draft.config.vocab_size} logits a token, the served "
            f"model {target.config.vocab_size}: a draft model needs the same tokenizer"
        )
    if draft.tokenizer.tokenizer.get_vocab() != target.tokenizer.tokenizer.get_vocab():
        raise DraftModelError(
            f"draft model {name} has another vocabulary: a draft model needs the same tokenizer"
        )
    for what in ("bos_token_id", "eos_token_id", "special_ids"):
        mine, theirs = getattr(draft.tokenizer, what), getattr(target.tokenizer, what)
        if mine != theirs:
            raise DraftModelError(
                f"draft model {name}: {what} {mine} differs from the served model's {theirs}"
            )
