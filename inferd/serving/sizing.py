"""How long a context a model is served with and how many tokens its KV pool holds: arithmetic
on the model's shape and the memory left once its weights are in, decided before the engine is
built and said in one startup line.

The rules, in order:

1. ``--max-seq-len`` beyond the positions the model was trained on is refused (the rotary table
   past them is extrapolation the model never saw), unless its rope scaling stretches them:
   linear and llama3 scaling allow ``factor`` times the original positions.
2. The context is ``--max-seq-len``, else the model's positions, at most
   ``DEFAULT_MAX_MODEL_LEN``.
3. The pool is ``--kv-cache-tokens`` / ``--kv-cache-mb`` when given. Otherwise it is one full
   context, or ``DEFAULT_KV_CACHE_MB`` if that is more, within ``KV_RAM_FRACTION`` of the RAM
   free after the weights (the rest stays for activations, the OS and other processes). A
   draft model's weights (``--draft-model``) count as weights: they leave that much less free.
4. A pool that cannot hold one full context lowers the served context to what it holds, and the
   startup line says so; but a ``--max-seq-len`` the pool cannot hold is refused, since the
   caller asked for that length explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferd.config import DEFAULT_KV_CACHE_MB, DEFAULT_MAX_MODEL_LEN, KV_RAM_FRACTION
from inferd.engine.kv_cache import tokens_held
from inferd.kernels.kv_quant import SCALE_BYTES
from inferd.models.config import ModelConfig

MIB = 2**20
GIB = 2**30
# Below this many tokens a default pool is refused: no chat fits, and the machine is out of RAM.
MIN_DEFAULT_CONTEXT = 256


class SizingError(ValueError):
    """Settings that cannot be served; the message says which limit and how to change it."""


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the sizing needs of a model: its KV bytes per token and its positions."""

    bytes_per_token: int  # K and V over all layers, as the cache stores them
    trained_positions: int  # max_position_embeddings / context_length
    position_limit: int  # what the rope scaling allows; trained_positions without one
    scaling: str = ""  # e.g. "llama3 x8", for messages; "" without scaling
    cache_dtype: str = ""  # bf16, f32, int8...: named in the startup line ("": not named)


@dataclass(frozen=True, slots=True)
class Sizing:
    """The decision: the pool, the served context and why."""

    pool_tokens: int  # a whole number of blocks
    max_seq_len: int  # the context served: no request may need more tokens
    pool_bytes: int
    reason: str  # one line for startup: the pool, and why the context is what it is
    lowered_from: int | None = None  # the context before the pool lowered it, when it did


def kv_shape(config: ModelConfig, dtype_bytes: int, *, cache_dtype: str = "") -> KVShape:
    """The sizing's view of a model caching K/V in ``dtype_bytes`` per value, or, with
    ``cache_dtype`` "int8", in int8 codes and a float16 scale per token and KV head
    (kernels/kv_quant.py). ``cache_dtype`` names the storage in the startup line."""
    int8 = cache_dtype == "int8"
    per_token = 0
    for layer in range(config.num_layers):  # each layer's shape (Gemma 4's global ones)
        if config.kv_source(layer) != layer:
            continue  # a K/V-sharing layer (Gemma 4) keeps nothing of its own
        heads, head_dim = config.kv_shape(layer)
        row = head_dim + SCALE_BYTES if int8 else head_dim * dtype_bytes
        per_token += 2 * heads * row
    cache = cache_dtype
    trained = config.max_position
    scaling = config.rope_scaling
    if scaling.kind == "linear" and scaling.factor > 1:
        # transformers' convention: max_position_embeddings stays the original length
        limit = int(trained * scaling.factor)
    elif scaling.kind == "llama3" and scaling.factor > 1:
        limit = max(trained, int(scaling.original_max_position * scaling.factor))
    else:
        return KVShape(per_token, trained, trained, cache_dtype=cache)
    return KVShape(per_token, trained, limit, f"{scaling.kind} x{scaling.factor:g}", cache)


