"""Draft-model speculation: a smaller model (or the first layers of the served one) proposes.

``--speculative draft``: a second model with the same tokenizer drafts each speculating
request's next ``k`` tokens; ``--speculative self``: the served model's own first ``N`` layers,
then its final norm and head (no extra weights), draft them. ``Speculator`` (speculative.py)
then verifies the drafts on the served model exactly as it verifies prompt-lookup ones.

A draft model keeps each request's KV in a small cache of its own (``DraftCache``: the engine's
paged layout, one block table covering the whole cache, grown by doubling). Before drafting, the
cache is cut back to the longest prefix its tokens share with the request's tokens (rejected
drafts and a step's unverified last draft are dropped that way) and catches up on the rest in
one chunk; then ``k`` one-token steps draft. Its KV is left for the next step.

Self-drafting keeps none (``share``): its layers are the served model's first ones over the same
tokens, so their keys and values at every computed position are in the served model's paged
cache already. A draft runs from the request's last token on, writing its positions in the
request's own blocks (allocated for the step's verify rows anyway); the verify step then
writes those positions again through every layer. So a request that drafts again after a pause
has nothing to catch up on, and its first draft no prefill of the prompt.

Drafts: the argmax of the draft model's logits for a greedy request (so a point mass, and the
served model's greedy text is unchanged whatever is drafted); for a sampled request a draw
from the draft model's distribution ``q`` (the request's temperature and top-k/p/min-p on the
draft logits), which verification needs beside the draft: it accepts ``x`` with probability
``min(1, p(x) / q(x))`` and on rejection draws from ``max(0, p - q)`` renormalized. A seeded
request draws each draft with its position's generator (``Request.generator_at``), the uniform
its verification draws again there from ``p``: with ``q`` near ``p`` both give the same token.
A constrained request's drafts are masked as they are drawn: a copy of its matcher
(``TokenMatcher.draft_guide``) gives each draft's allowed tokens and takes the draft, so the
draft model proposes only what the constraint takes (a lazy matcher still waiting: no token
that would complete its trigger, where the speculator would cut the draft). Cutting a drawn
draft instead would bias a sampled request: verification needs each draft drawn from the ``q``
it is judged against, and a cut keeps only the drafts the constraint takes, so ``q`` must
leave out the others (masked ``q``: drawn and judged alike).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from inferd.engine.sampler import draw, sampling_probs
from inferd.layers.attention import AttentionMetadata, PrefillChunk, sliding_window_metadata
from inferd.models.gemma4_assistant import Gemma4AssistantForCausalLM, target_sources
from inferd.models.llama import KVCache, LlamaForCausalLM

if TYPE_CHECKING:
    from inferd.engine.kv_cache import KVCacheManager
    from inferd.engine.request import Request

BLOCK_SIZE = 16
FIRST_BLOCKS = 16  # 256 positions; the cache doubles past them


class DraftModelError(ValueError):
    """A draft model that cannot draft for the served one (another tokenizer, say)."""


@dataclass(slots=True)
class DraftCache:
    """One request's KV in the draft model and the tokens it holds, position by position."""

    caches: list[KVCache]  # per layer [blocks, BLOCK_SIZE, kv, d]
    tokens: list[int] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return self.caches[0][0].shape[0] * BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class SharedCache:
    """The served model's paged KV, where self-drafting reads and writes (module doc)."""

    kv: KVCacheManager  # the scheduler's: whose blocks a request owns
    caches: list[KVCache]  # the runner's first num_layers layers


class Drafter(Protocol):
    """What the speculator asks of a drafter (``DraftModel``, ``AssistantDrafter``)."""

    @property
    def model(self) -> nn.Module: ...

    def propose(self, request: Request, k: int) -> Draft: ...

    def forget(self, request_id: str) -> None: ...

    def share(self, kv: KVCacheManager, caches: list[KVCache]) -> None: ...


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: list[int]
    # Per draft, the distribution it was drawn from (normalized, [vocab]); None: greedy
    # (argmax, a point mass)
    probs: list[torch.Tensor] | None


