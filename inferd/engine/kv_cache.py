"""KV-cache block accounting: a pool of fixed-size blocks with reference counts.

Pure Python: the tensors live in the model runner; this module only decides which block ids a
request owns. Block 0 is reserved as the null block, used to pad block tables.
"""

from __future__ import annotations

from collections import deque

from inferd.engine.request import Request

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                "the KV cache needs at least 2 blocks (one is the reserved null block)"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (and nothing taken) when too few are free."""
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def release(self, ids: list[int]) -> None:
        for i in ids:
            if self._refs[i] <= 0:
                raise RuntimeError(f"block {i} released more often than it was taken")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)


class KVCacheManager:
    """Grows and frees the block lists of requests."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def capacity_tokens(self) -> int:
        return (self.pool.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the next ``num_new_tokens`` of ``request``; False if the pool is short."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return True
        ids = self.pool.allocate(missing)
        if ids is None:
            return False
        request.block_ids.extend(ids)
        return True

    def free(self, request: Request) -> None:
        self.pool.release(request.block_ids)
        request.block_ids = []
