"""The encoder cache's byte budget: least recently used entries go first, too-big ones are
never kept."""

from __future__ import annotations

import pytest
import torch

from inferd.engine.encoder_cache import EncoderCache


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)  # 16 bytes a row


def test_hits_and_least_recently_used_eviction() -> None:
    cache = EncoderCache(budget_bytes=100)
    cache.put("a", rows(3))  # 48 bytes
    cache.put("b", rows(3))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", rows(3))  # over budget: b goes, not a
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.used_bytes == 96
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (1, 3, 1)


def test_an_output_larger_than_the_budget_is_not_kept() -> None:
    cache = EncoderCache(budget_bytes=32)
    cache.put("big", rows(3))
    assert len(cache) == 0 and cache.used_bytes == 0
    assert cache.get("big") is None


def test_budget_zero_keeps_nothing_and_negative_is_refused() -> None:
    cache = EncoderCache(0)
    cache.put("a", rows(1))
    assert len(cache) == 0
    with pytest.raises(ValueError):
        EncoderCache(-1)


def test_encoder_batches_hold_at_most_the_tile_cap() -> None:
    from inferd.engine.request import MediaInput
    from inferd.engine.runner import ENCODER_BATCH_TILES, _tile_batches

    def image(tiles: int) -> MediaInput:
        return MediaInput(str(tiles), (0,), torch.zeros(tiles, 3, 1, 1))

    sizes = [7, 4, 5, 1, 20, 3]
    batches = _tile_batches([image(n) for n in sizes])
    assert [[m.pixel_values.shape[0] for m in b] for b in batches] == [[7, 4, 5], [1], [20], [3]]
    assert all(
        sum(m.pixel_values.shape[0] for m in b) <= ENCODER_BATCH_TILES or len(b) == 1
        for b in batches
    )


def test_encoder_batches_hold_one_modality_and_clips_weigh_their_tiles() -> None:
    from inferd.engine.request import MediaInput
    from inferd.engine.runner import AUDIO_CLIP_TILES, ENCODER_BATCH_TILES, _tile_batches

    def image(tiles: int) -> MediaInput:
        return MediaInput(f"i{tiles}", (0,), torch.zeros(tiles, 3, 1, 1))

    def clip(name: str) -> MediaInput:
        return MediaInput(name, (0,), torch.zeros(1, 2, 4), modality="audio", frames=3)

    per_call = ENCODER_BATCH_TILES // AUDIO_CLIP_TILES
    media = [image(2), *(clip(f"a{n}") for n in range(per_call + 1)), image(3)]
    batches = _tile_batches(media)
    assert [[m.digest for m in b] for b in batches] == [
        ["i2"],
        [f"a{n}" for n in range(per_call)],
        [f"a{per_call}"],
        ["i3"],
    ]


def test_clear_forgets_every_entry_and_keeps_the_counters() -> None:
    cache = EncoderCache(budget_bytes=100)
    cache.put("a", rows(3))
    assert cache.get("a") is not None
    cache.clear()
    assert len(cache) == 0 and cache.used_bytes == 0 and cache.get("a") is None
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    cache.put("b", rows(6))  # the whole budget is free again
    assert "b" in cache
