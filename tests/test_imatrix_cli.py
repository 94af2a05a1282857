"""``inferd imatrix`` then ``inferd quantize --imatrix`` on the real default model, through the
CLI: the matrix file, the store entry (named and looked up by the matrix's digest, never taken
for the plain one), the manifest recording it, and the stored weights being the weighted ones.

q8 rather than q4: SmolLM2's projections are Q4_1 in the GGUF, already on a 4-bit grid of 32
that q4 requantizes exactly, so q4 gives the same weights with or without a matrix (the weighted
search keeps an exact fit); one int8 scale per row has room to move.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from inferd.cli import main
from inferd.config import EngineConfig
from inferd.doctor import store_info
from inferd.layers.linear import PackedKind
from inferd.loading.gguf import GGUFFile
from inferd.loading.imatrix_file import read_imatrix
from inferd.loading.quantize import (
    QuantizedManifest,
    find_quantized,
    isq_for,
    load_quantized,
    quantize_weight,
)
from inferd.source import resolve_source
from inferd.tools_cli import print_quantized


def test_imatrix_then_quantize_with_it(
    smollm2_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("INFERD_HOME", str(home))
    calibration = tmp_path / "calibration.txt"  # Python's own argparse source: English and code
    calibration.write_text(Path(argparse.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    out = tmp_path / "smollm2.imatrix.gguf"
    model = ["-m", str(smollm2_gguf)]
    chunks = ["--chunk-size", "128", "--chunks", "2", "--calibration", str(calibration)]
    assert main(["imatrix", *model, *chunks, "-o", str(out)]) == 0
    imatrix = read_imatrix(out)
    assert (imatrix.chunk_count, imatrix.chunk_size) == (2, 128)
    assert imatrix.datasets == (str(calibration),)
    assert len(imatrix.counts) == 30 * 4  # every layer's projections; the tied head never runs
    assert set(imatrix.counts.values()) == {2 * 128}
    assert f"imatrix sha256:{imatrix.digest()[:16]}" in capsys.readouterr().out

    quantize = ["quantize", *model, "--isq", "q8", "--imatrix", str(out)]
    assert main(quantize) == 0
    assert "120 of 120 by importance" in capsys.readouterr().out
    (folder,) = (home / "quantized").iterdir()
    assert folder.name.endswith(f"-q8-imatrix-{imatrix.digest()[:12]}")
    manifest = QuantizedManifest(**json.loads((folder / "manifest.json").read_text()))
    source = resolve_source(str(smollm2_gguf))
    assert (manifest.imatrix, manifest.method, manifest.source_digest) == (
        imatrix.digest(),
        "q8",
        source.digest,
    )

    # The stored weights are the importance-weighted ones, and not plain rounding's.
    stored = load_quantized(folder, manifest)["layers.5.mlp.down_proj"]
    w = GGUFFile(smollm2_gguf).load_tensor("blk.5.ffn_down.weight")
    weighted = quantize_weight(w, PackedKind.INT8, imatrix.importance("layers.5.mlp.down_proj"))
    assert torch.equal(stored.q, weighted.q) and torch.equal(stored.scale, weighted.scale)
    assert not torch.equal(stored.scale, quantize_weight(w, PackedKind.INT8).scale)

    # A plain --isq q8 does not take this entry; --isq q8 --imatrix FILE does.
    assert find_quantized(source.digest, "q8") is None
    plain = isq_for("q8", source.digest)
    assert plain is not None and not plain.stored and plain.imatrix is None
    with_matrix = isq_for("q8", source.digest, imatrix=read_imatrix(out))
    assert with_matrix is not None and len(with_matrix.stored) == 120
    assert main(quantize) == 0
    assert "already in the store" in capsys.readouterr().out

    print_quantized(home)  # `inferd models`' lines name the matrix, and so does the doctor
    assert f"imatrix sha256:{imatrix.digest()[:16]}" in capsys.readouterr().out
    (listed,) = store_info(home)["quantized"]
    assert listed["imatrix"] == f"sha256:{imatrix.digest()}"


def test_imatrix_goes_with_isq() -> None:
    with pytest.raises(ValueError, match="goes with in-situ quantization"):
        EngineConfig(imatrix="m.gguf")
    assert EngineConfig(isq="q4", imatrix="m.gguf").imatrix == "m.gguf"
