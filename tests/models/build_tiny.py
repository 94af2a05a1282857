"""``python -m tests.models.build_tiny DIR``: the tiny random multimodal checkpoints, saved as
transformers saves real ones, for the contract's live example (``python -m
inferd.contract.example --live``), which shells out to this from a source checkout (inferd/
never imports tests/): ``DIR/gemma4`` (images, audio and video), ``DIR/smolvlm2`` (images and
video) and ``DIR/qwen2-audio`` (audio). Needs the test extra (transformers). Prints the
directories, one per line."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.models.tiny_audio import save_tiny_qwen2_audio
from tests.models.tiny_gemma4 import save_tiny_gemma4
from tests.models.tiny_vlm import save_tiny_smolvlm

GEMMA4 = "gemma4"
VISION = "smolvlm2"
AUDIO = "qwen2-audio"


def build(root: Path) -> tuple[Path, Path, Path]:
    gemma4, vision, audio = root / GEMMA4, root / VISION, root / AUDIO
    for directory in (gemma4, vision, audio):
        directory.mkdir(parents=True, exist_ok=True)
    save_tiny_gemma4(gemma4)
    save_tiny_smolvlm(vision)
    save_tiny_qwen2_audio(audio)
    return gemma4, vision, audio


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.models.build_tiny DIR", file=sys.stderr)
        return 2
    for directory in build(Path(argv[0])):
        print(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
