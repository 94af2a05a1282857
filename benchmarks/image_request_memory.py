"""What requests with huge images cost the server: CPU time and memory, measured from /proc.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/image_request_memory.py [SERVE FLAGS...]

Serves the tests' tiny Idefics3 (SmolVLM) model and sends eight 6000x6000 PNGs in one chat
request (about 1.3 MB of body), then three such requests at once. Each is more prompt tokens
than the model's context with ``--max-seq-len 256`` (by default its 288 M pixels are over
``--max-decoded-pixels`` first); the old code decoded all of them before refusing. Prints,
for each step, the server's CPU time, its peak RSS (VmHWM), its RSS once the replies are in,
and each reply's status and error code.
"""

from __future__ import annotations

import base64
import io
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from PIL import Image

from inferd.bench.process import serve_subprocess
from tests.models.tiny_vlm import save_tiny_idefics3


def _proc(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, peak RSS, RSS) of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    kb = lambda key: int(status[key].split()[0]) * 1024  # noqa: E731
    return ticks / 100, kb("VmHWM"), kb("VmRSS")


def _body(model: str) -> dict[str, object]:
    buffer = io.BytesIO()
    # a photo-like gradient (a flat color would compress to nothing)
    Image.linear_gradient("L").resize((6000, 6000)).convert("RGB").save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [{"type": "text", "text": "Look:"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for _ in range(8)]
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 1}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_idefics3(Path(tmp) / "vlm")
        args = ["-m", str(Path(tmp) / "vlm"), "--dtype", "f32", "--access-log-format", "off"]
        args += sys.argv[1:]
        with serve_subprocess(args, Path(tmp) / "serve.log") as (url, proc):
            model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            body = _body(model)
            _, peak, rss = _proc(proc.pid)
            print(f"idle: peak RSS {peak / 2**30:.2f} GiB, RSS {rss / 2**30:.2f} GiB")
            print(f"body: {len(httpx.Request('POST', url, json=body).content) / 1e6:.2f} MB")
            for n in (1, 3):
                cpu0, _, _ = _proc(proc.pid)
                start = time.monotonic()
                with ThreadPoolExecutor(n) as pool:
                    replies = list(
                        pool.map(
                            lambda _: httpx.post(
                                url + "/v1/chat/completions", json=body, timeout=600
                            ),
                            range(n),
                        )
                    )
                wall = time.monotonic() - start
                time.sleep(1)
                cpu1, peak, rss = _proc(proc.pid)
                codes = [(r.status_code, r.json().get("error", {}).get("code")) for r in replies]
                print(
                    f"{n} request(s) at once: {codes}; server CPU {cpu1 - cpu0:.2f} s, "
                    f"wall {wall:.2f} s, peak RSS {peak / 2**30:.2f} GiB, "
                    f"RSS after {rss / 2**30:.2f} GiB"
                )


if __name__ == "__main__":
    main()