class DraftModel:
    """Drafts tokens with ``model``'s first ``num_layers`` layers, final norm and head."""

    def __init__(
        self, model: LlamaForCausalLM, dtype: torch.dtype, num_layers: int | None = None
    ) -> None:
        total = model.config.num_layers
        layers = total if num_layers is None else num_layers
        if not 1 <= layers <= total:
            raise DraftModelError(
                f"self-speculation layers must be within 1..{total}, not {layers}"
            )
        if layers < total and type(model).forward is not LlamaForCausalLM.forward:
            # Its own forward (Gemma 3's two rotary tables, say) is not the loop below.
            raise DraftModelError(
                f"{model.config.architecture} models cannot draft with a part of their layers"
            )
        self.model, self.dtype, self.num_layers = model, dtype, layers
        self.vocab_size = model.config.vocab_size
        self.caches: dict[str, DraftCache] = {}  # per request, without a shared cache
        self.shared: SharedCache | None = None

    def share(self, kv: KVCacheManager, caches: list[KVCache]) -> None:
        """Draft in the served model's own paged cache (self-drafting: the same layers over the
        same tokens give the same keys and values)."""
        self.shared = SharedCache(kv, caches[: self.num_layers])

    def propose(self, request: Request, k: int) -> Draft:
        start = self._start(request, k)
        if start is None:
            return Draft([], None if request.params.greedy else [])
        run, pending = start
        return draw_drafts(request, k, run(pending), lambda token: run([token]))

    def _start(
        self, request: Request, k: int
    ) -> tuple[Callable[[list[int]], torch.Tensor], list[int]] | None:
        """How to append tokens to the request's draft KV (and get the logits after them), and
        the request's tokens it lacks; None: no room in the shared pool for the drafts."""
        tokens = [*request.prompt_token_ids, *request.output_token_ids]
        if self.shared is None:
            cache = self.caches.get(request.request_id)
            if cache is None:
                cache = self.caches[request.request_id] = self._new_cache()
            keep = _common_prefix(cache.tokens, tokens, len(tokens) - 1)
            del cache.tokens[keep:]  # rejected drafts: their KV is overwritten
            return (lambda new: self._run(cache, new)), tokens[keep:]
        # Positions from the last token on, one per draft (the last draft is not run).
        if not self.shared.kv.allocate_slots(request, k):
            return None
        at = request.num_computed_tokens

        def run(new: list[int]) -> torch.Tensor:
            nonlocal at
            logits = self._run_shared(request, at, new)
            at += len(new)
            return logits

        return run, tokens[at:]

    def forget(self, request_id: str) -> None:
        self.caches.pop(request_id, None)

    def _new_cache(self) -> DraftCache:
        return DraftCache([self._blocks(FIRST_BLOCKS) for _ in range(self.num_layers)])

    def _blocks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.model.config
        shape = (n, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        return torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)

    def _grow(self, cache: DraftCache, positions: int) -> None:
        blocks = cache.caches[0][0].shape[0]
        while blocks * BLOCK_SIZE < positions:
            blocks *= 2
        if blocks == cache.caches[0][0].shape[0]:
            return
        grown = []
        for k, v in cache.caches:
            k2, v2 = self._blocks(blocks)
            k2[: k.shape[0]], v2[: v.shape[0]] = k, v
            grown.append((k2, v2))
        cache.caches = grown

    @torch.inference_mode()
    def _run(self, cache: DraftCache, new: list[int]) -> torch.Tensor:
        """Append ``new`` at the cache's end; the logits [vocab] after its last token."""
        start, n = len(cache.tokens), len(new)
        self._grow(cache, start + n)
        positions = torch.arange(start, start + n)
        table = torch.arange(-(-(start + n) // BLOCK_SIZE))
        # the table is 0, 1, ...: slot == position
        logits = self._logits(new, positions, positions, table, cache.caches)
        cache.tokens.extend(new)
        return logits

    @torch.inference_mode()
    def _run_shared(self, request: Request, start: int, new: list[int]) -> torch.Tensor:
        """``new`` at positions ``start``... of the request in the served model's cache."""
        assert self.shared is not None
        size = self.shared.kv.block_size
        positions = torch.arange(start, start + len(new))
        table = torch.tensor(request.block_ids, dtype=torch.long)
        slots = table[positions // size] * size + positions % size
        return self._logits(new, positions, slots, table, self.shared.caches)

    def _logits(
        self,
        new: list[int],
        positions: torch.Tensor,
        slots: torch.Tensor,
        table: torch.Tensor,
        caches: list[KVCache],
    ) -> torch.Tensor:
        """The logits [vocab] after the last of ``new``, its K and V written at ``slots``."""
        start, n = int(positions[0]), len(new)
        if n == 1:
            meta = AttentionMetadata(
                slot_mapping=slots,
                decode_rows=torch.zeros(1, dtype=torch.long),
                decode_block_tables=table[None],
                decode_lens=torch.tensor([start + 1]),
                prefills=(),
            )
        else:
            chunk = PrefillChunk(0, n, start, table, None)
            meta = AttentionMetadata(slots, None, None, None, (chunk,))
        hidden = self._forward(torch.tensor(new), positions, meta, caches)
        return self.model.compute_logits(hidden[-1:])[0]

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[KVCache],
    ) -> torch.Tensor:
        model = self.model
        if self.num_layers == model.config.num_layers:
            return model(ids, positions, meta, caches)
        # LlamaForCausalLM.forward over the first layers only (checked in __init__).
        x = model.embed(ids)
        rotation = model.rotation_at(positions, x.dtype)
        window_meta = meta
        if model.config.sliding_window is not None and model.config.sliding_layers:
            window_meta = sliding_window_metadata(meta, model.config.sliding_window)
        for i, cache in enumerate(caches):
            sliding = model.config.window_of(i) is not None
            x = model.layers[i](x, rotation, window_meta if sliding else meta, cache)
        out: torch.Tensor = model.norm(x)
        return out


def draw_drafts(
    request: Request, k: int, logits: torch.Tensor, after: Callable[[int], torch.Tensor]
) -> Draft:
    """Up to ``k`` drafts from a drafter's ``logits`` for the next token and ``after``, which
    gives the logits following a drafted token (module doc: greedy, sampled, constrained)."""
    drafted: list[int] = []
    probs: list[torch.Tensor] = []
    guide = None if request.matcher is None else request.matcher.draft_guide()
    for i in range(k):
        if guide is not None:
            allowed = guide.allowed(logits.shape[-1])
            if allowed is not None:
                if not bool(allowed.any()):
                    break  # the constraint is complete: nothing to draft
                logits = logits.masked_fill(~allowed, float("-inf"))
        if request.params.greedy:
            drafted.append(int(logits.argmax()))
        else:
            q = sampling_probs(logits, request)
            # A seeded request draws with its position's generator: the uniform its
            # verification draws again there, so a close q drafts what p then gives.
            generator = request.generator_at(len(request.output_token_ids) + i)
            drafted.append(draw(q, generator))
            probs.append(q / q.sum())
        if guide is not None:
            guide.take(drafted[-1])
        if i + 1 < k:
            logits = after(drafted[-1])
    return Draft(drafted, None if request.params.greedy else probs)


class AssistantDrafter:
    """Drafts with Gemma 4's drafting assistant (models/gemma4_assistant.py) over the served
    model's paged cache, which it only reads: each round starts from the served model's final
    hidden state at the request's last computed position (``Request.draft_hidden``, kept by the
    engine after each step) and the last token, at that token's position; the keys are the
    request's computed ones (those of a rejected draft left behind the computed length are not
    read, where transformers' generator may still see the first one: both see the same keys
    after a prompt and after a round whose drafts all stood)."""

    def __init__(self, assistant: Gemma4AssistantForCausalLM, target: LlamaForCausalLM) -> None:
        text, served = assistant.assistant.text, target.config
        if assistant.assistant.backbone_hidden_size != served.hidden_size:
            raise DraftModelError(
                f"the assistant was made for a model {assistant.assistant.backbone_hidden_size} "
                f"wide; the served one is {served.hidden_size}"
            )
        if served.gemma4 is None or text.vocab_size != served.vocab_size:
            raise DraftModelError("Gemma 4's assistant drafts for a Gemma 4 of its vocabulary")
        self.sources = target_sources(served)
        for layer in range(text.num_layers):
            sliding = text.window_of(layer) is not None
            source = self.sources.get(sliding)
            if source is None or served.kv_shape(source) != text.kv_shape(layer):
                raise DraftModelError(
                    f"the assistant's layer {layer} cannot read the served model's cache"
                )
        self.model, self.target = assistant, target
        # transformers' mask lets the one query see ``sliding_window`` keys on either side of
        # it, its own place included: the last window + 1 keys.
        self.window = None if text.sliding_window is None else text.sliding_window + 1
        self.caches: dict[bool, KVCache] = {}

    def share(self, kv: KVCacheManager, caches: list[KVCache]) -> None:
        """Read the served model's cache (set once the engine is assembled)."""
        self.caches = {sliding: caches[layer] for sliding, layer in self.sources.items()}

    def forget(self, request_id: str) -> None:
        return None  # nothing kept per request

    @torch.inference_mode()
    def propose(self, request: Request, k: int) -> Draft:
        after = self.round(request)
        if after is None:
            return Draft([], None if request.params.greedy else [])
        return draw_drafts(request, k, after(request.output_token_ids[-1]), after)

    def round(self, request: Request) -> Callable[[int], torch.Tensor] | None:
        """This round's draft step: a token (the request's last, then each draft) -> the
        logits [vocab] of the next; None when the request has no state to draft from."""
        hidden = request.draft_hidden
        if hidden is None or not request.output_token_ids or not self.caches:
            return None
        at = request.num_computed_tokens  # the last token's position; keys before it
        table = torch.tensor(request.block_ids, dtype=torch.long)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([at]),
            decode_rows=torch.zeros(1, dtype=torch.long),
            decode_block_tables=table[None],
            decode_lens=torch.tensor([at]),
            prefills=(),
        )
        window = meta if self.window is None else sliding_window_metadata(meta, self.window)
        dtype = self.model.embed_tokens.weight.dtype
        position = torch.tensor([at])
        rotations = (
            self.model.rotary.at(position, dtype),
            self.model.local_rotary.at(position, dtype),
        )
        state = hidden[None].to(dtype)

        @torch.inference_mode()
        def after(token: int) -> torch.Tensor:
            nonlocal state
            embedded = self.target.embed(torch.tensor([token])).to(dtype)
            logits, state = self.model.draft(
                torch.cat((embedded, state), dim=-1), rotations, (meta, window), self.caches
            )
            return logits[0].float()

        return after


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
