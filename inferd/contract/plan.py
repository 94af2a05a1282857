"""Launch plans: a frozen, validated description of one serving process and its identity.

A plan names the exact engine release, the exact model bundle, the bind address and every
limit. It renders an argument vector (never shell text) for ``inferd serve`` or for
``mistralrs serve``, and a canonical-JSON identity digest that changes when any field does.
Everything a plan cannot express faithfully for its engine is refused at construction, so a
plan that exists is one that can be launched as written.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

from inferd.contract.canonical import digest_of, is_sha256


class PlanError(ValueError):
    """A launch plan that must not be launched; the message names the field."""


class EngineKind(StrEnum):
    INFERD = "inferd"
    MISTRALRS = "mistralrs"


class Device(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    METAL = "metal"


class PagedAttention(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class ModelFormat(StrEnum):
    GGUF = "gguf"
    PLAIN = "plain"
    CONFIG = "config"  # inferd: a bundle of several models and the config naming them


class Toggle(StrEnum):
    ON = "on"
    OFF = "off"


class AccessLog(StrEnum):
    DEFAULT = "default"  # whatever the pinned release does without a flag
    JSON = "json"  # one JSON object per line; request ids and routes, never bodies


class Surface(StrEnum):
    """Capabilities beyond chat completion that add authority to the serving process."""

    UI = "ui"
    AGENT = "agent"
    TOOLS = "tools"
    WEB_SEARCH = "web_search"
    CODE_EXECUTION = "code_execution"
    SHELL = "shell"
    MCP = "mcp"
    SKILLS = "skills"
    LORA_MUTATION = "lora_mutation"


_VERSION = re.compile(r"^\d+\.\d+\.\d+(?:-[0-9A-Za-z]+(?:\.[0-9A-Za-z]+)*)?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_PUBLIC_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*(?:/[A-Za-z0-9][A-Za-z0-9._\-]*)?$")
# Characters that mean something to a shell or that split words. A plan's values are passed
# as separate argv entries and never through a shell, but a value that *looks* like shell
# text is a configuration mistake worth refusing before it reaches a log or a wrapper script.
_SHELL_SHAPED = re.compile(r"[\s$`;|&<>(){}\[\]*?!~'\"\\#^%]|[\x00-\x1f\x7f]")
# inferd's --dtype choices; the contract imports no inferd module, so a test keeps the two equal.
_DTYPES = frozenset({"auto", "bf16", "f16", "f32"})


@dataclass(frozen=True)
class EngineRelease:
    kind: EngineKind
    version: str  # exact, e.g. "0.8.2"; never "latest" or a range
    artifact_sha256: str  # the executable, or the distribution's source tree
    build: Device  # the backend the artifact was built for and observed to provide

    def __post_init__(self) -> None:
        if not _VERSION.fullmatch(self.version):
            raise PlanError(f"engine.version must be one exact version, got {self.version!r}")
        _require_digest("engine.artifact_sha256", self.artifact_sha256)


@dataclass(frozen=True)
class ModelSource:
    public_id: str  # human context only: a hub id resolves to a moving revision
    revision: str  # the upstream snapshot: a 40-hex commit or "sha256:<64 hex>"
    bundle_sha256: str  # the reviewed local bundle (see bundle.py)
    local_dir: str  # absolute, and named by bundle_sha256
    format: ModelFormat
    entry: str | None = None  # the file inside the bundle a GGUF loader (or --config) opens
    route: str | None = None  # format config: the model of the config this plan talks to

    def __post_init__(self) -> None:
        if not _PUBLIC_ID.fullmatch(self.public_id) or len(self.public_id) > 200:
            raise PlanError(f"model.public_id {self.public_id!r} is not a hub-style id")
        if not _is_revision(self.revision):
            raise PlanError(
                f"model.revision must be a 40-hex commit or sha256:<64 hex>, got {self.revision!r}"
            )
        _require_digest("model.bundle_sha256", self.bundle_sha256)
        _check_local_dir(self.local_dir, self.bundle_sha256)
        if self.entry is not None:
            _check_entry(self.entry)
        if (self.route is not None) != (self.format is ModelFormat.CONFIG):
            raise PlanError("model.route names a model of a config bundle, and only there")
        if self.route is not None and not _PUBLIC_ID.fullmatch(self.route):
            raise PlanError(f"model.route {self.route!r} is not a model id")

    @property
    def entry_path(self) -> str:
        return self.local_dir if self.entry is None else f"{self.local_dir}/{self.entry}"


@dataclass(frozen=True)
class Limits:
    max_seqs: int
    max_seq_len: int
    paged_attention: PagedAttention
    prefix_cache_n: int | None  # how many cached prefixes it keeps (0: none; inferd: optional)
    max_num_images: int
    max_image_edge: int  # 0: the plan sets no edge bound
    device: Device
    max_batch_size: int | None = None  # mistral.rs: sizing input for device mapping
    max_num_batched_tokens: int | None = None  # inferd: token budget of one engine step
    kv_cache_tokens: int | None = None  # inferd: KV pool size
    dtype: str | None = None  # inferd: auto | bf16 | f16 | f32
    seed: int | None = None  # inferd: default sampling seed
    prefix_caching: Toggle | None = None  # inferd: block reuse, bounded by the pool or the count
    # inferd: keep no KV between a request's tokens, each one recomputing its whole sequence
    # (--no-kv-cache): the same greedy answers, far slower; a reference path, never a default
    no_kv_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_seq_len"):
            _require_int(f"limits.{name}", getattr(self, name), minimum=1)
        for name in ("max_num_images", "max_image_edge"):
            _require_int(f"limits.{name}", getattr(self, name), minimum=0)
        if self.prefix_cache_n is not None:
            _require_int("limits.prefix_cache_n", self.prefix_cache_n, minimum=0)
        for name in ("max_batch_size", "max_num_batched_tokens", "kv_cache_tokens"):
            value = getattr(self, name)
            if value is not None:
                _require_int(f"limits.{name}", value, minimum=1)
        if self.seed is not None:
            _require_int("limits.seed", self.seed, minimum=0)
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise PlanError(f"limits.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.prefix_caching is not None and not isinstance(self.prefix_caching, Toggle):
            raise PlanError(f"limits.prefix_caching must be on or off, got {self.prefix_caching!r}")
        if not isinstance(self.no_kv_cache, bool):
            raise PlanError(f"limits.no_kv_cache must be true or false, got {self.no_kv_cache!r}")
        if self.max_num_images == 0 and self.max_image_edge != 0:
            raise PlanError("limits.max_image_edge bounds images: it needs max_num_images > 0")


@dataclass(frozen=True)
class LaunchPlan:
    engine: EngineRelease
    model: ModelSource
    host: str
    port: int
    limits: Limits
    access_log: AccessLog = AccessLog.DEFAULT
    surfaces: frozenset[Surface] = field(default_factory=frozenset)
    allow_non_loopback: bool = False
    # inferd: the one directory the server may read file:// media from (the evidence store's
    # published root); None: file:// media is refused
    media_root: str | None = None

    def __post_init__(self) -> None:
        _check_host(self.host, self.allow_non_loopback)
        _require_int("port", self.port, minimum=1)
        if self.port > 65535:
            raise PlanError(f"port {self.port} is out of range")
        if self.surfaces:
            names = ", ".join(sorted(self.surfaces))
            raise PlanError(f"surfaces {names} add execution authority and are not allowed")
        _RENDERERS[self.engine.kind].check(self)
        for arg in self.launch_args():
            _check_arg(arg)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def model_route(self) -> str:
        """The exact model id the server reports and every stream chunk must repeat."""
        return _RENDERERS[self.engine.kind].route(self)

    def launch_args(self) -> tuple[str, ...]:
        """The argument vector after the executable, starting with ``serve``."""
        return _RENDERERS[self.engine.kind].args(self)

    def identity(self) -> dict[str, Any]:
        record = asdict(self)
        # Fields added after plans were pinned count only when set, so those plans keep
        # their identity.
        if self.media_root is None:
            del record["media_root"]
        if self.model.route is None:
            del record["model"]["route"]
        if not self.limits.no_kv_cache:
            del record["limits"]["no_kv_cache"]
        record["surfaces"] = sorted(self.surfaces)
        # The rendered argv and route bind the rendering rules themselves into the identity.
        record["argv"] = list(self.launch_args())
        record["model_route"] = self.model_route
        record["schema"] = "inferd.contract.launch/1"
        return record

    def identity_sha256(self) -> str:
        return digest_of(self.identity())


class _InferdRenderer:
    """``inferd serve``: one GGUF file, or a bundle of several models and the ``--config``
    naming them (format config; the plan talks to ``model.route``); paged KV always on, CPU.

    Its prefix cache is on or off, and when on may keep a count of cached prefixes
    (``--prefix-cache-n``; unset: as many as the pool holds). It caps images per request
    (``--max-num-images``) and scales each one to an edge bound (``--max-edge``), rendered only
    when set, so a plan without one keeps its argv; likewise ``--no-kv-cache``, which keeps no
    prefixes, so it needs prefix caching off.
    """

    @staticmethod
    def check(plan: LaunchPlan) -> None:
        m, lim = plan.model, plan.limits
        _require(
            m.format in (ModelFormat.GGUF, ModelFormat.CONFIG) and m.entry is not None,
            "inferd serves one GGUF file (model.format gguf) or a config of models "
            "(model.format config), named by model.entry",
        )
        suffix = ".json" if m.format is ModelFormat.CONFIG else ".gguf"
        _require(
            m.entry is None or m.entry.endswith(suffix), f"model.entry must be a {suffix} file"
        )
        _require(
            plan.media_root is None or PurePosixPath(plan.media_root).is_absolute(),
            "media_root must be an absolute path",
        )
        _require(
            lim.paged_attention is PagedAttention.ON,
            "inferd always pages its KV cache: limits.paged_attention must be on",
        )
        _require(
            lim.device is Device.CPU and plan.engine.build is Device.CPU,
            "inferd computes on the CPU: device and engine.build must be cpu",
        )
        _require(
            lim.max_batch_size is None, "inferd has no max_batch_size; use max_num_batched_tokens"
        )
        explicit = ("dtype", "max_num_batched_tokens", "kv_cache_tokens", "prefix_caching")
        _require_set(lim, explicit, given=True, engine=plan.engine.kind)
        counted = lim.prefix_cache_n
        _require(
            counted is None or (counted > 0) == (lim.prefix_caching is Toggle.ON),
            "limits.prefix_cache_n contradicts limits.prefix_caching: a count of prefixes needs "
            "it on, and 0 (no prefix cache) needs it off",
        )
        _require(
            not lim.no_kv_cache or lim.prefix_caching is Toggle.OFF,
            "limits.no_kv_cache keeps no KV to reuse: it needs limits.prefix_caching off",
        )

    @staticmethod
    def route(plan: LaunchPlan) -> str:
        if plan.model.route is not None:  # a config's model, by its id there
            return plan.model.route
        # inferd serves a GGUF path under the file's stem.
        assert plan.model.entry is not None
        return PurePosixPath(plan.model.entry).stem

    @staticmethod
    def args(plan: LaunchPlan) -> tuple[str, ...]:
        lim = plan.limits
        config = plan.model.format is ModelFormat.CONFIG
        return _flags(
            ("--config" if config else "-m", plan.model.entry_path),
            ("--host", plan.host),
            ("--port", plan.port),
            ("--access-log-format", _json_access_log(plan)),
            ("--dtype", lim.dtype),
            ("--max-seqs", lim.max_seqs),
            ("--max-seq-len", lim.max_seq_len),
            ("--max-num-batched-tokens", lim.max_num_batched_tokens),
            ("--kv-cache-tokens", lim.kv_cache_tokens),
            ("--prefix-caching", lim.prefix_caching),
            ("--prefix-cache-n", lim.prefix_cache_n),
            ("--no-kv-cache", lim.no_kv_cache),
            # Always explicit: the server's default admits images the plan never asked for.
            ("--max-num-images", lim.max_num_images),
            ("--max-edge", lim.max_image_edge or None),
            ("--seed", lim.seed),
            ("--allowed-media-root", plan.media_root),
            # The safety settings, explicit whatever the release's defaults: no chat page, no
            # lifecycle or LoRA mutation routes (the plan's surfaces add no authority).
            ("--ui", "off"),
            ("--admin-routes", "off"),
        )


class _MistralRsRenderer:
    """``mistralrs serve`` with the pinned flag set: plain bundles by directory."""

    @staticmethod
    def check(plan: LaunchPlan) -> None:
        m, lim = plan.model, plan.limits
        _require(
            m.format is ModelFormat.PLAIN and m.entry is None,
            "the pinned mistralrs flag set serves a plain bundle directory (no entry)",
        )
        _require(plan.media_root is None, "the pinned mistralrs flag set has no media root")
        # --prefix-cache-n 0 turns mistral.rs's prefix cache off.
        _require_set(lim, ("max_batch_size", "prefix_cache_n"), given=True, engine=plan.engine.kind)
        inferd_only = (
            "max_num_batched_tokens",
            "kv_cache_tokens",
            "dtype",
            "seed",
            "prefix_caching",
        )
        _require_set(lim, inferd_only, given=False, engine=plan.engine.kind)
        _require(not lim.no_kv_cache, "limits.no_kv_cache is not in the flag set of mistralrs")
        _require(
            (lim.max_num_images == 0) == (lim.max_image_edge == 0),
            "limits.max_num_images and max_image_edge are both zero or both set for mistralrs",
        )
        # Only CPU can be forced by flag; any other device comes from the binary's build,
        # so the plan must say which build it pinned rather than hope for auto-selection.
        _require(
            lim.device is plan.engine.build or lim.device is Device.CPU,
            "limits.device must be cpu or match engine.build",
        )

    @staticmethod
    def route(plan: LaunchPlan) -> str:
        return plan.model.local_dir

    @staticmethod
    def args(plan: LaunchPlan) -> tuple[str, ...]:
        lim = plan.limits
        return _flags(
            ("--model-id", plan.model.local_dir),
            ("--format", plan.model.format),
            ("--host", plan.host),
            ("--port", plan.port),
            ("--no-ui", True),
            ("--access-log-format", _json_access_log(plan)),
            ("--max-seqs", lim.max_seqs),
            ("--max-seq-len", lim.max_seq_len),
            ("--max-batch-size", lim.max_batch_size),
            ("--paged-attn", lim.paged_attention),
            ("--prefix-cache-n", lim.prefix_cache_n),
            ("--max-num-images", lim.max_num_images),
            ("--max-edge", lim.max_image_edge),
            ("--cpu", lim.device is Device.CPU),
        )


_RENDERERS: dict[EngineKind, type[_InferdRenderer] | type[_MistralRsRenderer]] = {
    EngineKind.INFERD: _InferdRenderer,
    EngineKind.MISTRALRS: _MistralRsRenderer,
}


def _flags(*pairs: tuple[str, str | int | bool | None]) -> tuple[str, ...]:
    """``serve`` and then ``flag value`` for each pair, in order: None leaves the flag out,
    True writes it bare, False leaves it out; every other value is written as ``str()``."""
    argv = ["serve"]
    for flag, value in pairs:
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return tuple(argv)


def _json_access_log(plan: LaunchPlan) -> str | None:
    # Both engines spell it the same way; the default format needs no flag.
    return "json" if plan.access_log is AccessLog.JSON else None


def _require_set(limits: Limits, names: tuple[str, ...], *, given: bool, engine: str) -> None:
    """Each named limit must be given (not None) or, with ``given=False``, left unset."""
    for name in names:
        if (getattr(limits, name) is not None) != given:
            need = "must be explicit for" if given else "is not in the flag set of"
            raise PlanError(f"limits.{name} {need} {engine}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise PlanError(message)


def _require_digest(name: str, value: str) -> None:
    if not is_sha256(value):
        raise PlanError(f"{name} must be a lowercase 64-hex sha256, got {value!r}")


def _require_int(name: str, value: object, *, minimum: int) -> None:
    # bool is an int subclass; True as a port or a limit is always a mistake.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _is_revision(value: str) -> bool:
    return bool(_COMMIT.fullmatch(value)) or (
        value.startswith("sha256:") and is_sha256(value.removeprefix("sha256:"))
    )


def _check_local_dir(value: str, digest: str) -> None:
    path = PurePosixPath(value)
    if not path.is_absolute() or path.as_posix() != value or ".." in path.parts:
        raise PlanError(f"model.local_dir {value!r} must be an absolute, normalized path")
    if path.name != digest:
        raise PlanError(f"model.local_dir {value!r} must be named by its bundle digest")


def _check_entry(value: str) -> None:
    path = PurePosixPath(value)
    if len(path.parts) != 1 or value in (".", "..") or path.as_posix() != value:
        raise PlanError(f"model.entry {value!r} must be one file name inside the bundle")


def _check_host(host: str, allow_non_loopback: bool) -> None:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        # A name can resolve anywhere, and differently tomorrow; bind to an address.
        raise PlanError(f"host must be an IP address, got {host!r}") from None
    if not address.is_loopback and not allow_non_loopback:
        raise PlanError(f"host {host} is not loopback; set allow_non_loopback to bind it")


def _check_arg(arg: str) -> None:
    if not arg or _SHELL_SHAPED.search(arg):
        raise PlanError(f"launch argument {arg!r} is empty, whitespace-split or shell-shaped")


def plan_to_dict(plan: LaunchPlan) -> dict[str, Any]:
    """The plan as plain JSON values (enums as their strings), as ``load_plan`` reads it."""
    record = asdict(plan)
    record["surfaces"] = sorted(plan.surfaces)
    return _plain(record)


def plan_from_dict(data: dict[str, Any]) -> LaunchPlan:
    """A plan from ``plan_to_dict``'s shape; every field is validated as the plan is built,
    and an unknown or missing field is a PlanError naming it."""
    try:
        engine = dict(data["engine"])
        model = dict(data["model"])
        limits = dict(data["limits"])
        engine["kind"], engine["build"] = EngineKind(engine["kind"]), Device(engine["build"])
        model["format"] = ModelFormat(model["format"])
        limits["paged_attention"] = PagedAttention(limits["paged_attention"])
        limits["device"] = Device(limits["device"])
        if limits.get("prefix_caching") is not None:
            limits["prefix_caching"] = Toggle(limits["prefix_caching"])
        rest = {k: v for k, v in data.items() if k not in ("engine", "model", "limits")}
        rest["access_log"] = AccessLog(rest.get("access_log", AccessLog.DEFAULT))
        rest["surfaces"] = frozenset(Surface(s) for s in rest.get("surfaces", ()))
        return LaunchPlan(
            engine=EngineRelease(**engine),
            model=ModelSource(**model),
            limits=Limits(**limits),
            **rest,
        )
    except KeyError as exc:
        raise PlanError(f"the plan lacks {exc.args[0]!r}") from None
    except TypeError as exc:  # an unknown field: the dataclass names it
        raise PlanError(f"the plan has a field no plan takes: {exc}") from None
    except ValueError as exc:
        if isinstance(exc, PlanError):
            raise
        raise PlanError(f"the plan has a value out of its choices: {exc}") from None


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, StrEnum):
        return str(value)
    return value
