"""What an importance matrix buys ISQ: KL divergence and top-1 agreement against float32 on
held-out text, with and without the matrix.

    .venv/bin/python benchmarks/imatrix_quality.py [--models smollm2 gemma3]
        [--calibration-chunks 32] [--eval-chunks 8] [--chunk-size 512]

For each model (a GGUF in the store) the reference is the dense float32 model (the file's
weights dequantized); ISQ then quantizes those float32 weights again. The importance matrix is
collected on the reference model (``loading/calibration.compute_imatrix``, llama-imatrix's
chunking) from the docstrings of some standard-library modules, and the evaluation text is the
docstrings of other modules: the two never share a module, so no passage is seen twice. Both
come from this Python's own library: no network, the same text on every run of one Python.

Rows, per model (each quantized model runs ISQ's kernels, as a served one does):

- ``q4`` / ``q8``: plain ISQ (each group's own [min, max]; each row's absolute maximum);
- ``q4 + imatrix`` / ``q8 + imatrix``: the grids chosen for the matrix (loading/weighted_codes.py);
- ``q4 + search, uniform importance``: the same search with every column weighing the same, to
  tell what the search alone buys from what the matrix's statistics buy.

Each row prints the mean over positions of KL(p_f32 || p_quantized) of the next-token
distributions, the share of positions whose top-1 token matches float32, and the perplexity of
the evaluation text. The README's table (quantization section) is this script's output.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time
from dataclasses import dataclass

import torch

from inferd import kernels
from inferd.loading.calibration import calibration_chunks, compute_imatrix, sequence_hidden
from inferd.loading.imatrix import Imatrix
from inferd.loading.model import LoadedModel, load
from inferd.models.llama import LlamaForCausalLM
from inferd.source import resolve_source

CALIBRATION_MODULES = (
    "typing",
    "logging",
    "json",
    "argparse",
    "subprocess",
    "re",
    "shutil",
    "itertools",
    "collections",
    "threading",
)
EVALUATION_MODULES = (
    "statistics",
    "difflib",
    "random",
    "zipfile",
    "textwrap",
    "tarfile",
    "http.client",
    "decimal",
)
ROWS = 128  # logits computed this many positions at a time (Gemma 3's 262k vocabulary)


def module_docs(names: tuple[str, ...]) -> str:
    """Each module's docstring and its own public members' docstrings, in a fixed order."""
    parts = []
    for name in names:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for key, value in sorted(vars(module).items()):
            if key.startswith("_") or getattr(value, "__module__", None) != module.__name__:
                continue
            doc = inspect.getdoc(value)
            if doc:
                parts.append(f"{key}: {doc}")
    return "\n\n".join(parts)


@dataclass
class Score:
    """Sums over the evaluated positions."""

    kl: float = 0.0
    agree: int = 0
    nll: float = 0.0
    positions: int = 0

    def row(self, name: str) -> str:
        n = self.positions
        return (
            f"| {name} | {self.kl / n:.5f} | {self.agree / n:.2%} | {math.exp(self.nll / n):.3f} |"
        )


def uniform(imatrix: Imatrix) -> Imatrix:
    """The same modules and counts with every column of equal importance."""
    sums = {m: torch.ones_like(s) * imatrix.counts[m] for m, s in imatrix.sums.items()}
    return Imatrix(sums, dict(imatrix.counts))


def evaluate(
    reference: LlamaForCausalLM, models: dict[str, LlamaForCausalLM], chunks: list[list[int]]
) -> tuple[Score, dict[str, Score]]:
    """The reference's perplexity, and each model's KL, agreement and perplexity against it."""
    base, scores = Score(), {name: Score() for name in models}
    with torch.inference_mode():
        for chunk in chunks:
            targets = torch.tensor([*chunk[1:], -1])  # the last position predicts past the text
            ref_hidden = sequence_hidden(reference, chunk)
            hidden = {name: sequence_hidden(m, chunk) for name, m in models.items()}
            for start in range(0, len(chunk), ROWS):
                rows = slice(start, start + ROWS)
                logp = reference.compute_logits(ref_hidden[rows]).log_softmax(-1)
                _add(base, logp, logp, targets[rows])
                for name, model in models.items():
                    logq = model.compute_logits(hidden[name][rows]).log_softmax(-1)
                    _add(scores[name], logp, logq, targets[rows])
    return base, scores


def _add(score: Score, logp: torch.Tensor, logq: torch.Tensor, targets: torch.Tensor) -> None:
    score.kl += float((logp.exp() * (logp - logq)).sum())
    score.agree += int((logp.argmax(-1) == logq.argmax(-1)).sum())
    scored = targets >= 0
    score.nll -= float(logq[scored].gather(1, targets[scored, None]).sum())
    score.positions += len(targets)


def run(model_id: str, calibration_chunk_count: int, eval_chunk_count: int, size: int) -> None:
    source = resolve_source(model_id)
    started = time.perf_counter()
    reference = _loaded(load(source, dtype="f32", packed_kernels=False, progress=False))
    tokenizer = reference.tokenizer
    calibration = module_docs(CALIBRATION_MODULES)
    imatrix = compute_imatrix(
        reference.model,
        tokenizer,
        calibration,
        chunk_size=size,
        max_chunks=calibration_chunk_count,
        dataset="stdlib docstrings: " + ", ".join(CALIBRATION_MODULES),
        progress=False,
    )
    chunks = calibration_chunks(tokenizer, module_docs(EVALUATION_MODULES), size, eval_chunk_count)
    variants = {
        "q4": ("q4", None),
        "q4 + imatrix": ("q4", imatrix),
        "q4 + search, uniform importance": ("q4", uniform(imatrix)),
        "q8": ("q8", None),
        "q8 + imatrix": ("q8", imatrix),
    }
    models = {
        name: _loaded(
            load(source, dtype="f32", isq=method, imatrix=m, packed_kernels=False, progress=False)
        ).model
        for name, (method, m) in variants.items()
    }
    base, scores = evaluate(reference.model, models, chunks)
    print(
        f"\n{source.name}: calibration {imatrix.chunk_count} x {size} tokens, evaluation "
        f"{len(chunks)} x {size} tokens ({time.perf_counter() - started:.0f} s)\n"
    )
    print("| weights | KL vs f32 (mean) | top-1 agreement | perplexity |")
    print("|---|---|---|---|")
    print(f"| float32 (reference) | 0 | 100.00% | {math.exp(base.nll / base.positions):.3f} |")
    for name, score in scores.items():
        print(score.row(name))


def _loaded(loaded: LoadedModel) -> LoadedModel:
    loaded.model.use_kernels(kernels.load_ops(loaded.dtype))
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    parser.add_argument("--calibration-chunks", type=int, default=32)
    parser.add_argument("--eval-chunks", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=512)
    args = parser.parse_args()
    for model_id in args.models:
        run(model_id, args.calibration_chunks, args.eval_chunks, args.chunk_size)


if __name__ == "__main__":
    main()
