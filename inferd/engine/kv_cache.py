"""KV-cache block accounting: a pool of fixed-size blocks, reference counts, prefix caching.

Pure Python: the tensors live in the model runner; this module only decides which block ids a
request owns. Block 0 is reserved as the null block, used to pad block tables.

Prefix caching: once a block is full its content is identified by a chained hash::

    hash(block i) = H(hash(block i-1), token ids of block i, digests of media in block i)
    hash(block -1) = H(extra keys)

where the media digests tell apart images behind the same placeholder tokens (the same text
with another image never hits; the chain carries an image into every later block), and the
extra keys carry everything else that changes the keys and values (the model's
identity, the request's cache salt). A new request reuses the longest chain of cached blocks
that matches its prompt. Freed blocks keep their content and stay findable until the pool hands
them out again, least recently freed first.

Entries (``--prefix-cache-n``): the cached blocks form a tree, each block under the one before
it. An entry is a free block that ends a chain (no cached block follows it, no request holds
it): the chain a finished or preempted request leaves. Requests that leave the same chain leave
one entry; chains sharing a prefix (a system prompt) are one entry each and share its blocks.
A longer prompt hitting an entry's whole chain takes its last block out of the entries until it
is freed again, as the most recently used; a request leaving a chain already kept (the same
prompt again: its last block was recomputed, not taken) makes that entry the most recently
used. With a limit, the least recently used entries beyond it are forgotten: their blocks, back
to the first one that another chain or a request still uses, lose their hash (they stay free,
findable no more). Blocks in use are never forgotten.

Sliding windows: when every layer of the model attends only to the last ``window`` keys
(Mistral, Phi-3 with a window), a block whose every position lies behind the window of the
request's next token is never read again; it is given back at once and its entry in the
request's block list becomes ``NULL_BLOCK`` (attention masks those positions anyway), so a
request holds at most ``window + chunk`` tokens of KV however long it runs, and admission counts
only that. A model that mixes sliding and global layers (Gemma 2 and 3) keeps every block: the
pool is shared by all layers, and the global layers read every position.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from inferd.engine.request import Request

NULL_BLOCK = 0

BlockHash = bytes


def root_hash(*extra_keys: str) -> BlockHash:
    """The parent of a request's first block: model identity, cache salt and LoRA adapter."""
    h = hashlib.blake2b(digest_size=16)
    for key in extra_keys:
        h.update(key.encode())
        h.update(b"\x00")
    return h.digest()


