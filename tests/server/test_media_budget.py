"""What an image costs is known before it is decoded, and decoded pixels are budgeted.

- the prompt tokens from a size alone (``num_embeddings_for``, ``image_tokens``) equal what
  preparing a real image of that size gives, for Idefics3 tiles and Qwen2-VL grids;
- ``image_size`` reads the header only: a PNG cut right after its header still gives its size;
- ``PixelBudget``: a request over the whole budget is a 400, one that does not fit waits and
  runs when a decoded image is freed (the finalizer gives its share back), or gets a 503 with
  Retry-After after the wait bound.
"""

from __future__ import annotations

import asyncio
import gc
import io
import pickle

import pytest
from PIL import Image

from inferd.media.image import decode_image, image_size
from inferd.media.limits import MediaError
from inferd.models.idefics3_image import Idefics3ImageConfig, num_embeddings_for, prepare_image
from inferd.models.qwen2_vl_image import QwenVisualConfig, image_tokens
from inferd.models.qwen2_vl_image import prepare_image as prepare_qwen
from inferd.server.errors import APIError
from inferd.server.media import MediaPolicy, Modalities, decode_request_media
from inferd.server.media_budget import PixelBudget

SIZES = [(60, 80), (364, 364), (365, 200), (1000, 300), (300, 1000), (1456, 1456), (17, 2)]


@pytest.mark.parametrize("size", SIZES)
def test_idefics3_tokens_from_the_size_match_the_prepared_image(size: tuple[int, int]) -> None:
    cfg = Idefics3ImageConfig(longest_edge=4 * 64, tile=64, image_seq_len=4)
    prepared = prepare_image(Image.new("RGB", size), cfg)
    assert num_embeddings_for(*size, cfg) == prepared.num_embeddings


@pytest.mark.parametrize("size", SIZES)
def test_qwen_tokens_from_the_size_match_the_prepared_image(size: tuple[int, int]) -> None:
    cfg = QwenVisualConfig(min_pixels=56 * 56, max_pixels=448 * 448)
    prepared = prepare_qwen(Image.new("RGB", size), cfg)
    assert image_tokens(*size, cfg) == prepared.num_embeddings


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_size_comes_from_the_header_alone() -> None:
    data = _png(6000, 4000)
    header_only = data[:64]  # signature and IHDR: no pixel data at all
    assert image_size(header_only) == (6000, 4000)
    with pytest.raises(MediaError):
        decode_image(header_only)  # decoding it fails: image_size decoded nothing


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


def test_more_than_the_whole_budget_is_a_400() -> None:
    budget = PixelBudget(capacity=100)
    with pytest.raises(APIError) as err:
        _run(budget.acquire(101))
    assert err.value.status == 400 and err.value.code == "media_too_large"
    assert "--max-decoded-pixels" in err.value.message and budget.used == 0


def test_a_request_waits_until_a_decoded_image_is_freed() -> None:
    budget = PixelBudget(capacity=100, wait_seconds=30)

    async def scenario() -> list[str]:
        order: list[str] = []
        await budget.acquire(70)
        image = Image.new("RGB", (7, 10))
        budget.release_when_freed(image, 70)

        async def second() -> None:
            await budget.acquire(50)
            order.append("second runs")

        task = asyncio.create_task(second())
        await asyncio.sleep(0.05)
        order.append(f"waiting, {budget.used} used")
        del image  # the decoded pixels go: their share comes back
        gc.collect()
        await asyncio.wait_for(task, 10)
        return order

    assert _run(scenario()) == ["waiting, 70 used", "second runs"]
    assert budget.used == 50


def test_a_wait_past_the_bound_is_a_503_and_leaves_the_budget_as_it_was() -> None:
    budget = PixelBudget(capacity=100, wait_seconds=0.1)

    async def scenario() -> None:
        await budget.acquire(90)
        with pytest.raises(APIError) as err:
            await budget.acquire(20)
        assert err.value.status == 503 and err.value.code == "server_busy"
        assert err.value.headers == {"Retry-After": "1"}
        budget.release(90)
        await budget.acquire(100)  # nothing left over from the refused wait

    _run(scenario())
    assert budget.used == 100


def test_a_budget_crosses_processes_as_its_limits() -> None:
    """Ray sends replicas their settings pickled: the lock stays behind, the limits go."""
    budget = PixelBudget(capacity=1000, wait_seconds=2.5)
    budget.used = 600
    copy = pickle.loads(pickle.dumps(budget))
    assert (copy.capacity, copy.wait_seconds, copy.used) == (1000, 2.5, 0)
    asyncio.run(copy.acquire(1000))
    assert copy.used == 1000 and budget.used == 600


class _Seeing:
    """The parts of a served model the pre-decode price reads: one prompt token per 100
    pixels, a 100-token context."""

    class engine:
        max_model_len = 100

    tokenizer = None
    modalities = Modalities(("text", "image"))

    @staticmethod
    def image_tokens(width: int, height: int) -> int:
        return width * height // 100


def test_max_edge_prices_and_decodes_the_image_at_the_size_the_model_gets() -> None:
    """A 400x100 image costs 400 tokens as sent (over the 100-token context: refused before
    decoding); with --max-edge 80 it reaches the model as 80x20, 16 tokens, and is decoded."""
    import base64

    from inferd.media.limits import MediaLimits

    url = "data:image/png;base64," + base64.b64encode(_png(400, 100)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    plain = MediaPolicy.create()
    with pytest.raises(APIError, match="take at least 400 prompt tokens"):
        _run(decode_request_media(messages, plain, _Seeing()))
    fitted = MediaPolicy.create(limits=MediaLimits(max_image_edge=80))
    (image,) = _run(decode_request_media(messages, fitted, _Seeing()))  # type: ignore[misc]
    assert image.image.size == (80, 20)
