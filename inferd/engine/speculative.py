"""Prompt-lookup (n-gram) speculative decoding: drafting, verification and when to bother.

A single stream on a CPU is bound by reading the weights: a step that computes 1 + k rows of one
request costs little more than a step of one row. So, before a decode step, a request whose
recent tokens (its last ``n`` tokens, n from ``max_ngram`` down to ``min_ngram``) occurred
earlier in its own prompt or output proposes the tokens that followed them then (a copy, a
quote, an edit of given text repeats long runs). Of the latest occurrences it takes the one
whose match runs furthest back, then the one in step with the copy (after the model replaced a
copied token, the copy resumes one source token on: an edit), then the latest. The scheduler
gives it a chunk of [last token + drafts]; the runner computes logits at every one of those
positions, each row as a one-query decode at its position through the weight-only kernels
whatever the row count (``layers.linear.packed_rows``: so a row's numerics are those it would
have had decoding alone); ``verify`` then decides how many drafts stand:

- greedy: the longest prefix of the drafts that matches the argmax at each position, plus the
  argmax after it (the "bonus" token): exactly the tokens plain greedy decoding would give;
- sampled: the speculative rejection rule. A prompt-lookup draft is deterministic (its
  distribution is a point mass on the draft token ``x``), so ``x`` is accepted with probability
  ``min(1, p(x) / 1) = p(x)`` under the row's sampling distribution ``p``; on rejection a token
  is drawn from ``p`` with ``x`` removed and renormalized, and verification stops. The emitted
  token then has probability ``p(x) [y = x] + (1 - p(x)) p(y) / (1 - p(x)) [y != x] = p(y)``:
  the sampled distribution is preserved token by token. Past the last accepted draft, the next
  row's distribution gives one more token.

The KV of the accepted drafts stays (their positions hold the tokens now emitted); the runner's
writes for rejected ones are left behind the request's computed length, to be overwritten, and
blocks wholly past it go back to the pool (``KVCacheManager.truncate``). Prefix-cache hashes
cover only computed blocks, so only accepted tokens.

Logit bias and the repetition, frequency and presence penalties apply per row as the sampler
applies them, with the drafts before the row counted as output (a row is only reached when they
were all accepted, so they are the output then).

Constrained requests (engine/core.py, structured/masks.py): a draft is cut before its first
token the constraint refuses (``TokenMatcher.valid_prefix``), and each of the chunk's rows gets
the mask of the constraint advanced over the drafts before it (llguidance advances a matcher
over the drafts and rolls it back while the model runs). The masked rows are then verified as
any others: a draft stands only where its row's masked argmax (or draw) is that token, so the
output is the one constrained decoding without drafts gives. The matcher itself only ever
consumes the tokens appended to the output, as without speculation: nothing to roll back.

A lazy constraint still waiting for its trigger (tool calls under ``tool_choice`` auto) cuts a
draft before its first token that would complete a trigger (``LazyMatcher.valid_prefix``): the
drafts before it are free text, so the constraint is still waiting after each of them, and each
row's mask is the waiting one at the output's end after the drafts before it (free, or the
trigger-completing tokens only where a call could start: ``LazyMatcher.row_sources``). The
token that completes a trigger is always a row's own, chosen under that row's mask as without
speculation; the next step then drafts under the grammar.

Thinking budgets (engine/thinking.py): past the budget the sampler forces the closing marker's
tokens (outside a constraint). A draft never reaches that point: it is cut so that the
reasoning tokens after it stay below the budget (``ThinkingTracker.unforced_ahead``), so no
verified row is ever forced; the forced tokens themselves are plain decode steps, and the answer
after the block drafts freely again. A row's sampled choice is thus the plain one at every
drafted position, and the output is the one without drafts.

Seeded sampled requests: their draws depend only on the seed and the output position
(``Request.generator_at``), and their verification is coupled to plain sampling: each row draws
its token as a plain decode at that position would (the same distribution, the same uniform),
and a draft stands while it equals that token. The output is the plain sampled text whatever
was drafted (so with speculation on or off, alone or batched, and again on a retry), and a
point-mass draft is still accepted with probability ``p(x)``.

Who does not speculate: nobody in a step with more decode rows than ``max_batch_rows`` (a
batch that large is compute-bound: extra rows cost what they would save); a request on its
first output token, on the last that max_tokens allows, or while its think block's closing
tokens are being forced; and a request whose drafts are all cut (above) or that paused drafting
(below).

A draft model (``--speculative draft``, or ``self``: the served model's first layers; see
engine/draft_model.py) proposes instead of the lookup (under a constraint it drafts from its
logits masked as the constraint, or the waiting lazy one, allows: a sampled draft must come from
the ``q`` it is judged against, so refused tokens are left out of ``q`` rather than cut after
the draw); its greedy drafts are verified as above,
its sampled ones (drawn from its distribution ``q``) by the general rule: ``x`` is accepted with
probability ``min(1, p(x) / q(x))``, and on rejection a token is drawn from ``max(0, p - q)``
renormalized, which again gives ``p``; with ``q`` a point mass it is the rule above. (The
point-mass rule would keep ``p`` for a drawn draft too, but accepts it only with ``p(x)``; with
``q`` near ``p`` this one accepts nearly always.)

When it pays: a verify step costs a little more than a plain decode (the extra rows, the
attention of each). Each request keeps a moving average of the tokens its verify steps gained
less the cost of the drafted rows; when it falls below zero the request stops drafting for a
pause that doubles each time (free text rarely repeats), and tries again after it; in a pause
only a lookup whose match runs ``sure_match`` tokens back drafts (the text repeating itself: a
reply that loops). Its drafts start at ``first_tokens``, double after a step that accepted
every one, halve at a miss (not below the start), and run as long as the lookup's match where
that is longer (a long match is a copy under way), up to ``num_tokens``: a copy runs long
drafts, a request that misses pays for few rows. A decode alone in its step verifies up to
``max_verify_rows`` rows (SmolLM2, 2 cores, int4: 1 row 7 ms, 8 rows 21.5, 16 rows 40, 24
rows 57: per accepted token a 32-row step costs less than an 8-row one, and takes a quarter of
the steps); several share ``max_batch_rows``. A draft model pays a forward pass per draft, so
a request drafts one token a step with it until one of its drafts stands.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inferd.config import EngineConfig
from inferd.engine.sampler import apply_logit_transforms, draw, sampling_probs

if TYPE_CHECKING:
    from inferd.engine.draft_model import Drafter
    from inferd.engine.request import Request

METHODS = ("ngram", "draft", "self", "off")
# Drafts per step at most by method, unless configured: a lookup's long drafts (a copy) fill a
# verify step of up to ``max_verify_rows``; a draft model runs once per draft it proposes.
DEFAULT_TOKENS = {"ngram": 31, "draft": 7, "self": 7}
# Occurrences of the sequence's end weighed per lookup (the latest), and how far back a match
# is followed: enough to tell a copy under way from a common phrase, in bounded time.
MATCH_CANDIDATES = 8
MATCH_CAP = 64


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" | "draft" | "self" | "off" (draft, self: draft_model.py)
    num_tokens: int = 3  # drafts per verify step at most (k)
    # A request's drafts start this long (capped by num_tokens) and double after a verify step
    # that accepted all of them, back to this at a miss: a copy runs long drafts, a request
    # whose drafts keep failing pays for few rows.
    first_tokens: int = 3
    max_ngram: int = 3  # the longest suffix looked up first
    min_ngram: int = 1  # the shortest suffix still looked up
    # Several decodes in a step: more decode rows than this and nobody drafts (the step is
    # compute-bound); fewer: drafts are cut so that the step's decode rows stay within it. 8:
    # the rows the weight-only int4/int8 kernels serve (layers/linear.py DEFAULT_SMALL_BATCH),
    # the memory-bound regime.
    max_batch_rows: int = 8
    # A decode alone in its step may verify this many rows (1 + drafts): one sequence's rows
    # keep getting cheaper per row past the int4 kernels' 8 (SmolLM2, 2 cores, ~300 tokens of
    # context: 1 row 9.3 ms, 8 rows 22-28, 16 rows 26-31, 32 rows 53), so a copy's long drafts
    # pay, while a batch's rows would compete with the other requests' own.
    max_verify_rows: int = 32
    # What a drafted row costs, in tokens of a plain decode step (SmolLM2, one sequence: a
    # plain step 7-9 ms, each verify row ~2 ms more through the int4 kernels)
    draft_cost: float = 0.2
    first_pause: int = 16  # decode steps without drafting after the first failing stretch
    # A lookup whose match runs this far back drafts even in a pause: the text repeats itself.
    sure_match: int = 6
    max_pause: int = 256

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(METHODS)}, not {self.method!r}"
            )
        if self.num_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("the n-gram lengths must satisfy 1 <= min_ngram <= max_ngram")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(slots=True)
class DraftState:
    """One request's lookup table and acceptance record."""

    # n-gram -> the positions right after its occurrences, oldest first (continuations' starts)
    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in ``index``
    # Where the copy stands: the token at sequence position ``anchor_end`` is expected to be
    # the one at ``anchor_source`` (-1: no copy yet). Set by a verified lookup draft, past the
    # model's own token as if it replaced one source token (an edit of a copied text), so that
    # among equally long matches the one in step with the copy wins.
    anchor_source: int = -1
    anchor_end: int = 0
    draft_source: int = -1  # the pending lookup draft's start in the sequence (-1: none)
    draft_end: int = 0  # the sequence's length when it was drafted
    # Moving average of (accepted - draft_cost * drafted) per verify step; it starts hopeful, so
    # a first miss does not pause a request (two of 2+ drafts do), and at 0 after a pause.
    gain: float = 0.5
    paused: int = 0  # decode steps left without drafting
    length: int = 0  # drafts it may propose next (0: the config's first length)
    pause: int = 0  # the length of the next pause
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True, slots=True)
class Verdict:
    tokens: list[int]  # the accepted drafts, then one token of the model's own
    accepted: int  # how many drafts were accepted