def chain_hash(parent: BlockHash, tokens: list[int], media: Sequence[str] = ()) -> BlockHash:
    """``media``: digests of the images whose rows the block holds: their placeholder tokens
    are the same for every image, so the digest is what tells two images apart."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    for digest in media:
        h.update(b"\x00" + digest.encode())
    return h.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class BlockPool:
    def __init__(self, num_blocks: int, max_entries: int | None = None) -> None:
        """``max_entries``: prefix-cache entries kept at most (module doc); None: no limit."""
        if num_blocks < 2:
            raise ValueError(
                "the KV cache needs at least 2 blocks (one is the reserved null block)"
            )
        self.num_blocks = num_blocks
        self.max_entries = max_entries
        # Free blocks in eviction order (least recently freed first); O(1) removal on a hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._block_of: dict[BlockHash, int] = {}
        # The tree of cached blocks: each one's parent (None: a chain's first block) and the
        # number of cached blocks under each hash (kept by hash: a parent reused and cached
        # again under the same content keeps its children).
        self._parent_of: list[BlockHash | None] = [None] * num_blocks
        self._children: dict[BlockHash, int] = {}
        # Entries (module doc): their last blocks, least recently used first.
        self._entries: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (and nothing taken) when too few are free."""
        if n > len(self._free):
            return None
        ids = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._refs[block] = 1
            ids.append(block)
        return ids

    def release(self, ids: list[int]) -> None:
        # Release the tail first so a request's later blocks are evicted before its prefix.
        for i in reversed(ids):
            if self._refs[i] <= 0:
                raise RuntimeError(f"block {i} released more often than it was taken")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free[i] = None
                if self._ends_chain(i):
                    self._entries[i] = None
        self._trim_entries()

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._block_of.get(block_hash)

    def touch(self, block_hash: BlockHash) -> None:
        """The entry ending at ``block_hash``, if any, is the most recently used now."""
        block = self._block_of.get(block_hash)
        if block is not None and block in self._entries:
            self._entries.move_to_end(block)

    def take_cached(self, block_id: int) -> None:
        """Share a cached block with one more request."""
        if self._refs[block_id] == 0:
            del self._free[block_id]
            self._entries.pop(block_id, None)
        self._refs[block_id] += 1

    def register(self, block_id: int, block_hash: BlockHash, parent: BlockHash | None) -> None:
        """Mark a full block as holding the content ``block_hash``, under the block whose hash
        is ``parent`` (None: the first of its chain); the first writer wins."""
        if block_hash in self._block_of or self._hash_of[block_id] is not None:
            return
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        self._parent_of[block_id] = parent
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
            above = self._block_of.get(parent)
            if above is not None:
                self._entries.pop(above, None)  # its chain goes on: it ends none now

    def _ends_chain(self, block_id: int) -> bool:
        block_hash = self._hash_of[block_id]
        return block_hash is not None and block_hash not in self._children

    def _trim_entries(self) -> None:
        """Forget the least recently used entries beyond the limit (module doc)."""
        while self.max_entries is not None and len(self._entries) > self.max_entries:
            block, _ = self._entries.popitem(last=False)
            while True:  # up the chain while the blocks are free and on no other chain
                parent = self._forget(block)
                above = self._block_of.get(parent) if parent is not None else None
                if above is None or self._refs[above] > 0 or not self._ends_chain(above):
                    break
                block = above

    def forget_contents(self) -> None:
        """No block is found by its content any more (the keys and values in them came from
        weights the model no longer has); the blocks and their owners stay as they are, and
        with no cached block there is no tree and no entry left either."""
        self._hash_of = [None] * self.num_blocks
        self._block_of.clear()
        self._parent_of = [None] * self.num_blocks
        self._children.clear()
        self._entries.clear()

    def _evict(self, block_id: int) -> None:
        """The pool reuses a free block: its cached content goes. The chain it ended, if any,
        now ends one block earlier: the pool reuses the least recently freed blocks, so that
        shorter entry counts as the least recently used."""
        if self._hash_of[block_id] is None:
            return
        parent = self._forget(block_id)
        above = self._block_of.get(parent) if parent is not None else None
        if above is not None and self._refs[above] == 0 and self._ends_chain(above):
            self._entries[above] = None
            self._entries.move_to_end(above, last=False)

    def _forget(self, block_id: int) -> BlockHash | None:
        """Drop a block's cached content; returns its parent's hash."""
        block_hash, parent = self._hash_of[block_id], self._parent_of[block_id]
        assert block_hash is not None
        del self._block_of[block_hash]
        self._hash_of[block_id] = self._parent_of[block_id] = None
        self._entries.pop(block_id, None)
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
        return parent


