from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.live import LiveServer, live_server

# the live tests' shared checks report what differed, as the tests' own asserts do
pytest.register_assert_rewrite("tests.server.media_replies")


@pytest.fixture(scope="session")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`inferd serve` on the real default model, float32 so greedy text is batch-independent."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "8", "--max-seq-len", "2048"]
    with live_server(args, log) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    """The official SDK in strict mode against the shared server, closed with the module."""
    with openai.OpenAI(
        base_url=server.api, api_key="unused", max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
