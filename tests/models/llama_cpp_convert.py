"""llama.cpp's own converter (``convert_hf_to_gguf.py``), the oracle for the GGUF layouts inferd
reads: a tiny Hugging Face checkpoint converted by it is the file a user would download.

The converter comes from the llama-cpp-python sdist, which vendors llama.cpp: fetched once
with pip (its digest checked) and only the converter kept (``convert_hf_to_gguf.py``,
``conversion/`` and llama.cpp's own ``gguf-py``, which the script puts first on its path), under
``$INFERD_HOME/test-tools`` beside the models the tests pull. It runs as a subprocess with this
Python: its imports (torch, transformers, numpy, pyyaml, requests, and sentencepiece, which its
vocabulary reader imports before it looks for a ``tokenizer.model``) are all the test extra's.

llama.cpp recognizes a byte-level BPE's pre-tokenizer by a hash of the ids its vocabulary gives a
fixed text (``get_vocab_base_pre``), a table of real vocabularies that a tiny trained one is never
in; so a conversion may name the split its tokenizer makes (``pre_tokenizer``, llama.cpp's name
for it), and the converter then runs with that one answer given (``_NAMED_PRE``).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inferd.store import default_home

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
# Runs the converter (argv: script, pre-tokenizer name, its arguments) with the pre-tokenizer
# named rather than recognized.
_NAMED_PRE = """
import runpy, sys
from pathlib import Path
script, pre, *args = sys.argv[1:]
sys.path[:0] = [str(Path(script).parent), str(Path(script).parent / "gguf-py")]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
"""
# A file to convert: (its name, the converter's --outtype, projector or language model).
FileSpec = tuple[str, str, bool]


def converter() -> Path:
    """The converter script, fetched and unpacked on first use."""
    home = default_home() / "test-tools" / "llama.cpp-0.3.36"
    script = home / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    home.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home.parent) as tmp:
        download = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        pip += ["--disable-pip-version-check", "--quiet", "--dest", str(download)]
        subprocess.run([*pip, LLAMA_CPP_PYTHON], check=True)
        sdist = download / SDIST
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        assert digest == SDIST_SHA256, f"{SDIST} has digest {digest}"
        unpacked = download / "llama.cpp"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.removeprefix(VENDORED)
                if member.isfile() and inner != member.name and inner.startswith(KEPT):
                    member.name = inner
                    tar.extract(member, unpacked, filter="data")
        try:
            unpacked.rename(home)
        except OSError:  # another process unpacked it first
            shutil.rmtree(unpacked)
    return script


def convert(
    checkpoint: Path,
    out: Path,
    outtype: str,
    *,
    mmproj: bool = False,
    pre_tokenizer: str | None = None,
) -> Path:
    """``checkpoint`` converted to ``out`` at ``outtype`` (f32, f16, q8_0, ...): its language
    model, or with ``mmproj`` its encoders as a projector file; ``pre_tokenizer`` names its
    byte-level BPE's split (llama.cpp's name: ``qwen2`` ...)."""
    script = str(converter())
    run = [script] if pre_tokenizer is None else ["-c", _NAMED_PRE, script, pre_tokenizer]
    cmd = [sys.executable, *run, str(checkpoint), "--outfile", str(out)]
    cmd += ["--outtype", outtype, *(["--mmproj"] if mmproj else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}"
    return out


def convert_files(
    checkpoint: Path, out: Path, files: Sequence[FileSpec], *, pre_tokenizer: str | None = None
) -> dict[str, Path]:
    """The converter's ``files`` of ``checkpoint``, by name, written into ``out`` two at a
    time."""
    converter()  # fetched once, before the conversions run side by side

    def one(spec: FileSpec) -> tuple[str, Path]:
        name, outtype, mmproj = spec
        path = out / f"{name}.gguf"
        return name, convert(checkpoint, path, outtype, mmproj=mmproj, pre_tokenizer=pre_tokenizer)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, files))