def draft_limit(request: Request, k: int) -> int:
    """How many of the ``k`` drafts a step allows the request may draft (module docstring):
    none past max_tokens (the last allowed token is always the model's own), and none that
    would reach a thinking budget (the sampler forces the closing tokens there, outside a
    constraint, and a verified row is never forced)."""
    k = min(k, request.params.max_tokens - len(request.output_token_ids) - 1)
    if request.thinking is not None and request.matcher is None:
        ahead = request.thinking.unforced_ahead()
        if ahead is not None:
            k = min(k, ahead)
    return max(k, 0)


class Speculator:
    """Drafts for decode steps and judges them; holds each request's ``DraftState``."""

    def __init__(self, config: SpeculativeConfig, drafter: Drafter | None = None) -> None:
        self.config = config
        self.drafter = drafter  # None: prompt lookup drafts
        self.states: dict[str, DraftState] = {}
        # A draft model's sampled drafts: the distributions they were drawn from, by request
        self.draft_probs: dict[str, list[torch.Tensor]] = {}
        self.drafted = 0  # totals over all requests, for stats and benchmarks
        self.accepted = 0

    def draft_budget(self, num_decodes: int, prompts_pending: bool = False) -> int:
        """Drafts per request in a step of ``num_decodes`` decodes (0: nobody drafts). A decode
        alone verifies up to ``max_verify_rows`` only while no prompt waits for the step: its
        rows would come out of the prompts' token budget and delay their first tokens."""
        cfg = self.config
        alone = num_decodes <= 1 and not prompts_pending
        rows = cfg.max_verify_rows if alone else cfg.max_batch_rows // max(num_decodes, 1)
        return max(0, min(cfg.num_tokens, rows - 1))

    def propose(self, request: Request, k: int) -> tuple[int, ...]:
        """Up to ``k`` drafts for the request's next tokens (none when it should not draft)."""
        if not request.output_token_ids:
            return ()
        k = draft_limit(request, k)
        if k <= 0:
            return ()
        state = self.states.setdefault(request.request_id, DraftState())
        # Paused (drafts kept failing): no drafts, but from a lookup whose match is long, which
        # is the text repeating itself (a reply that loops, a copy resuming after free text).
        least_match = 0
        if state.paused > 0:
            state.paused -= 1
            if self.drafter is not None:
                return ()
            least_match = self.config.sure_match
        length = state.length or self._first_length()
        if self.drafter is not None:
            # A draft model pays a forward pass per draft: until one of its drafts stands for
            # this request, it proposes one (a model whose drafts never stand, as self-drafting
            # with SmolLM2's first layers, then costs a pass per attempt, not three).
            if state.accepted == 0:
                length = 1
            self.draft_probs.pop(request.request_id, None)  # a dropped earlier draft's
            draft = self.drafter.propose(request, min(k, length))
            if draft.probs is not None:
                self.draft_probs[request.request_id] = draft.probs
            drafted = draft.tokens
        else:
            tokens = [*request.prompt_token_ids, *request.output_token_ids]
            drafted = self._lookup(state, tokens, k, length, least_match)
        if request.matcher is not None and drafted:
            # Never draft what the constraint refuses: its row could not choose it.
            drafted = drafted[: request.matcher.valid_prefix(drafted)]
        return tuple(drafted)

    def _lookup(
        self, state: DraftState, tokens: list[int], k: int, length: int, least_match: int = 0
    ) -> list[int]:
        """At most ``k`` tokens that followed the longest earlier match of the sequence's end:
        ``length`` of them (the request's record), or as many as the match is long if more (a
        long match is a copy under way: it repeated that much already). None where the match
        is shorter than ``least_match``."""
        cfg, end = self.config, len(tokens)
        # Index the n-grams that end before the last token (whose continuation is unknown).
        for e in range(state.indexed, end - 1):
            for n in range(cfg.min_ngram, min(cfg.max_ngram, e + 1) + 1):
                state.index.setdefault(tuple(tokens[e - n + 1 : e + 1]), []).append(e + 1)
        state.indexed = max(state.indexed, end - 1)
        state.draft_source = -1
        for n in range(min(cfg.max_ngram, end), cfg.min_ngram - 1, -1):
            starts = state.index.get(tuple(tokens[end - n :]))
            if starts:
                start, match = self._best_start(state, tokens, starts, n)
                if match < least_match:
                    return []
                state.draft_source, state.draft_end = start, end
                return tokens[start : min(start + min(k, max(length, match)), end)]
        return []

    def _best_start(
        self, state: DraftState, tokens: list[int], starts: list[int], n: int
    ) -> tuple[int, int]:
        """Among the latest occurrences of the sequence's last ``n`` tokens, the one whose match
        runs furthest back, then the one where the copy stands, then the latest; with the
        length of its match."""
        end = len(tokens)
        expected = state.anchor_source + end - state.anchor_end if state.anchor_source >= 0 else -1
        best, best_key = starts[-1], (-1, 0, 0)
        for start in reversed(starts[-MATCH_CANDIDATES:]):
            match, limit = n, min(start, MATCH_CAP)
            while match < limit and tokens[start - 1 - match] == tokens[end - 1 - match]:
                match += 1
            key = (match, start == expected, start)
            if key > best_key:
                best, best_key = start, key
        return best, best_key[0]

    def verify(self, logits: torch.Tensor, draft: Sequence[int], request: Request) -> Verdict:
        """logits: [len(draft) + 1, vocab], row i predicting the token after draft i - 1."""
        params = request.params
        if params.transforms_logits:
            prompt, output = request.prompt_token_ids, request.output_token_ids
            rows = [
                apply_logit_transforms(row, params, prompt, [*output, *draft[:i]])
                for i, row in enumerate(logits.unbind(0))
            ]
            logits = torch.stack(rows)
        # The scheduler may have cut the drafts: their distributions are a prefix too.
        probs = self.draft_probs.pop(request.request_id, None)
        if params.greedy:
            verdict = _verify_greedy(logits, draft)
        elif params.seed is not None:
            verdict = _verify_coupled(logits, draft, request)
        else:
            verdict = _verify_sampled(logits, draft, request, probs)
        self._record(request.request_id, len(draft), verdict.accepted)
        return verdict

    def _record(self, request_id: str, drafted: int, accepted: int) -> None:
        cfg = self.config
        self.drafted += drafted
        self.accepted += accepted
        state = self.states.setdefault(request_id, DraftState())
        state.drafted += drafted
        state.accepted += accepted
        if state.draft_source >= 0:
            # The copy goes on past the accepted drafts and the model's own token.
            state.anchor_source = state.draft_source + accepted + 1
            state.anchor_end = state.draft_end + accepted + 1
            state.draft_source = -1
        if accepted == drafted >= (state.length or self._first_length()):
            state.length = min(2 * drafted, cfg.num_tokens)
        elif accepted < drafted:
            # A miss: half as long (a copy with an edit goes on), not below the first length.
            state.length = max(drafted // 2, self._first_length())
        state.gain = 0.5 * state.gain + 0.5 * (accepted - cfg.draft_cost * drafted)
        if state.gain < 0:
            state.pause = min(max(state.pause * 2, cfg.first_pause), cfg.max_pause)
            state.paused, state.gain = state.pause, 0.0
        elif accepted > 0:
            state.pause = 0  # it pays again: the next failing stretch pauses briefly

    def _first_length(self) -> int:
        return min(self.config.first_tokens, self.config.num_tokens)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.draft_probs.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request_id)


