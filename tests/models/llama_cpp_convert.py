"""llama.cpp's own converter (``convert_hf_to_gguf.py``), the oracle for the GGUF layouts inferd
reads: a tiny Hugging Face checkpoint converted by it is the file a user would download.

The converter comes from the llama-cpp-python sdist, which vendors llama.cpp: fetched once
with pip (its digest checked) and only the converter kept (``convert_hf_to_gguf.py``,
``conversion/`` and llama.cpp's own ``gguf-py``, which the script puts first on its path), under
``$INFERD_HOME/test-tools`` beside the models the tests pull. It runs as a subprocess with this
Python: its imports (torch, transformers, numpy, pyyaml, requests) are all the test extra's.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from inferd.store import default_home

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDORED = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
KEPT = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


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


def convert(checkpoint: Path, out: Path, outtype: str, *, mmproj: bool = False) -> Path:
    """``checkpoint`` converted to ``out`` at ``outtype`` (f32, f16, q8_0, ...): its language
    model, or with ``mmproj`` its encoders as a projector file."""
    cmd = [sys.executable, str(converter()), str(checkpoint), "--outfile", str(out)]
    cmd += ["--outtype", outtype, *(["--mmproj"] if mmproj else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}"
    return out


# A file to convert: (its name, the converter's outtype, a projector or the language model).
FileSpec = tuple[str, str, bool]


def convert_files(checkpoint: Path, out: Path, specs: tuple[FileSpec, ...]) -> dict[str, Path]:
    """``checkpoint``'s files, by name, written into ``out`` two at a time."""
    converter()  # fetched once, before the conversions run side by side

    def one(spec: FileSpec) -> tuple[str, Path]:
        name, outtype, mmproj = spec
        return name, convert(checkpoint, out / f"{name}.gguf", outtype, mmproj=mmproj)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, specs))
