"""The worked example run for real: ``python -m inferd.contract.example --live``.

``inferd serve --config`` on a bundle of tiny random models, launched by the supervisor. The
scenario the seed writes: **one model** (a tiny Gemma 4, which reads images, audio and video)
gets the PNG, the WAV and the MP4 with the text in one request. The second scenario routes the
same evidence by modality instead, over two models: a tiny SmolVLM2 answers the PNG and the MP4
in one request, a tiny Qwen2-Audio the WAV in another. Each request is a strict stream read to a
``Complete`` outcome whose usage counts the media's tokens. The checkpoints and the config form
one digest-addressed bundle; the supervisor checks every route's readiness, and the evidence is
staged by digest and sent as file:// URLs under the store's published root
(``--allowed-media-root``).

The checkpoints have random weights, so the replies mean nothing: the run proves the protocol
and that each piece of media reaches its model (the media's tokens in the usage; see
``tests/contract/test_example_live.py``: changing any one changes the prompt's token count).
So that a reply ends with ``stop`` rather than at its token cap, the bundle's generation
configs name every token an end token: each reply is one token. They are built by the
repository's test builders (``python -m tests.models.build_tiny DIR``, transformers needed),
which ``build_tiny`` shells out to from a source checkout: inferd/ never imports tests/.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import httpx

import inferd
from inferd.contract.bundle import artifact_sha256, publish_bundle, tree_files
from inferd.contract.client import open_chat_stream
from inferd.contract.fixtures import tiny_png, tiny_wav
from inferd.contract.plan import (
    AccessLog,
    Device,
    EngineKind,
    EngineRelease,
    LaunchPlan,
    Limits,
    ModelFormat,
    ModelSource,
    PagedAttention,
    Toggle,
)
from inferd.contract.request import MediaPart, Part, RequestBounds, TextPart, build_chat_request
from inferd.contract.staging import EvidenceStore, Lease, Modality
from inferd.contract.stream import Finished, Outcome, StreamLimits, outcome_text
from inferd.contract.supervisor import Executable, Supervisor, probe_readiness

ONE_MODEL_ROUTE = "gemma4"  # the tiny Gemma 4: the PNG, the WAV and the MP4 together
VISION_ROUTE = "vision"  # the tiny SmolVLM2: the PNG and the MP4
AUDIO_ROUTE = "audio"  # the tiny Qwen2-Audio: the WAV
# each route's folder as build_tiny writes it
CHECKPOINTS = {ONE_MODEL_ROUTE: "gemma4", VISION_ROUTE: "smolvlm2", AUDIO_ROUTE: "qwen2-audio"}
CONFIG = "models.json"
TENANT = "tenant-a"
PROMPT = "Explain the same cancellation event across all evidence."
NOTE = (
    "three tiny random models in one `inferd serve --config`: the PNG, the WAV and the MP4 go "
    "with the text to one model (Gemma 4) in one request; then, routed by modality, the image "
    "and the video to SmolVLM2 and the audio to Qwen2-Audio. Each is a strict stream to "
    "Complete. The text means nothing; the usage counts the media."
)
LIVE_BOUNDS = RequestBounds(
    max_prompt_bytes=4096,
    max_media_parts=4,
    max_media_bytes=4 << 20,
    max_output_tokens=16,
    max_json_bytes=4096,
    modalities=frozenset(Modality),
)


class LiveError(RuntimeError):
    """The live example cannot run here (the message says why)."""


@dataclass(frozen=True)
class Evidence:
    """The three pieces of the worked example, as real, decodable files."""

    png: bytes
    wav: bytes
    mp4: bytes


def evidence(
    image: tuple[int, int] = (40, 30), audio_ms: int = 800, video_frames: int = 8
) -> Evidence:
    """A PNG of ``image`` (width, height), a 16 kHz WAV of ``audio_ms``, an MP4 at 4 fps."""
    return Evidence(tiny_png(*image), tiny_wav(16000, audio_ms), tiny_video(video_frames))


def tiny_video(frames: int, fps: int = 4, size: tuple[int, int] = (32, 24)) -> bytes:
    """An H.264 MP4 of a moving gradient (PyAV, the media decoder's own library)."""
    import av
    import numpy as np

    width, height = size
    ramp = (np.arange(width * height * 3, dtype=np.int64).reshape(height, width, 3) * 7) % 256
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            picture = ((ramp + 16 * i) % 256).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def build_tiny(directory: Path) -> Path:
    """Build the tiny checkpoints in ``directory`` with the repository's test builders (a
    subprocess from the source checkout; needs the test extra). Returns ``directory``."""
    checkout = Path(inferd.__file__).resolve().parent.parent
    if not (checkout / "tests" / "models" / "build_tiny.py").is_file():
        raise LiveError(
            f"{checkout} is not a source checkout: build the tiny checkpoints there with "
            "`python -m tests.models.build_tiny DIR` and pass --checkpoints DIR"
        )
    command = [sys.executable, "-m", "tests.models.build_tiny", str(directory)]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LiveError(f"building the tiny checkpoints failed:\n{done.stderr[-2000:]}")
    return directory


def publish_models(checkpoints: Path, root: Path, scratch: Path) -> Path:
    """The bundle: both checkpoints, the config naming them, and generation configs that end
    every reply after one token (random weights never choose to stop)."""
    files: dict[str, Path] = {}
    config: dict[str, Any] = {}
    for route, folder in CHECKPOINTS.items():
        source = checkpoints / folder
        if not (source / "config.json").is_file():
            raise LiveError(f"{source} holds no checkpoint; build it with --build-tiny")
        files.update(tree_files(source, f"{folder}/"))
        stops = scratch / f"{folder}-generation_config.json"
        stops.write_text(json.dumps({"eos_token_id": list(range(_vocab_size(source)))}))
        files[f"{folder}/generation_config.json"] = stops
        # relative to the bundle, where the server runs (its working directory), so the
        # config's bytes, and the bundle's digest, do not depend on where it is published
        config[route] = {"Plain": {"model_id": f"./{folder}"}, "alias": route}
    (scratch / CONFIG).write_text(json.dumps(config, indent=2))
    files[CONFIG] = scratch / CONFIG
    return publish_bundle(files, root)


def _vocab_size(checkpoint: Path) -> int:
    hf = json.loads((checkpoint / "config.json").read_text())
    return int((hf.get("text_config") or hf)["vocab_size"])


def live_plan(bundle: Path, artifact: str, port: int, media_root: str, route: str) -> LaunchPlan:
    return LaunchPlan(
        engine=EngineRelease(EngineKind.INFERD, inferd.__version__, artifact, Device.CPU),
        model=ModelSource(
            public_id="inferd/tiny-gemma4-smolvlm2-qwen2-audio",
            revision="sha256:" + bundle.name,
            bundle_sha256=bundle.name,
            local_dir=str(bundle),
            format=ModelFormat.CONFIG,
            entry=CONFIG,
            route=route,
        ),
        host="127.0.0.1",
        port=port,
        limits=Limits(
            max_seqs=4,
            max_seq_len=512,  # the tiny checkpoints' positions
            paged_attention=PagedAttention.ON,
            prefix_cache_n=None,
            max_num_images=4,
            max_image_edge=0,
            device=Device.CPU,
            max_num_batched_tokens=512,
            kv_cache_tokens=8192,
            dtype="f32",
            seed=7,
            prefix_caching=Toggle.ON,
        ),
        access_log=AccessLog.JSON,
        media_root=media_root,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Answer:
    route: str
    part_types: tuple[str, ...]
    outcome: str
    text: str
    usage: dict[str, int] | None


class LiveScenario:
    """``inferd serve`` on the bundle under the supervisor, and the evidence store beside it:
    ``ask`` stages evidence, sends it with the prompt to one route and reads the stream."""

    def __init__(self, work: Path, checkpoints: Path) -> None:
        scratch = work / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        self.bundle = publish_models(checkpoints, work / "models", scratch)
        exe = replace(Executable.inferd_module(), cwd=self.bundle)
        self.store = EvidenceStore(work / "evidence")
        port, artifact = free_port(), artifact_sha256(exe.artifact)
        self.plans = {
            route: live_plan(self.bundle, artifact, port, self.store.published_root, route)
            for route in CHECKPOINTS
        }
        self.supervisor = Supervisor(self.plans[ONE_MODEL_ROUTE], exe, log_path=work / "serve.log")
        self.client = httpx.Client(trust_env=False, timeout=30)
        self.startup_s = 0.0
        self._asked = 0

    def __enter__(self) -> LiveScenario:
        try:
            self.startup_s = self.supervisor.start().startup_s
            for route in (VISION_ROUTE, AUDIO_ROUTE):
                _wait_route(self.client, self.plans[route], self.supervisor)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.supervisor.stop(drain_timeout_s=5.0, term_timeout_s=10.0)
        self.supervisor.__exit__(None, None, None)
        self.client.close()

    def ask(self, route: str, items: list[tuple[bytes, str]]) -> Answer:
        """Stage each (bytes, locator), then send them in order with the prompt to ``route``."""
        self._asked += 1
        rid = f"req-live-{route}-{self._asked}"
        ids = []
        for n, (data, locator) in enumerate(items):
            evidence_id = f"ev-{self._asked}-{n}"
            self.store.stage(TENANT, evidence_id, data, locator=locator)
            ids.append(evidence_id)
        return _ask(self.client, self.store, self.plans[route], rid, ids)


def run_live(work: Path, checkpoints: Path, media: Evidence | None = None) -> dict[str, Any]:
    """Launch, send the worked example's parts to one model, then by modality to two; the
    report as JSON data."""
    media = media or evidence()
    png = (media.png, "evidence://case-17/camera-2/frame-0412.png")
    wav = (media.wav, "evidence://case-17/radio/clip-0007.wav")
    mp4 = (media.mp4, "evidence://case-17/camera-2/segment-0003.mp4")
    with LiveScenario(work, checkpoints) as live:
        one = live.ask(ONE_MODEL_ROUTE, [png, wav, mp4])
        two = [live.ask(VISION_ROUTE, [png, mp4]), live.ask(AUDIO_ROUTE, [wav])]
        stopped = live.supervisor.stop()
        launch = {
            "argv": list(live.plans[ONE_MODEL_ROUTE].launch_args()),
            "routes": list(live.plans),
            "bundle_sha256": live.bundle.name,
            "startup_s": round(live.startup_s, 2),
            "stopped": str(stopped.method),
        }
    return {
        "note": NOTE,
        "launch": launch,
        "one_model": asdict(one),
        "two_models": [asdict(a) for a in two],
        "success": all(a.outcome == "complete" for a in (one, *two)),
    }


def _wait_route(client: httpx.Client, plan: LaunchPlan, supervisor: Supervisor) -> None:
    """The config's second model loads beside the first: wait for its exact route too."""
    deadline = time.monotonic() + supervisor.startup_timeout_s
    while not probe_readiness(client, plan.base_url, plan.model_route).ready:
        if time.monotonic() > deadline or not supervisor.alive():
            raise LiveError(f"{plan.model_route} never became ready:\n{supervisor.log_tail()}")
        time.sleep(0.25)


def _ask(
    client: httpx.Client, store: EvidenceStore, plan: LaunchPlan, rid: str, ids: list[str]
) -> Answer:
    leases: list[Lease] = [store.lease(TENANT, rid, evidence_id) for evidence_id in ids]
    parts: tuple[Part, ...] = (*(MediaPart(lease) for lease in leases), TextPart(PROMPT))
    request = build_chat_request(
        plan,
        request_id=rid,
        tenant=TENANT,
        parts=parts,
        max_tokens=8,
        temperature=0.0,
        seed=7,
        bounds=LIVE_BOUNDS,
        store=store,
    )
    try:
        with open_chat_stream(client, plan.base_url, request, StreamLimits()) as stream:
            outcome = stream.run()
    finally:
        for lease in leases:
            store.release(lease)
    body = json.loads(request.body)
    kinds = tuple(p["type"] for p in body["messages"][0]["content"])
    return Answer(
        plan.model_route, kinds, str(outcome.kind), outcome_text(outcome), _usage(outcome)
    )


def _usage(outcome: Outcome) -> dict[str, int] | None:
    if isinstance(outcome, Finished) and outcome.usage is not None:
        return asdict(outcome.usage)
    return None


def main(build: Path | None, checkpoints: Path | None) -> int:
    """``--live``: build the checkpoints into ``build`` (or use ``checkpoints``), run, report."""
    with tempfile.TemporaryDirectory(prefix="inferd-contract-live-") as tmp:
        work = Path(tmp)
        if checkpoints is None:
            checkpoints = build_tiny(build or work / "tiny")
        report = run_live(work, checkpoints)
    json.dump(report, sys.stdout, indent=2, sort_keys=True, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0 if report["success"] else 1