def decide(
    shape: KVShape,
    *,
    available_bytes: int,
    max_seq_len: int | None = None,
    kv_cache_tokens: int | None = None,
    kv_cache_mb: int | None = None,
    block_size: int = 16,
    window: int | None = None,
    chunk: int = 512,
    draft_bytes: int = 0,
    memory_fraction: float | None = None,
) -> Sizing:
    """The pool and the served context for a model of ``shape`` with ``available_bytes`` of RAM
    free after its weights, of which a draft model's weights will take ``draft_bytes``; the
    flags as ``EngineConfig`` holds them (None: not given).
    ``window``: when every layer slides, a sequence holds at most the window behind a step's
    first token plus the step's ``chunk`` (engine/kv_cache.py frees the rest), so a full context
    needs only that much of the pool. ``memory_fraction``: the share of the free RAM the pool
    may take (--kv-memory-fraction; None: ``KV_RAM_FRACTION``)."""
    _check_positions(shape, max_seq_len)
    context = max_seq_len or min(shape.trained_positions, DEFAULT_MAX_MODEL_LEN)
    need = tokens_held(context, chunk, block_size, window)  # one full context, at once
    per_token = shape.bytes_per_token
    if kv_cache_tokens is not None:
        tokens, why = _blocks(kv_cache_tokens, block_size), "set by --kv-cache-tokens"
    elif kv_cache_mb is not None:
        tokens, why = _blocks(kv_cache_mb * MIB // per_token, block_size), "set by --kv-cache-mb"
    else:
        share = KV_RAM_FRACTION if memory_fraction is None else memory_fraction
        free_bytes = max(0, available_bytes - draft_bytes)
        budget = int(free_bytes * share)
        # Given a share, the pool takes it all; the default stops at what the context needs.
        target = (
            budget
            if memory_fraction is not None
            else max(need * per_token, DEFAULT_KV_CACHE_MB * MIB)
        )
        fitting = min(target, budget) // per_token
        tokens = _blocks(fitting, block_size)
        free = f"{_size(free_bytes)} of RAM free after the weights"
        if draft_bytes:
            free += f" (the draft model's {_size(draft_bytes)} included)"
        if tokens >= need:
            contexts = tokens // need
            fits = "one full context" if contexts == 1 else f"{contexts} full contexts"
            why = f"{fits}, within {share:.0%} of the {free}"
            if memory_fraction is not None:
                why = f"{fits} in {share:.0%} of the {free} (--kv-memory-fraction)"
        else:
            why = f"all that {share:.0%} of the {free} holds"
            if max_seq_len is None and fitting < MIN_DEFAULT_CONTEXT:
                raise SizingError(
                    f"only {free}: {share:.0%} of it holds {fitting} tokens of KV cache "
                    f"({_size(per_token)} each), fewer than {MIN_DEFAULT_CONTEXT}; free memory, "
                    "or set --kv-cache-mb"
                )
    of = f" of {shape.cache_dtype}" if shape.cache_dtype else ""
    pool = f"KV cache {tokens} tokens{of}, {_size(tokens * per_token)} ({why})"
    if tokens >= need:
        return Sizing(tokens, context, tokens * per_token, f"context {context}; {pool}")
    if max_seq_len is not None:
        raise SizingError(
            f"--max-seq-len {max_seq_len} needs {_round_up(max_seq_len, block_size)} tokens of "
            f"KV cache ({_size(_round_up(max_seq_len, block_size) * per_token)}), but the pool "
            f"holds {tokens} ({why}); lower --max-seq-len, or give a larger --kv-cache-mb"
        )
    reason = f"context {tokens}, lowered from {context}: the pool holds no more; {pool}"
    return Sizing(tokens, tokens, tokens * per_token, reason, lowered_from=context)


def _check_positions(shape: KVShape, max_seq_len: int | None) -> None:
    if max_seq_len is None or max_seq_len <= shape.position_limit:
        return
    trained = f"the model was trained on {shape.trained_positions} positions"
    if shape.scaling:
        trained += f", stretched to {shape.position_limit} by its rope scaling ({shape.scaling})"
    raise SizingError(
        f"--max-seq-len {max_seq_len} is beyond this model's positions: {trained}; "
        f"give at most {shape.position_limit}"
    )


def _blocks(tokens: int, block_size: int) -> int:
    """Whole blocks, at least one."""
    return max(block_size, tokens // block_size * block_size)


def _round_up(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


def _size(num_bytes: int) -> str:
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    if num_bytes >= MIB:
        return f"{num_bytes / MIB:.0f} MiB"
    return f"{num_bytes / 1024:.0f} KiB"
