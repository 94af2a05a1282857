"""Flags for serving several models; no heavy imports, so `inferd --help` stays quick."""

from __future__ import annotations

import argparse

DEFAULT_DRAIN_TIMEOUT = 30.0


def add_model_set_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several models")
    g.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="serve the models listed in FILE (JSON, or TOML when it ends in .toml) instead of -m",
    )
    g.add_argument(
        "--default-model-id",
        metavar="ID",
        default=None,
        help="the model that answers model 'default' or none (default: the first to load)",
    )
    g.add_argument(
        "--auto-reload",
        choices=["on", "off"],
        default="on",
        help="load an unloaded model when a request names it; off: 503 (default: on)",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT,
        metavar="SECONDS",
        help="how long unloading a model, or stopping the server (SIGTERM, Ctrl-C), waits for "
        "running requests before cutting them (default: 30)",
    )
    lora = p.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the PEFT adapter in PATH (adapter_config.json + adapter_model.safetensors) "
        "on the -m model as model NAME; repeatable",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=64,
        metavar="R",
        help="refuse adapters of a higher rank (default: 64)",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=4,  # EngineConfig.max_loras (not imported: --help stays quick)
        metavar="N",
        help="adapters attached to the weights at once; more may be served: each is read "
        "again when a request needs it, into the slot of the least recently used one no "
        "running request uses, and a request waits while every slot is in use (default: 4)",
    )
    p.set_defaults(model=None)  # -m: the default model, unless --config is given