def tokens_held(num_tokens: int, chunk: int, block_size: int, window: int | None) -> int:
    """The most KV (in tokens, whole blocks) a request of ``num_tokens`` holds at once when it
    advances at most ``chunk`` tokens a step: all of it, or under a sliding window (``window``,
    set when every layer slides) the window behind the step's first token plus the chunk, one
    partial block on each side. Admission and the startup sizing both count with it."""
    held = -(-num_tokens // block_size)
    if window is not None:
        held = min(held, -(-(window - 1 + chunk) // block_size) + 1)
    return held * block_size


class KVCacheManager:
    """Grows, shares and frees the block lists of requests."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        prefix_caching: bool = True,
        max_prefix_entries: int | None = None,
        model_key: str = "",
        window: int | None = None,
    ) -> None:
        """``max_prefix_entries``: prefix-cache entries kept at most (module doc; None: no
        limit). ``window``: set when every layer slides (``ModelConfig.uniform_window``):
        blocks behind it are freed as requests advance."""
        if window is not None and window < 1:
            raise ValueError("the sliding window must hold at least one key")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, max_prefix_entries)
        self.prefix_caching = prefix_caching
        self.model_key = model_key
        self.stats = PrefixCacheStats()

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tokens_held(self, num_tokens: int, chunk: int) -> int:
        return tokens_held(num_tokens, chunk, self.block_size, self.window)

    def attach_cached_prefix(self, request: Request) -> int:
        """Give a fresh request the cached blocks of its longest known prefix.

        The last prompt token is always recomputed, since its logits are needed to sample.
        A request that asks for prompt logprobs gets nothing: it needs the logits of every
        prompt position. Returns the number of tokens found.
        """
        if not self.prefix_caching or request.block_ids:
            return 0
        if request.params.prompt_logprobs is not None:
            return 0
        self.stats.queries += request.num_prompt_tokens
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            self.pool.take_cached(block)
            request.block_ids.append(block)
        request.num_computed_tokens = len(request.block_ids) * self.block_size
        self.stats.hits += request.num_computed_tokens
        return request.num_computed_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no later request reuses a block computed before."""
        self.pool.forget_contents()

    def cache_full_blocks(self, request: Request) -> None:
        """Register the blocks this request has completely computed."""
        if not self.prefix_caching:
            return
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        hashes = self._hashes(request, full)
        for index, block_hash in enumerate(hashes):
            block = request.block_ids[index]
            if block != NULL_BLOCK:  # freed behind the window: nothing left to register
                self.pool.register(block, block_hash, hashes[index - 1] if index else None)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the next ``num_new_tokens`` of ``request``; False if the pool is short.
        Under a sliding window, the blocks the next token can no longer see are freed first."""
        self._free_behind_window(request)
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return True
        ids = self.pool.allocate(missing)
        if ids is None:
            return False
        request.block_ids.extend(ids)
        return True

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks wholly past its first ``num_tokens`` tokens (those a
        rejected speculative draft was written into; never registered: not computed)."""
        keep = self.blocks_for(num_tokens)
        tail = request.block_ids[keep:]
        if tail:
            self.pool.release([b for b in tail if b != NULL_BLOCK])
            del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        self.pool.release([b for b in request.block_ids if b != NULL_BLOCK])
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if self.prefix_caching and full:  # the chain it leaves was used (module doc: entries)
            self.pool.touch(self._hashes(request, full)[-1])
        request.block_ids = []

    def _free_behind_window(self, request: Request) -> None:
        """Give back the blocks wholly before the first key the next token sees."""
        if self.window is None:
            return
        first_visible = request.num_computed_tokens - self.window + 1
        dead = min(max(first_visible, 0) // self.block_size, len(request.block_ids))
        ids = request.block_ids
        released = [b for b in ids[:dead] if b != NULL_BLOCK]
        if released:
            self.pool.release(released)
            ids[:dead] = [NULL_BLOCK] * dead

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """Chained hashes of the request's first ``num_blocks`` full blocks (memoized)."""
        known = request.block_hashes
        parent = (
            known[-1]
            if known
            else root_hash(self.model_key, request.cache_salt or "", request.params.lora or "")
        )
        bs = self.block_size
        for index in range(len(known), num_blocks):
            start, end = index * bs, (index + 1) * bs
            tokens = [request.token_at(p) for p in range(start, end)]
            parent = chain_hash(parent, tokens, request.media_digests(start, end))
            known.append(parent)
        return known[:num_blocks]
