"""`inferd serve`'s model flags: one model (`-m`) or several (`--config models.json|toml`), and
the registry (plus the startup lines describing it) they make.

With `-m` the model loads before the server listens (a failure ends the command). With
`--config` the file is checked first (every problem reported, nothing loaded), then the server
listens at once while the models load one after another in the background: `/health` answers
from the start, `/ready` once every model is loaded, and a model that fails shows status
"error" with the reason while the others serve.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from inferd.config import EngineConfig
from inferd.engine.driver import EngineLoop
from inferd.engine.embedding import EmbeddingModel
from inferd.loading.lora import DEFAULT_MAX_LORA_RANK
from inferd.models.idefics3_image import Idefics3ImageConfig
from inferd.serving.loading import Servable, expected_kind, load_spec
from inferd.serving.lora import adapter_slot, parse_lora_flags, serve_adapters
from inferd.serving.prompter import Gemma4ModelPrompter, GridModelPrompter, ImageModelPrompter
from inferd.serving.registry import ModelRegistry, ModelSlot
from inferd.serving.served import ServedModel
from inferd.serving.spec import ModelSpec, load_models_file, read_chat_template
from inferd.store import DEFAULT_MODEL


def registry_from_args(
    args: argparse.Namespace, cfg: EngineConfig, loop: EngineLoop
) -> tuple[ModelRegistry, list[str]]:
    """The registry to serve, and startup lines about it. ValueError for bad flags or files.
    ``loop`` steps every model's engine, reloaded ones included."""
    if args.drain_timeout < 0:
        raise ValueError("--drain-timeout must not be negative")
    policy = {"auto_reload": args.auto_reload == "on", "drain_timeout": args.drain_timeout}
    template_flag = getattr(args, "chat_template", None)
    if args.config is None:
        template = read_chat_template(template_flag) if template_flag is not None else None
        spec = ModelSpec(
            model_id=args.model or DEFAULT_MODEL,
            chat_template=template,
            tool_call_parser=getattr(args, "tool_call_parser", None),
            mmproj=getattr(args, "mmproj", None),
            hf_config_overrides=getattr(args, "hf_config_overrides", None),
            matformer_config=getattr(args, "matformer_config", None),
            matformer_slice=getattr(args, "matformer_slice", None),
        )
        model = load_spec(spec, cfg, progress=True, loop=loop)
        try:
            adapters = _adapters(model, args)
        except ValueError:
            model.shutdown()  # the command ends: nothing stays half-served
            raise
        slot = ModelSlot.of_loaded(model)
        max_rank = getattr(args, "max_lora_rank", DEFAULT_MAX_LORA_RANK)
        slot.load_fn = functools.partial(_load_base, spec, cfg, loop, max_rank)
        flags = dict(parse_lora_flags(getattr(args, "lora", None) or []))
        slots = [slot, *(adapter_slot(slot, a.id, flags[a.id], max_rank, a) for a in adapters)]
        default = args.default_model_id or (model.id if adapters else None)
        registry = ModelRegistry(slots, default_id=default, **policy)
        lines = [f"lora       {a.id}  (on {model.id})" for a in adapters]
        if adapters:
            lines.append(f"lora       at most {cfg.max_loras} attached at once (--max-loras)")
        return registry, [
            *_describe_model(model, cfg),
            *_describe_projector(model, spec),
            *_describe_matformer(model, spec),
            *lines,
        ]
    if args.model is not None:
        raise ValueError("give -m or --config, not both")
    if getattr(args, "mmproj", None) is not None:
        raise ValueError("--mmproj goes with -m; in a --config file, use mmproj")
    if getattr(args, "lora", None):
        raise ValueError("--lora goes with -m; in a --config file, use lora")
    if getattr(args, "matformer_config", None) or getattr(args, "matformer_slice", None):
        raise ValueError(
            "--matformer-config and --matformer-slice go with -m; in a --config file, use "
            "matformer_config_path and matformer_slice_name"
        )
    if template_flag is not None:
        raise ValueError("--chat-template goes with -m; in a --config file, use chat_template")
    if getattr(args, "tool_call_parser", None) is not None:
        raise ValueError(
            "--tool-call-parser goes with -m; in a --config file, use tool_call_parser"
        )
    specs = load_models_file(args.config)
    max_rank = getattr(args, "max_lora_rank", DEFAULT_MAX_LORA_RANK)
    slots, lines = [], []
    for spec in specs:
        load = functools.partial(_load_base, spec, cfg, loop, max_rank)
        base = ModelSlot(spec.api_id, expected_kind(spec), load, label=spec.label)
        slots.append(base)
        lines.append(
            f"model      {base.id}  ({base.kind}, label {spec.label}) loading in the background"
        )
        # Each adapter's slot loads after its base's (the loader runs loads in order) and
        # registers it on the base's engine.
        for name, path in spec.lora:
            slots.append(adapter_slot(base, name, Path(path), max_rank))
            lines.append(f"lora       {name}  (on {base.id})")
    if any(spec.lora for spec in specs):
        lines.append(f"lora       at most {cfg.max_loras} attached at once per model (--max-loras)")
    registry = ModelRegistry(slots, default_id=args.default_model_id, multi=True, **policy)
    registry.load_all()
    return registry, [*lines, f"default    {registry.default_id}"]


