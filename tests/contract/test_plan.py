"""Launch plans: argv rendering, identity digests and every refusal of part 1."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from inferd.cli import _engine_config, _parser
from inferd.config import DTYPES
from inferd.contract.example import example_plan
from inferd.contract.plan import (
    AccessLog,
    Device,
    EngineRelease,
    LaunchPlan,
    Limits,
    ModelFormat,
    ModelSource,
    PagedAttention,
    PlanError,
    Surface,
    Toggle,
)
from tests.contract.helpers import inferd_plan

MISTRALRS_ARGV = (
    "serve --model-id /srv/mosaic-models/{b} --format plain --host 127.0.0.1 --port 1234 "
    "--no-ui --access-log-format json --max-seqs 4 --max-seq-len 8192 --max-batch-size 4 "
    "--paged-attn off --prefix-cache-n 4 --max-num-images 4 --max-edge 1024 --cpu"
).format(b="2" * 64)


def test_mistralrs_argv_is_the_pinned_flag_set() -> None:
    args = example_plan().launch_args()
    assert isinstance(args, tuple) and all(isinstance(a, str) for a in args)
    assert " ".join(args) == MISTRALRS_ARGV
    assert "--ui" not in args and not any("mcp" in a for a in args)


def test_inferd_argv_matches_our_cli() -> None:
    plan = inferd_plan()
    assert plan.launch_args() == (
        "serve", "-m", f"/srv/models/{'4' * 64}/model.gguf", "--host", "127.0.0.1",
        "--port", "8080", "--dtype", "f32", "--max-seqs", "4", "--max-seq-len", "2048",
        "--max-num-batched-tokens", "512", "--kv-cache-tokens", "8192",
        "--prefix-caching", "on", "--max-num-images", "0", "--seed", "7",
        "--ui", "off", "--admin-routes", "off",
    )  # fmt: skip
    assert plan.model_route == "model"
    assert plan.base_url == "http://127.0.0.1:8080"


def test_inferd_argv_renders_json_access_logs_images_and_prefix_caching() -> None:
    base = inferd_plan()
    plan = _replace(
        base,
        access_log=AccessLog.JSON,
        limits=dataclasses.replace(base.limits, max_num_images=4, prefix_caching=Toggle.OFF),
    )
    args = plan.launch_args()
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert pairs["--access-log-format"] == "json"
    assert pairs["--max-num-images"] == "4"
    assert pairs["--prefix-caching"] == "off"
    assert "--max-edge" not in args and "--prefix-cache-n" not in args


@pytest.mark.parametrize(("count", "caching"), [(4, Toggle.ON), (0, Toggle.OFF)])
def test_inferd_argv_renders_the_prefix_count_our_cli_takes(count: int, caching: Toggle) -> None:
    """A count of prefixes renders as --prefix-cache-n, and the real parser and engine config
    take it (0: prefix caching off, which the plan must also say)."""
    base = inferd_plan()
    lim = dataclasses.replace(base.limits, prefix_cache_n=count, prefix_caching=caching)
    args = _replace(base, limits=lim).launch_args()
    pairs = dict(zip(args[1::2], args[2::2], strict=False))
    assert (pairs["--prefix-cache-n"], pairs["--prefix-caching"]) == (str(count), str(caching))
    cfg = _engine_config(_parser().parse_args(list(args)))
    assert cfg.prefix_cache_n == count and cfg.caches_prefixes == (count > 0)


def test_inferd_argv_renders_no_kv_cache_as_our_cli_takes_it() -> None:
    """The slow reference path renders as the bare --no-kv-cache, which the real parser and
    engine config take beside the prefix caching it needs off; a plan without it keeps its
    argv and identity."""
    plan = _limits(inferd_plan(), prefix_caching=Toggle.OFF, no_kv_cache=True)
    args = plan.launch_args()
    assert args.count("--no-kv-cache") == 1 and "--no-kv-cache" not in inferd_plan().launch_args()
    cfg = _engine_config(_parser().parse_args(list(args)))
    assert cfg.no_kv_cache and not cfg.caches_prefixes
    assert "no_kv_cache" not in inferd_plan().identity()["limits"]
    assert plan.identity()["limits"]["no_kv_cache"] is True


@pytest.mark.parametrize("access_log", list(AccessLog))
@pytest.mark.parametrize("prefix_caching", list(Toggle))
@pytest.mark.parametrize(("images", "edge"), [(0, 0), (3, 0), (3, 448)])
def test_inferd_argv_parses_with_our_cli_as_the_plan_says(
    access_log: AccessLog, prefix_caching: Toggle, images: int, edge: int
) -> None:
    """The rendered argv goes through the real ``inferd`` parser to the values in the plan."""
    base = inferd_plan()
    lim = dataclasses.replace(
        base.limits, max_num_images=images, max_image_edge=edge, prefix_caching=prefix_caching
    )
    plan = _replace(base, access_log=access_log, limits=lim)
    args = _parser().parse_args(list(plan.launch_args()))
    assert args.command == "serve" and args.model == plan.model.entry_path
    assert (args.host, args.port) == (plan.host, plan.port)
    assert args.access_log_format == ("json" if access_log is AccessLog.JSON else "text")
    assert args.prefix_caching == str(prefix_caching)
    assert args.max_num_images == images
    assert args.max_edge == (edge or None)  # no bound: no flag, and the server's default
    assert (args.dtype, args.max_seqs, args.max_seq_len, args.seed) == ("f32", 4, 2048, 7)
    assert (args.max_num_batched_tokens, args.kv_cache_tokens) == (512, 8192)
    assert (args.ui, args.admin_routes) == ("off", "off")  # rendered whatever the defaults


def test_identity_is_stable_and_canonical() -> None:
    a, b = inferd_plan(), inferd_plan()
    assert a.identity_sha256() == b.identity_sha256()
    assert len(a.identity_sha256()) == 64
    assert a.identity()["argv"] == list(a.launch_args())


def _variants() -> list[tuple[str, LaunchPlan, LaunchPlan]]:
    """(field, base, variant): each variant differs from its base in that one field."""
    mrs, inf = example_plan(), inferd_plan()
    cuda = _engine(mrs, build=Device.CUDA)
    config = _model(inf, format=ModelFormat.CONFIG, entry="models.json", route="vision")
    other_bundle = {"bundle_sha256": "9" * 64, "local_dir": "/m/" + "9" * 64}
    uncached = _limits(inf, prefix_caching=Toggle.OFF)  # what no_kv_cache needs
    out = [
        ("engine.kind", mrs, inf),
        ("engine.version", mrs, _engine(mrs, version="0.8.3")),
        ("engine.artifact_sha256", mrs, _engine(mrs, artifact_sha256="7" * 64)),
        ("engine.build", mrs, cuda),
        ("model.public_id", mrs, _model(mrs, public_id="google/other")),
        ("model.revision", mrs, _model(mrs, revision="8" * 40)),
        ("model.bundle_sha256", mrs, _model(mrs, **other_bundle)),
        ("model.local_dir", mrs, _model(mrs, local_dir="/srv/other/" + "2" * 64)),
        ("model.entry", inf, _model(inf, entry="other.gguf")),
        ("model.route", config, _model(config, route="audio")),
        ("media_root", inf, _replace(inf, media_root="/srv/evidence")),
        ("host", mrs, _replace(mrs, host="127.0.0.2")),
        ("port", mrs, _replace(mrs, port=1235)),
        ("access_log", mrs, _replace(mrs, access_log=AccessLog.DEFAULT)),
        ("allow_non_loopback", mrs, _replace(mrs, allow_non_loopback=True)),
        ("limits.device", cuda, _limits(cuda, device=Device.CUDA)),
    ]
    changes: list[tuple[LaunchPlan, str, Any]] = [
        (mrs, "max_seqs", 5), (mrs, "max_seq_len", 4096), (mrs, "max_batch_size", 8),
        (mrs, "paged_attention", PagedAttention.AUTO), (mrs, "prefix_cache_n", 0),
        (mrs, "max_num_images", 2), (mrs, "max_image_edge", 512),
        (inf, "max_num_batched_tokens", 256), (inf, "kv_cache_tokens", 4096),
        (inf, "dtype", "bf16"), (inf, "seed", 8), (inf, "prefix_caching", Toggle.OFF),
        (inf, "prefix_cache_n", 4), (uncached, "no_kv_cache", True),
    ]  # fmt: skip
    out += [(f"limits.{name}", base, _limits(base, **{name: v})) for base, name, v in changes]
    return out


def _replace(plan: LaunchPlan, **kw: Any) -> LaunchPlan:
    return dataclasses.replace(plan, **kw)


def _engine(plan: LaunchPlan, **kw: Any) -> LaunchPlan:
    return _replace(plan, engine=dataclasses.replace(plan.engine, **kw))


def _model(plan: LaunchPlan, **kw: Any) -> LaunchPlan:
    return _replace(plan, model=dataclasses.replace(plan.model, **kw))


def _limits(plan: LaunchPlan, **kw: Any) -> LaunchPlan:
    return _replace(plan, limits=dataclasses.replace(plan.limits, **kw))


VARIANTS = _variants()


@pytest.mark.parametrize(("field", "base", "variant"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_identity_changes_with_every_field(
    field: str, base: LaunchPlan, variant: LaunchPlan
) -> None:
    assert variant.identity_sha256() != base.identity_sha256(), field


def test_a_config_plan_renders_its_config_and_media_root() -> None:
    plan = _replace(
        _model(inferd_plan(), format=ModelFormat.CONFIG, entry="models.json", route="vision"),
        media_root="/srv/evidence",
    )
    args = plan.launch_args()
    assert args[:3] == ("serve", "--config", f"{plan.model.local_dir}/models.json")
    assert args[-6:-4] == ("--allowed-media-root", "/srv/evidence")
    assert plan.model_route == "vision"
    # pinned plans keep their identity: the new fields count only when set
    assert "media_root" not in inferd_plan().identity()
    assert "route" not in inferd_plan().identity()["model"]


def test_routes_belong_to_config_bundles_and_media_roots_to_inferd() -> None:
    with pytest.raises(PlanError, match="route"):
        _model(inferd_plan(), route="vision")
    with pytest.raises(PlanError, match="entry"):
        _model(inferd_plan(), format=ModelFormat.CONFIG, route="vision")
    with pytest.raises(PlanError, match="media root"):
        _replace(example_plan(), media_root="/srv/evidence")


def test_every_plan_field_has_a_variant() -> None:
    leaves = {f.name for f in dataclasses.fields(LaunchPlan)} - {"engine", "model", "limits"}
    for prefix, cls in (("engine", EngineRelease), ("model", ModelSource), ("limits", Limits)):
        leaves |= {f"{prefix}.{f.name}" for f in dataclasses.fields(cls)}
    # surfaces must stay empty, and each engine accepts exactly one model format.
    assert leaves - {"surfaces", "model.format"} == {v[0] for v in VARIANTS}


@pytest.mark.parametrize(
    "version", ["latest", "0.8", ">=0.8.2", "^0.8.2", "~0.8.2", "0.8.*", "v0.8.2", ""]
)
def test_version_must_be_exact(version: str) -> None:
    with pytest.raises(PlanError, match="version"):
        EngineRelease(example_plan().engine.kind, version, "1" * 64, Device.CPU)


@pytest.mark.parametrize(
    "digest", ["", "1" * 63, "1" * 65, "A" * 64, "g" * 64, "sha256:" + "1" * 64]
)
def test_malformed_digests_are_refused(digest: str) -> None:
    base = example_plan()
    with pytest.raises(PlanError, match="sha256"):
        dataclasses.replace(base.engine, artifact_sha256=digest)
    with pytest.raises(PlanError):
        dataclasses.replace(base.model, bundle_sha256=digest)


@pytest.mark.parametrize("revision", ["main", "latest", "1" * 39, "sha256:abc", "refs/pr/1"])
def test_mutable_revisions_are_refused(revision: str) -> None:
    with pytest.raises(PlanError, match="revision"):
        dataclasses.replace(example_plan().model, revision=revision)


@pytest.mark.parametrize(
    "local_dir", ["relative/" + "2" * 64, "/srv/x/../" + "2" * 64, "/srv/models/latest"]
)
def test_local_dir_must_be_absolute_and_digest_named(local_dir: str) -> None:
    with pytest.raises(PlanError, match="local_dir"):
        dataclasses.replace(example_plan().model, local_dir=local_dir)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.4", "::", "10.0.0.1"])
def test_non_loopback_host_needs_explicit_permission(host: str) -> None:
    with pytest.raises(PlanError, match="loopback"):
        _replace(example_plan(), host=host)
    assert _replace(example_plan(), host=host, allow_non_loopback=True).host == host


def test_host_names_are_refused_and_ipv6_loopback_is_bracketed() -> None:
    with pytest.raises(PlanError, match="IP address"):
        _replace(example_plan(), host="localhost")
    assert _replace(example_plan(), host="::1").base_url == "http://[::1]:1234"


@pytest.mark.parametrize("surface", list(Surface))
def test_agent_tool_shell_ui_mcp_surfaces_are_refused(surface: Surface) -> None:
    with pytest.raises(PlanError, match="authority"):
        _replace(example_plan(), surfaces=frozenset({surface}))


@pytest.mark.parametrize(
    "root",
    [
        "/srv/my models",
        "/srv/$(id)",
        "/srv/a;rm",
        "/srv/`x`",
        "/srv/a|b",
        "/srv/a&b",
        "/srv/a\nb",
        "/srv/~x",
    ],
)
def test_shell_shaped_or_whitespace_values_are_refused(root: str) -> None:
    with pytest.raises(PlanError, match="shell-shaped"):
        inferd_plan(local_root=root)


@pytest.mark.parametrize("entry", ["../model.gguf", "sub/model.gguf", "model.bin", "-rf.gguf x"])
def test_entry_must_be_one_gguf_file(entry: str) -> None:
    with pytest.raises(PlanError):
        inferd_plan(entry=entry)


@pytest.mark.parametrize("port", [0, 65536, -1, True])
def test_port_range(port: int) -> None:
    with pytest.raises(PlanError, match="port"):
        inferd_plan(port=port)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"paged_attention": PagedAttention.OFF}, "paged_attention"),
        ({"prefix_cache_n": 4, "prefix_caching": Toggle.OFF}, "contradicts"),
        ({"prefix_cache_n": 0}, "contradicts"),
        ({"prefix_caching": None}, "prefix_caching"),
        ({"device": Device.CUDA}, "cpu"),
        ({"max_batch_size": 4}, "max_batch_size"),
        ({"dtype": None}, "dtype"),
        ({"kv_cache_tokens": None}, "kv_cache_tokens"),
        ({"no_kv_cache": True}, "needs limits.prefix_caching off"),
    ],
)
def test_inferd_refuses_limits_it_cannot_honour(change: dict[str, Any], message: str) -> None:
    base = inferd_plan()
    with pytest.raises(PlanError, match=message):
        _replace(base, limits=dataclasses.replace(base.limits, **change))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_batch_size": None}, "max_batch_size"),
        ({"dtype": "f32"}, "dtype"),
        ({"seed": 1}, "seed"),
        ({"device": Device.METAL}, "device"),
        ({"prefix_caching": Toggle.ON}, "prefix_caching"),
        ({"prefix_cache_n": None}, "prefix_cache_n"),
        ({"max_image_edge": 0}, "both zero or both set"),
        ({"no_kv_cache": True}, "no_kv_cache"),
    ],
)
def test_mistralrs_refuses_flags_outside_the_pinned_set(
    change: dict[str, Any], message: str
) -> None:
    base = example_plan()
    with pytest.raises(PlanError, match=message):
        _replace(base, limits=dataclasses.replace(base.limits, **change))


def test_limits_reject_nonsense() -> None:
    lim = example_plan().limits
    for change in ({"max_seqs": 0}, {"max_seq_len": -1}, {"prefix_cache_n": -1}, {"max_seqs": True},
                   {"max_num_images": 0}, {"dtype": "fp8"}, {"prefix_caching": "on"},
                   {"no_kv_cache": "yes"}):  # fmt: skip
        with pytest.raises(PlanError):
            dataclasses.replace(lim, **change)


def test_public_id_must_be_hub_shaped() -> None:
    for bad in ("", "a b", "org/name/extra", "../x"):
        with pytest.raises(PlanError, match="public_id"):
            dataclasses.replace(example_plan().model, public_id=bad)
    assert isinstance(example_plan().model, ModelSource)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_inferd_serve_takes_is_a_valid_plan_dtype(dtype: str) -> None:
    base = inferd_plan()
    plan = _replace(base, limits=dataclasses.replace(base.limits, dtype=dtype))
    assert _parser().parse_args(list(plan.launch_args())).dtype == dtype