def speculator_for(config: EngineConfig, drafter: Drafter | None = None) -> Speculator | None:
    """The engine's speculator as its settings ask (None: off). ``drafter``: the draft model
    of ``draft`` and ``self`` (serving/draft.py loads it). Off without a KV cache: every
    token recomputes its sequence, drafts would too."""
    if config.speculative == "off" or config.no_kv_cache:
        return None
    if (drafter is None) != (config.speculative == "ngram"):
        raise ValueError(f"speculative={config.speculative!r} drafts with a draft model")
    k = config.num_speculative_tokens or DEFAULT_TOKENS[config.speculative]
    return Speculator(SpeculativeConfig(config.speculative, num_tokens=k), drafter)


def _verify_greedy(logits: torch.Tensor, draft: Sequence[int]) -> Verdict:
    best: list[int] = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == best[accepted]:
        accepted += 1
    return Verdict([*draft[:accepted], best[accepted]], accepted)


def _verify_coupled(logits: torch.Tensor, draft: Sequence[int], request: Request) -> Verdict:
    """A seeded request: each row's token is the plain draw at its output position; the drafts
    stand while they equal those tokens (module docstring)."""
    first = len(request.output_token_ids)
    tokens: list[int] = []
    for i, row in enumerate(logits.unbind(0)):
        tokens.append(draw(sampling_probs(row, request), request.generator_at(first + i)))
        if i == len(draft) or tokens[-1] != draft[i]:
            return Verdict(tokens, i)
    raise AssertionError("logits must have a row past the last draft")