def _load_base(spec: ModelSpec, cfg: EngineConfig, loop: EngineLoop, max_rank: int) -> Servable:
    model = load_spec(spec, cfg, loop=loop)
    if isinstance(model, ServedModel):
        model.max_lora_rank = max_rank  # for /v1/load_lora_adapter
    return model


def _adapters(model: Servable, args: argparse.Namespace) -> list[ServedModel]:
    """The --lora adapters on the -m model, attached (ValueError naming a bad one)."""
    flags = parse_lora_flags(getattr(args, "lora", None) or [])
    max_rank = getattr(args, "max_lora_rank", DEFAULT_MAX_LORA_RANK)
    if isinstance(model, ServedModel):
        model.max_lora_rank = max_rank  # for /v1/load_lora_adapter
    if not flags:
        return []
    if not isinstance(model, ServedModel):
        raise ValueError("--lora: an embedding model takes no LoRA adapters")
    return serve_adapters(model, flags, max_rank)


def _describe_matformer(model: Servable, spec: ModelSpec) -> list[str]:
    """Gemma 3n: the MatFormer slice served, and which of its media encoders are."""
    if not isinstance(model, ServedModel) or model.config.gemma3n is None:
        return []
    g = model.config.gemma3n
    lines = []
    if spec.matformer_slice is not None:
        kept = set(g.source_layers)
        skipped = [i for i in range(g.source_num_layers) if i not in kept]
        widths = sorted(set(g.intermediate_sizes))
        lines.append(
            f"matformer  slice {spec.matformer_slice!r} of {spec.matformer_config}: "
            f"{len(kept)} of {g.source_num_layers} layers"
            f"{' (skipped ' + ', '.join(map(str, skipped)) + ')' if skipped else ''}, "
            f"MLP widths {', '.join(map(str, widths))}"
        )
    served = [m for m in model.modalities["input"] if m != "text"]
    if g.unserved_media:
        lines.append(
            f"media      gemma3n serves {' and '.join(served) or 'no media (text only)'}; its "
            f"{' and '.join(g.unserved_media)} encoder is not served (no MobileNet-v5 in the "
            f"checkpoint): {' and '.join(g.unserved_media)} input is refused"
        )
    elif served:
        encoders = {"image": "image (MobileNet-v5)", "audio": "audio (USM conformer)"}
        lines.append(
            f"media      gemma3n serves {' and '.join(served)}: its "
            f"{' and '.join(encoders[m] for m in served)} encoder{'s' * (len(served) > 1)}"
        )
    return lines


def _describe_projector(model: Servable, spec: ModelSpec) -> list[str]:
    """The projector line: which file gave the encoders, and how they take media."""
    if spec.mmproj is None or not isinstance(model, ServedModel):
        return []
    if isinstance(model.prompter, Gemma4ModelPrompter):
        return [f"projector  {spec.mmproj}  (gemma4: {_gemma4_encoders(model.prompter)})"]
    if isinstance(model.prompter, GridModelPrompter):
        return [f"projector  {spec.mmproj}  (qwen3vl: {_qwen3vl_encoder(model)})"]
    if not isinstance(model.prompter, ImageModelPrompter):
        return []
    vision, images = model.config.vision, model.prompter.images.config
    assert vision is not None and isinstance(images, Idefics3ImageConfig)
    split = f"long side {images.longest_edge} px, split" if images.splitting else "not split"
    return [
        f"projector  {spec.mmproj}  (idefics3: image encoder {vision.num_layers} layers, "
        f"hidden {vision.hidden_size}; {images.tile} px tiles of {images.image_seq_len} "
        f"tokens, images {split})"
    ]


def _qwen3vl_encoder(model: ServedModel) -> str:
    """A Qwen3-VL projector's encoder, and the pixel bounds its images and videos take."""
    vision = model.config.qwen_vision
    assert vision is not None and isinstance(model.prompter, GridModelPrompter)
    grid, merge = model.prompter.grid, vision.spatial_merge_size
    images, video = grid.image_config, grid.qwen3_video
    deep = ", ".join(map(str, vision.deepstack_indexes)) or "none"
    line = (
        f"image encoder {vision.num_layers} layers, hidden {vision.hidden_size}, deep stack "
        f"from blocks {deep}; {vision.patch_size} px patches merged {merge}x{merge}; images of "
        f"{images.min_pixels} to {images.max_pixels} px"
    )
    if video is not None:
        line += (
            f", videos of {video.visual.min_pixels} to {video.visual.max_pixels} px over their "
            f"frames at {video.fps:g} fps"
        )
    return line


