"""What a tool round of the agent loop adds over the model's own time (issue 34).

``inferd serve`` runs the default model with a real MCP server over stdio (the test suite's,
tests/agent/mcp_servers.py: ``lookup`` answers a capital) and answers ``--requests``
sequential chat requests that force one ``lookup`` call (``max_tool_rounds`` 1, greedy): a
tool round, then the answer. The server logs where each loop's time went (server/agent_loop.py:
the model's rounds, the tool calls, the total); this script reads those lines and prints the
medians, and the added latency per tool round: total minus the model's time, per round (the
tool call itself, and assembling the next round).

    python benchmarks/agent_loop.py --requests 10
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from inferd.bench.process import serve_subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "agent" / "mcp_servers.py"
LINE = re.compile(
    r"agent loop: (\d+) tool round\(s\), \d+ call\(s\); model ([\d.]+) s, tools ([\d.]+) s, "
    r"total ([\d.]+) s"
)
ASK = {
    "messages": [{"role": "user", "content": "What is the capital of Peru?"}],
    "tool_choice": {"type": "function", "function": {"name": "lookup"}},
    "temperature": 0,
    "max_tool_rounds": 1,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "mcp.json"
        server = {"command": sys.executable, "args": [str(SCRIPT), "stdio"], "permission": "allow"}
        config.write_text(json.dumps({"mcpServers": {"calc": server}}))
        log = Path(folder) / "serve.log"
        walls = []
        with serve_subprocess(["--mcp-config", str(config)], log) as (url, _):
            for _ in range(args.requests + 1):  # the first starts the MCP session: not counted
                started = time.perf_counter()
                reply = httpx.post(f"{url}/v1/chat/completions", json=ASK, timeout=300)
                reply.raise_for_status()
                walls.append(time.perf_counter() - started)
        loops = [tuple(map(float, m.groups())) for m in LINE.finditer(log.read_text())][1:]
    walls = walls[1:]
    if len(loops) != len(walls):
        raise SystemExit(f"{len(walls)} requests but {len(loops)} loop lines in the log")
    rounds = statistics.median(r for r, *_ in loops)
    model = statistics.median(m for _, m, _, _ in loops)
    tools = statistics.median(t for _, _, t, _ in loops)
    total = statistics.median(t for *_, t in loops)
    added = statistics.median((t - m) / r for r, m, _, t in loops)
    print(f"{len(loops)} requests, {rounds:g} tool round(s) each (medians)")
    print(f"  client wall      {statistics.median(walls) * 1000:8.1f} ms")
    print(f"  loop total       {total * 1000:8.1f} ms")
    print(f"  model (2 rounds) {model * 1000:8.1f} ms")
    print(f"  tool calls       {tools * 1000:8.1f} ms")
    print(f"  added per round  {added * 1000:8.1f} ms  (total - model, per tool round)")


if __name__ == "__main__":
    main()
