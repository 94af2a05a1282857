"""The AVX2 build of the kernels, forced on whatever machine runs the tests
(``INFERD_KERNEL_ISA=avx2``): the ISA choice, the kernel parity suite under that build, and a
whole model on the AVX2 default path (float32 activations, int4/int8 weight copies for decode)
against dense float32.

The ISA is chosen once per process, so the forced runs are subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inferd import kernels

ROOT = Path(__file__).resolve().parents[2]
AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}


def _forced_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "INFERD_KERNEL_ISA": "avx2", "PYTHONPATH": path}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=_forced_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_isa_is_the_best_the_cpu_has_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFERD_KERNEL_ISA", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: AVX512_FLAGS)
    assert kernels.kernel_isa() == kernels.ISAS[0]
    assert "-mavx512bf16" in kernels.ISAS[0].cflags
    monkeypatch.setattr(kernels, "cpu_flags", lambda: AVX512_FLAGS - {"avx512_bf16"})
    isa = kernels.kernel_isa()  # Skylake-X: AVX-512 without bf16 builds the AVX2 kernels
    assert isa is not None and isa.name == "avx2" and "-march=native" not in isa.cflags
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert kernels.kernel_isa() is None
    monkeypatch.setattr(kernels, "cpu_flags", lambda: AVX512_FLAGS)
    monkeypatch.setenv("INFERD_KERNEL_ISA", "AVX2")
    isa = kernels.kernel_isa()
    assert isa is not None and isa.name == "avx2"
    assert "avx2" in kernels._extension_name()  # its own build, beside the AVX-512 one
    monkeypatch.setenv("INFERD_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="choose one of"):
        kernels.kernel_isa()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: AVX2_FLAGS)
    monkeypatch.setenv("INFERD_KERNEL_ISA", "avx512")
    with pytest.raises(ValueError, match="this CPU lacks"):
        kernels.kernel_isa()


def test_the_kernel_parity_suite_passes_on_the_avx2_build() -> None:
    assert kernels.cpu_flags() >= AVX2_FLAGS, "the test machines have AVX2"
    tests = [
        "tests/kernels/test_fused.py",
        "tests/kernels/test_checks.py",
        "tests/kernels/test_kv_int8.py",
    ]
    result = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


MODEL_SCRIPT = """
import json
from inferd import LLM, SamplingParams
from inferd.kernels import kernel_isa
from inferd.layers.linear import Linear
PROMPTS = {prompts!r}
fast = LLM("smollm2")
kinds = [m.packed_kind.value for m in fast.engine.model.modules()
         if isinstance(m, Linear) and m.packed_kind is not None]
greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
out = fast.generate(PROMPTS, greedy, use_tqdm=False)  # one batch: 4-row decode steps
out += fast.generate(PROMPTS[:1], greedy, use_tqdm=False)  # and one row
ref = LLM("smollm2", dtype="f32", packed_kernels=False)
pairs = []
for o in out:
    seq = o.prompt_token_ids + list(o.outputs[0].token_ids)
    scored = ref.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    expected = scored[0].prompt_logprobs[len(o.prompt_token_ids):]
    for got, want in zip(o.outputs[0].logprobs, expected):
        pairs.append((got.logprob, want.logprob, want.top[0][0] == got.token_id))
print(json.dumps({{"isa": kernel_isa().name, "dtype": str(fast.model.dtype), "kinds": kinds,
                  "pairs": pairs}}))
"""
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
]


def test_the_avx2_default_path_stays_close_to_dense_float32(smollm2_gguf: Path) -> None:
    """Greedy decodes on the forced-AVX2 defaults, each token's logprob against dense float32
    scoring the same text: the same top-1 token and logprobs within a few hundredths."""
    result = _run(["-c", MODEL_SCRIPT.format(prompts=PROMPTS)], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["isa"] == "avx2" and report["dtype"] == "torch.float32"
    # Decode ran on the packed copies: int4 in inferd's row layout where the GGUF had int4.
    assert report["kinds"].count("int4_rows") >= 60 and "int4" not in report["kinds"]
    pairs = report["pairs"]
    assert len(pairs) == 5 * 16
    agreement = sum(same for _, _, same in pairs) / len(pairs)
    drift = [abs(got - want) for got, want, _ in pairs]
    assert agreement >= 0.95, agreement
    assert sum(drift) / len(drift) < 0.06 and max(drift) < 0.5, (sum(drift) / len(drift), drift)


def test_float32_models_take_packed_copies_only_on_the_avx2_build() -> None:
    isa = kernels.kernel_isa()
    assert kernels.packs_weights(torch.bfloat16)
    assert kernels.packs_weights(torch.float32) == (isa is not None and isa.name == "avx2")
    assert not kernels.packs_weights(torch.float16)