def _gemma4_encoders(prompter: Gemma4ModelPrompter) -> str:
    """What each of a Gemma 4 projector's encoders takes."""
    processing = prompter.media.processing
    parts = []
    if processing.image is not None:
        image = processing.image
        parts.append(
            f"images of up to {image.max_soft_tokens} tokens ({image.patch_size} px patches "
            f"pooled {image.pooling}x{image.pooling})"
        )
    if processing.video is not None:
        video = processing.video
        parts.append(
            f"videos of {video.num_frames} frames of up to {video.frames.max_soft_tokens} tokens"
        )
    if processing.audio is not None:
        parts.append(f"audio as {processing.audio.feature_size} mel bins")
    return "; ".join(parts)


def _describe_model(model: Servable, cfg: EngineConfig) -> list[str]:
    dtype = str(model.dtype).removeprefix("torch.")
    isq = getattr(model, "isq", None)
    dtype += f", isq {isq}" if isq else ""
    import torch  # here, not at module level: `inferd --help` must not wait for torch

    from inferd.kernels import load_ops

    compute = f"compute    cpu  dtype {dtype}  threads {torch.get_num_threads()}"
    head = [
        f"model      {model.id}  ({model.source.path})",
        f"digest     sha256:{model.source.digest}",
    ]
    if isinstance(model, EmbeddingModel):
        b = model.config
        pooling = "+".join(m.removesuffix("_tokens") for m in model.pooling.modes)
        return [
            *head,
            f"arch       bert encoder  {b.num_layers} layers, hidden {b.hidden_size}, "
            f"{b.num_heads} heads, vocab {b.vocab_size}",
            f"embedding  {model.dimensions} dims, {pooling} pooling"
            f"{', normalized' if model.pooling.normalize else ''}",
            compute,
            f"engine     {model.max_model_len} tokens per input",
        ]
    assert isinstance(model, ServedModel)
    c = model.config
    sizing = (
        model.sizing.reason
        if model.sizing is not None
        else f"context {model.engine.max_model_len}; KV cache {model.kv_cache_tokens} tokens"
    )
    return [
        *head,
        f"arch       {c.architecture}  {c.num_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_heads} heads / {c.num_kv_heads} kv heads, vocab {c.vocab_size}",
        *_describe_experts(model),
        compute,
        f"kernels    {load_ops(model.dtype).description}"
        f"{'  deterministic (batch-invariant)' if cfg.deterministic else ''}",
        # One line for the engine's limits (the server's own are the "limits" line): the
        # context, the pool and why, lowered context included.
        f"engine     max seqs {model.engine_config.max_num_seqs}, batch tokens "
        f"{cfg.max_num_batched_tokens}, {sizing}"
        f"{'  eos stops nothing (--disable-eos-stop)' if cfg.disable_eos_stop else ''}"
        f"{_describe_cache_options(cfg)}",
        _describe_memory(model),
    ]


def _describe_experts(model: ServedModel) -> list[str]:
    """The mixture of experts, if the model has one, and how its experts' projections are held
    (as every other projection's: quantized under --isq)."""
    moe = model.config.moe
    if moe is None:
        return []
    held = f" quantized {model.isq} (--isq)" if model.isq else ""
    return [
        f"experts    {moe.top_k} of {moe.num_experts} a token ({moe.intermediate_size} wide) "
        f"in {len(moe.layers)} of {model.config.num_layers} layers, "
        f"{2 * moe.num_experts * len(moe.layers)} expert projections{held}"
    ]


def _describe_cache_options(cfg: EngineConfig) -> str:
    """The engine line's note on --no-kv-cache, --prefix-cache-n and
    --max-decode-steps-before-prefill, when set."""
    notes = []
    if cfg.no_kv_cache:
        notes.append(
            "no KV cache (--no-kv-cache): every token recomputes its whole sequence; "
            "prefix caching and speculative decoding off"
        )
    elif cfg.prefix_cache_n == 0:
        notes.append("prefix caching off (--prefix-cache-n 0)")
    elif cfg.prefix_cache_n is not None:
        notes.append(f"prefix cache keeps {cfg.prefix_cache_n} entries")
    if cfg.max_decode_steps_before_prefill is not None:
        notes.append(f"prompts wait at most {cfg.max_decode_steps_before_prefill} decode steps")
    return "".join(f"  {note}" for note in notes)


def _describe_memory(model: ServedModel) -> str:
    """The memory budget: the weights as loaded (against a GGUF file's size) and the KV pool;
    activations and the runtime come on top."""
    weights = model.weight_bytes
    path = model.source.path
    of_file = f" ({weights / path.stat().st_size:.2f}x the file)" if path.is_file() else ""
    pool = model.sizing.pool_bytes if model.sizing is not None else 0
    return (
        f"memory     budget {_mib(weights + pool)}: weights {_mib(weights)}{of_file} + KV cache "
        f"{_mib(pool)}, activations and runtime on top"
    )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f} MiB"
