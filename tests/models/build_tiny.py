"""``python -m tests.models.build_tiny DIR``: the tiny random multimodal checkpoints, saved as
transformers saves real ones, for the contract's live example (``python -m
inferd.contract.example --live``), which shells out to this from a source checkout (inferd/
never imports tests/): ``DIR/smolvlm2`` (images and video) and ``DIR/qwen2-audio`` (audio).
Needs the test extra (transformers). Prints the two directories, one per line."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.models.tiny_audio import save_tiny_qwen2_audio
from tests.models.tiny_vlm import save_tiny_smolvlm

VISION = "smolvlm2"
AUDIO = "qwen2-audio"


def build(root: Path) -> tuple[Path, Path]:
    vision, audio = root / VISION, root / AUDIO
    for directory in (vision, audio):
        directory.mkdir(parents=True, exist_ok=True)
    save_tiny_smolvlm(vision)
    save_tiny_qwen2_audio(audio)
    return vision, audio


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.models.build_tiny DIR", file=sys.stderr)
        return 2
    for directory in build(Path(argv[0])):
        print(directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