def _verify_sampled(
    logits: torch.Tensor,
    draft: Sequence[int],
    request: Request,
    draft_probs: Sequence[torch.Tensor] | None = None,
) -> Verdict:
    """The rejection rule (an unseeded request). ``draft_probs``: per draft, the normalized
    distribution ``q`` it was drawn from (a draft model); None: each draft is a point mass
    (prompt lookup)."""
    generator = request.generator
    for i, token in enumerate(draft):
        probs = sampling_probs(logits[i], request)
        if draft_probs is None:
            chance = float(probs[token] / probs.sum())
        else:
            probs = probs / probs.sum()
            q = draft_probs[i]
            chance = min(1.0, float(probs[token] / q[token]))  # q[token] > 0: it was drawn
        if float(torch.rand(1, generator=generator, device=probs.device)) < chance:
            continue
        if draft_probs is None:
            # Rejected (so chance < 1: some other token has mass): draw from p without it.
            probs[token] = 0.0
        else:
            # Rejected: the residual max(0, p - q) (mass where p exceeds q; p > q somewhere,
            # else p(x) >= q(x) and x was accepted; rounding aside, when p itself is drawn).
            residual = (probs - draft_probs[i]).clamp_min(0.0)
            probs = residual if float(residual.sum()) > 0 else probs
        return Verdict([*draft[:i], draw(probs, generator)], i)
    bonus = draw(sampling_probs(logits[len(draft)], request), generator)
    return Verdict([*draft, bonus], len(draft))
