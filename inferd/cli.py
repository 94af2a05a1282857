"""The ``inferd`` command: serve, mcp, run, pull, models."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inferd.config import (
    DEFAULT_KV_CACHE_MB,
    DEFAULT_MAX_MODEL_LEN,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_RAM_FRACTION,
    EngineConfig,
)
from inferd.gate_cli import add_gate_command
from inferd.ray.args import add_ray_args
from inferd.server.serve_args import add_serve_args
from inferd.serving.args import add_model_set_args
from inferd.store import CATALOG, DEFAULT_MODEL, ModelStore, StoreError
from inferd.tools_cli import add_model_tool_args, add_tool_commands, print_quantized
from inferd.tools_cli import model_id as tool_model_id
from inferd.version import __version__

if TYPE_CHECKING:
    from inferd.server.options import ServerOptions

log = logging.getLogger("inferd")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except (StoreError, ValueError) as exc:
        print(f"inferd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inferd",
        description="A local LLM inference engine with OpenAI-compatible HTTP.",
    )
    p.add_argument("--version", action="version", version=f"inferd {__version__}")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a model over HTTP (OpenAI API)")
    _serve_parser_args(serve)
    serve.set_defaults(func=_serve)
    multi = sub.add_parser(
        "multi-model",
        help="serve the models a --config file lists (mistral.rs's spelling of serve --config)",
    )
    _serve_parser_args(multi)
    multi.set_defaults(func=_multi_model)

    mcp = sub.add_parser(
        "mcp",
        help="serve the models as MCP tools over stdin/stdout, for agents (the serve flags apply)",
    )
    _model_args(mcp)
    add_model_set_args(mcp)
    add_serve_args(mcp)
    mcp.set_defaults(func=_mcp, host="127.0.0.1", port=0, ray=False)  # no listener of its own

    run = sub.add_parser("run", help="chat with a model in the terminal")
    _model_args(run)
    run.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="chat with the default model of this models file (--default-model-id, else its "
        "first chat model) instead of -m",
    )
    run.add_argument("--default-model-id", metavar="ID", default=None)
    run.add_argument("-p", "--prompt", help="answer this one prompt and exit")
    run.add_argument("--max-tokens", type=int, default=512)
    run.add_argument("--temperature", type=float, default=0.7)
    run.set_defaults(func=_run)

    pull = sub.add_parser("pull", help="download a model into the store and verify it")
    pull.add_argument("name", choices=sorted(CATALOG))
    pull.add_argument("--force", action="store_true", help="download again even if present")
    pull.set_defaults(func=_pull)

    models = sub.add_parser("models", help="list the models in the store")
    models.set_defaults(func=_models)

    bench = sub.add_parser("bench", help="measure inferd over HTTP against peers, same workloads")
    _add_bench_args(bench)
    bench.set_defaults(func=_bench)
    for sp in (serve, mcp, run, pull, models, bench):
        sp.add_argument("--log-level", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    add_tool_commands(sub)  # convert, quantize, doctor, tune
    add_gate_command(sub)
    return p


def _serve_parser_args(p: argparse.ArgumentParser) -> None:
    """The flags of `inferd serve` (and of `inferd multi-model`, its other spelling)."""
    _model_args(p)
    p.add_argument(
        "--host", default="127.0.0.1", help="bind address (default: 127.0.0.1, loopback only)"
    )
    p.add_argument("--port", type=int, default=1234, help="TCP port (default: 1234)")
    add_model_set_args(p)
    add_serve_args(p)
    add_ray_args(p)


def _model_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()  # the defaults live there, for the CLI and embedders alike
    p.add_argument(
        "-m",
        "--model",
        default=DEFAULT_MODEL,
        help=f"a .gguf file, a model directory, a store name or a Hugging Face repo id "
        f"(org/name, from the local HF cache) (default: {DEFAULT_MODEL})",
    )
    add_model_tool_args(p)  # --isq, --imatrix, --revision
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        default=None,
        help="the chat template to use (a Jinja file, or a tokenizer_config.json), replacing the "
        "model's own; needed for chat with a model that has none (a base model)",
    )
    p.add_argument(
        "--hf-config-overrides",
        metavar="JSON",
        default=None,
        help="a JSON object merged into a Hugging Face model directory's config.json before "
        "loading (objects merge key by key, other values replace), e.g. "
        """'{"rope_scaling": {"factor": 2.0}}'""",
    )
    p.add_argument(
        "--matformer-config",
        metavar="FILE",
        default=None,
        help="a MatFormer slice table (Gemma 3n's MatFormer-config.csv) to cut the model "
        "with; goes with --matformer-slice",
    )
    p.add_argument(
        "--matformer-slice",
        metavar="NAME",
        default=None,
        help="the row of --matformer-config to serve: a smaller Gemma 3n nested in the "
        "checkpoint (narrower MLPs, some layers skipped)",
    )
    p.add_argument(
        "--mmproj",
        metavar="FILE",
        default=None,
        help="a llama.cpp multimodal projector (mmproj .gguf) for a GGUF language model: the "
        "model then takes images (SmolVLM / Idefics3), or images, video and audio (Gemma 4)",
    )
    p.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="compute dtype (auto: bf16 where the CPU has native bf16, else f32; f16 runs the "
        "plain PyTorch ops, not the fused kernels)",
    )
    p.add_argument(
        "--max-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"most requests running at once (default: {d.max_num_seqs})",
    )
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=d.max_model_len,
        help=f"context length limit: at most the model's trained positions (more only where its "
        f"rope scaling allows) (default: the model's, at most {DEFAULT_MAX_MODEL_LEN}, lowered to "
        f"what the KV cache holds)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        "--max-prefill-chunk-tokens",
        dest="max_num_batched_tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help=f"token budget of one engine step, so the most prompt tokens one prefill chunk "
        f"takes (mistral.rs's name for it: --max-prefill-chunk-tokens) "
        f"(default: {d.max_num_batched_tokens})",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help=f"queued requests beyond which new ones get 503 (default: {d.max_waiting})",
    )
    kv = p.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-tokens", type=int, default=d.kv_cache_tokens, help="KV cache size in tokens"
    )
    kv.add_argument(
        "--kv-cache-mb",
        type=int,
        default=d.kv_cache_mb,
        help=f"KV cache size in MiB (default: one full context, or {DEFAULT_KV_CACHE_MB} MiB if "
        f"that is more, within {KV_RAM_FRACTION:.0%}% of the RAM free after the weights)",
    )
    kv.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=d.kv_memory_fraction,
        metavar="F",
        help="give the KV cache this share (0-0.95) of the RAM free after the weights, however "
        "long the context (mistral.rs's --pa-gpu-mem-usage, for RAM)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=d.kv_cache_dtype,
        help="how the KV cache stores keys and values: auto (the model's dtype), bf16, f32, or "
        "int8 (one scale per token and KV head: ~1.9x the tokens in the same memory, README) "
        f"(default: {d.kv_cache_dtype})",
    )
    p.add_argument(
        "--encoder-cache-mb",
        type=int,
        default=d.encoder_cache_mb,
        help="memory for image encoder outputs kept by image digest, so a repeated image is not "
        f"encoded again (MiB; 0: none; default: {d.encoder_cache_mb})",
    )
    p.add_argument(
        "--max-encoder-tokens-per-step",
        type=int,
        default=d.max_encoder_tokens,
        help="encoder output rows (placeholder tokens of images or clips not in the encoder "
        "cache) one step may compute; larger media run alone (default: the step's token budget)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help=f"tokens per KV block (default: {d.block_size})",
    )
    p.add_argument(
        "--prefix-caching",
        choices=["on", "off"],
        default=None,
        help=f"reuse the KV of shared prompt prefixes (default: {_on_off(d.prefix_caching)}, "
        "unless --prefix-cache-n 0 or --no-kv-cache)",
    )
    p.add_argument(
        "--prefix-cache-n",
        type=int,
        default=d.prefix_cache_n,
        metavar="N",
        help="cached prefixes kept at most: an entry is a chain of cached blocks no request "
        "holds (a prefix several requests share is one), the least recently used forgotten "
        "beyond N; 0: prefix caching off (default: no count, the pool's free blocks keep "
        "prefixes until it reuses them, least recently freed first)",
    )
    p.add_argument(
        "--max-decode-steps-before-prefill",
        type=int,
        default=d.max_decode_steps_before_prefill,
        metavar="N",
        help="with replies decoding, prompt work waits for its step: never right after a step "
        "that ran some, then as soon as it fits one step, else after N steps of decodes alone "
        "(mistral.rs's scheduler rule: smoother decoding, later first tokens) (default: prompt "
        "chunks join every step)",
    )
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        default=d.no_kv_cache,
        help="keep no KV between a request's tokens: each token recomputes the whole sequence "
        "(a slow reference path); prefix caching and speculative decoding are off with it",
    )
    p.add_argument(
        "--packed-kernels",
        choices=["on", "off"],
        default=_on_off(d.packed_kernels),
        help=f"int4/int8 weight kernels for small batches in bf16 "
        f"(default: {_on_off(d.packed_kernels)})",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="default seed for sampling")
    p.add_argument(
        "--disable-eos-stop",
        action="store_true",
        default=d.disable_eos_stop,
        help="the model's end-of-text and end-of-turn tokens stop no reply: every reply runs to "
        "its max_tokens (or a stop string, or a completed output constraint), as if each "
        "request sent ignore_eos (for benchmarks)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        default=d.deterministic,
        help="bit-identical output for a request and seed whatever else runs (batch, chunking, "
        "preemption, prefix hits): batch-invariant kernels, at a speed cost (README)",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram", "draft", "self", "off"],
        default=d.speculative,
        help="speculative decoding: ngram drafts a request's next tokens from its own prompt and "
        "output, draft with --draft-model, self with the model's own first layers; the drafts "
        "are verified in one step, per request where it pays (greedy output is "
        f"unchanged, sampling keeps its distribution) (default: {d.speculative})",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="--speculative draft: a smaller model with the same tokenizer that drafts",
    )
    p.add_argument(
        "--self-spec-layers",
        type=int,
        default=None,
        help="--speculative self: the layers that draft (default: half of the model's)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help=(
            "drafted tokens verified per step at most: a request drafts 3, twice as many "
            "while every draft is accepted, or as many as its lookup matched (default: 31 "
            "for ngram, 7 for draft and self)"
        ),
    )


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.imatrix is not None and getattr(args, "config", None) is not None:
        # A matrix fits one model's tensors; a models file's entries each name their own.
        raise ValueError(
            "--imatrix is one model's importance matrix; with --config, give it on that "
            "model's entry in the models file (imatrix: FILE, beside in_situ_quant)"
        )
    return EngineConfig(
        dtype=args.dtype,
        max_num_seqs=args.max_seqs,
        max_model_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting=args.max_waiting,
        kv_cache_tokens=args.kv_cache_tokens,
        kv_cache_mb=args.kv_cache_mb,
        kv_memory_fraction=args.kv_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        encoder_cache_mb=args.encoder_cache_mb,
        max_encoder_tokens=args.max_encoder_tokens_per_step,
        block_size=args.block_size,
        prefix_caching=_prefix_caching(args),
        prefix_cache_n=args.prefix_cache_n,
        max_decode_steps_before_prefill=args.max_decode_steps_before_prefill,
        no_kv_cache=args.no_kv_cache,
        packed_kernels=args.packed_kernels == "on",
        seed=args.seed,
        isq=args.isq,
        imatrix=args.imatrix,
        deterministic=args.deterministic,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        self_spec_layers=args.self_spec_layers,
        max_loras=getattr(args, "max_loras", EngineConfig().max_loras),  # serve's flag only
        disable_eos_stop=args.disable_eos_stop,
    )


def _prefix_caching(args: argparse.Namespace) -> bool:
    """--prefix-caching as given, else on; an explicit "on" beside a flag that turns it off is
    a contradiction (EngineConfig refuses the others: a count with "off" or --no-kv-cache)."""
    if args.prefix_caching != "on":
        return args.prefix_caching != "off"
    if args.prefix_cache_n == 0:
        raise ValueError("--prefix-caching on contradicts --prefix-cache-n 0 (prefix caching off)")
    if args.no_kv_cache:
        raise ValueError("--prefix-caching on contradicts --no-kv-cache (no KV is kept)")
    return True


def _load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from inferd.serving.loading import load_spec
    from inferd.serving.served import ServedModel
    from inferd.serving.spec import ModelSpec, read_chat_template

    config = getattr(args, "config", None)
    if config is not None:
        spec = _default_spec(config, args.default_model_id)
    else:
        template = read_chat_template(args.chat_template) if args.chat_template else None
        spec = ModelSpec(
            model_id=tool_model_id(args) or DEFAULT_MODEL,
            chat_template=template,
            mmproj=args.mmproj,
            hf_config_overrides=args.hf_config_overrides,
            matformer_config=args.matformer_config,
            matformer_slice=args.matformer_slice,
        )
    model = load_spec(spec, _engine_config(args), progress=True)
    if not isinstance(model, ServedModel):
        model.shutdown()
        raise ValueError(f"{model.id} is an embedding model; `inferd run` needs a chat model")
    return model


def _default_spec(path: str, default_id: str | None):  # type: ignore[no-untyped-def]
    """The models file's model to chat with: ``default_id`` (an API id or a label), else its
    first chat model (mistral.rs's interactive mode takes the default or the first)."""
    from inferd.serving.loading import expected_kind
    from inferd.serving.spec import load_models_file

    specs = load_models_file(path)
    if default_id is not None:
        for spec in specs:
            if default_id in (spec.api_id, spec.label):
                return spec
        ids = ", ".join(s.api_id for s in specs)
        raise ValueError(f"--default-model-id {default_id} is not in {path} (it lists {ids})")
    for spec in specs:
        if expected_kind(spec) == "chat":
            return spec
    raise ValueError(f"{path} lists no chat model; `inferd run` needs one")


def _multi_model(args: argparse.Namespace) -> int:
    """`inferd multi-model --config FILE`: `inferd serve --config FILE` as mistral.rs spells it."""
    if args.config is None:
        raise ValueError("multi-model serves the models of --config FILE; give it")
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from inferd.engine.driver import MainThreadDriver
    from inferd.server.app import build_app
    from inferd.server.serve_args import connection_limits, describe
    from inferd.server.shutdown import UVICORN_GRACE, HttpServer
    from inferd.server.transport import guarded_protocol
    from inferd.serving.startup import registry_from_args

    cfg, options = _serving_plan(args)
    if args.ray:
        if options.mcp_route:
            raise ValueError("--mcp-route is not served under --ray")
        return _serve_on_ray(args, cfg, options)
    limits = connection_limits(args)
    tool_lines = _probe_tools(options)
    engines = MainThreadDriver()  # engines step on this (main) thread; HTTP runs beside it
    # -m loads now; --config in the background
    registry, model_lines = registry_from_args(args, cfg, engines)
    url = f"http://{args.host}:{args.port}/v1"
    lines = [*model_lines, *describe(options), *tool_lines]
    print("\n".join(f"inferd  {line}" for line in lines), flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the API is reachable from other machines", args.host)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not options.api_keys:
        log.warning("no --api-key: anyone who can reach %s can use the API", args.host)
    if options.allowed_hosts is not None and options.allowed_hosts.allows_any:
        log.warning("--allowed-hosts '*': any Host is answered, so DNS-rebinding pages can read")
    app = build_app(registry, options)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=UVICORN_GRACE,  # requests are drained before this starts
        http=guarded_protocol(limits),  # h11 with a head timeout and a connection cap
        h11_max_incomplete_event_size=args.max_header_bytes,  # h11 bounds the head too
    )
    http = HttpServer(config, app.state.drain, args.drain_timeout)
    # uvicorn off the main thread leaves the signals to us: the first drains, a second cuts
    signal.signal(signal.SIGTERM, lambda *_: http.stop())
    signal.signal(signal.SIGINT, lambda *_: http.stop())
    http.start()
    # "listening" once the socket is bound, not before: a port another process holds ends the
    # server with uvicorn's error instead, and whoever waits for the line knows it is ours.
    while http.is_alive() and not http.started:
        time.sleep(0.01)
    if http.started:
        print(f"inferd  listening  {url}", flush=True)
    try:
        engines.run(lambda: not http.is_alive())
    finally:
        http.stop()
        http.join(args.drain_timeout + 30)
        registry.shutdown()
    if http.report is not None:
        print(f"inferd  {http.report.summary()}", flush=True)
    return 0 if http.started else 1


def _serving_plan(args: argparse.Namespace) -> tuple[EngineConfig, ServerOptions]:
    """The engine settings and server options of `inferd serve` or `inferd mcp`; the flags'
    errors come before any model loads."""
    from inferd.server.serve_args import server_options

    cfg = _engine_config(args)
    args.model = tool_model_id(args)  # -m org/name --revision R -> org/name@R
    return cfg, server_options(args, os.environ)


def _mcp(args: argparse.Namespace) -> int:
    """`inferd mcp`: the models, loaded as `inferd serve` loads them, as MCP tools over stdin
    and stdout (server/mcp_server.py). Each tool call runs through the server's app in
    process, with no HTTP listener; stdout carries the protocol alone, so the startup lines,
    the logs and the loading progress go to stderr."""
    import contextlib
    import dataclasses
    import threading

    from inferd.engine.driver import MainThreadDriver
    from inferd.server.app import build_app
    from inferd.server.mcp_server import serve_stdio
    from inferd.serving.startup import registry_from_args

    if args.mcp_route:
        raise ValueError("--mcp-route is for `inferd serve`; `inferd mcp` serves over stdio")
    cfg, options = _serving_plan(args)
    # The client that started this process is the only caller: no key to ask, no Host to check.
    options = dataclasses.replace(options, api_keys=(), allowed_hosts=None, ui=False)
    with contextlib.redirect_stdout(sys.stderr):  # nothing but the protocol on stdout
        tool_lines = _probe_tools(options)
        engines = MainThreadDriver()  # engines step on this (main) thread, MCP beside it
        registry, model_lines = registry_from_args(args, cfg, engines)
    lines = [*model_lines, *tool_lines, "mcp        tools on stdin/stdout"]
    print("\n".join(f"inferd  {line}" for line in lines), file=sys.stderr, flush=True)
    app = build_app(registry, options)
    failed: list[BaseException] = []

    async def session() -> None:
        try:
            await serve_stdio(app)
        finally:
            await app.state.inferd.agent.close()  # the agent's MCP sessions, if any

    def serve() -> None:
        try:
            asyncio.run(session())
        except BaseException as exc:  # reported on the main thread, which ends the process
            failed.append(exc)

    thread = threading.Thread(target=serve, name="inferd-mcp", daemon=True)
    thread.start()
    try:
        engines.run(lambda: not thread.is_alive())  # until the client closes stdin
    finally:
        registry.shutdown()
    if failed:
        log.error("the MCP session failed: %r", failed[0])
        return 1
    return 0


def _probe_tools(options: ServerOptions) -> list[str]:
    """Startup lines naming each server-side tool source and its tools: the sources are
    started (MCP servers launched or reached, their tools listed) and closed again. A source
    that does not start is named with the reason; a bad setting (a missing token variable, two
    tools of one name) stops the startup."""
    from inferd.agent.toolbox import probe
    from inferd.agent.tools import ToolSourceError

    if not options.agent.has_sources:
        return []
    try:
        return [f"tools      {line}" for line in asyncio.run(probe(options.agent))]
    except ToolSourceError as exc:
        raise ValueError(str(exc)) from None


def _serve_on_ray(args: argparse.Namespace, cfg: EngineConfig, options: ServerOptions) -> int:
    """`inferd serve --ray`: one -m model, replicated (see inferd/ray/)."""
    from inferd.ray.deployment import serve_on_ray
    from inferd.serving.spec import ModelSpec, read_chat_template

    if args.config is not None or getattr(args, "lora", None):
        raise ValueError("--ray serves one -m model (no --config, no --lora)")
    template = read_chat_template(args.chat_template) if args.chat_template else None
    spec = ModelSpec(
        model_id=args.model or DEFAULT_MODEL,
        chat_template=template,
        tool_call_parser=getattr(args, "tool_call_parser", None),
        mmproj=args.mmproj,
        hf_config_overrides=args.hf_config_overrides,
        matformer_config=args.matformer_config,
        matformer_slice=args.matformer_slice,
    )
    return serve_on_ray(args, spec, cfg, options)


def _run(args: argparse.Namespace) -> int:
    from inferd.engine.sampling import SamplingParams

    served = _load(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    history: list[dict[str, str]] = []

    async def answer(prompt: str) -> str:
        history.append({"role": "user", "content": prompt})
        ids = served.chat_prompt(history).ids
        parts = []
        async for out in served.engine.generate(ids, params):
            print(out.text, end="", flush=True)
            parts.append(out.text)
        print(flush=True)
        reply = "".join(parts)
        history.append({"role": "assistant", "content": reply})
        return reply

    try:
        if args.prompt is not None:
            asyncio.run(answer(args.prompt))
            return 0
        print(f"chatting with {served.id}; an empty line or Ctrl-D ends", file=sys.stderr)
        while True:
            try:
                line = input(">>> ").strip()
            except EOFError:
                return 0
            if not line:
                return 0
            asyncio.run(answer(line))
    finally:
        served.shutdown()


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    from inferd.bench.main import add_bench_args

    add_bench_args(p)


def _bench(args: argparse.Namespace) -> int:
    from inferd.bench.main import main as bench_main

    return bench_main(args)


def _pull(args: argparse.Namespace) -> int:
    manifest = ModelStore().pull(args.name, force=args.force)
    print(f"{manifest.name}: {manifest.package}=={manifest.version} sha256:{manifest.digest}")
    return 0


def _models(args: argparse.Namespace) -> int:
    store = ModelStore()
    rows = store.list()
    if not rows:
        print(f"no models in {store.home}; try `inferd pull {DEFAULT_MODEL}`")
        return 0
    for m in rows:
        size = sum((store.snapshot_dir(m.name) / rel).stat().st_size for rel in m.files)
        print(
            f"{m.name:<10} {m.package}=={m.version:<8} {size / 2**20:8.1f} MiB  "
            f"sha256:{m.digest[:16]}…"
        )
    print_quantized(store.home)  # what `inferd quantize` stored
    return 0
