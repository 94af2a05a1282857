from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.live import LiveServer, live_server


@pytest.fixture(scope="session")
def server(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`inferd serve` on the real default model, float32 so greedy text is batch-independent."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = ["-m", str(smollm2_gguf), "--dtype", "f32", "--max-seqs", "8", "--max-seq-len", "2048"]
    with live_server(args, log) as live:
        yield live
