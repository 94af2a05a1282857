"""The release gate's comparisons (contract/gate.py), on answers and figures built here; the
live gate against real servers is tests/contract/test_gate_live.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from inferd.cli import main
from inferd.contract.gate import (
    PERF_PROMPT,
    Answer,
    GateError,
    Performance,
    Run,
    Tolerances,
    compare,
    load_cases,
    perf_prompt,
)
from inferd.contract.identity import model_identity, served_model_path
from inferd.contract.live import PROMPT
from inferd.contract.plan import LaunchPlan, ModelFormat, PlanError, plan_from_dict, plan_to_dict
from tests.contract.helpers import inferd_plan

PERF = Performance(
    cold_load_s=5.0,
    ttft_p50_s=0.1,
    ttft_p99_s=0.2,
    itl_p50_s=0.03,
    itl_p99_s=0.05,
    throughput_tok_s=60.0,
    concurrency=4,
    overload_ttft_p99_s=1.0,
    peak_rss_mb=1000.0,
)
ENV = {"kernel_isa": "avx512", "dtype": "float32", "kernels": {"fused": "fused CPU kernels"}}
IDENTITY = {p: "a" * 64 for p in ("weights", "tokenizer", "chat_template", "quantization")} | {
    "processor": None
}


def _answer(tokens: list[str], logprob: float = -0.1, **fields: object) -> Answer:
    n = len(tokens)
    steps = [{"token": t, "logprob": logprob, "top": {t: logprob, "x": -3.0}} for t in tokens]
    base = Answer(
        id="c",
        status=200,
        request_sha256="b" * 64,
        finish_reason="stop",
        text="".join(tokens),
        usage={"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n},
        logprobs=steps,
    )
    return dataclasses.replace(base, **fields)


def _run(*answers: Answer, perf: Performance = PERF, env: dict | None = None, **kw: object) -> Run:
    return Run(
        plan={},
        plan_sha256="c" * 64,
        identity=dict(kw.get("identity", IDENTITY)),  # type: ignore[call-overload]
        environment=env or ENV,
        answers=list(answers),
        performance=perf,
        tolerances=Tolerances(**kw.get("tolerances", {})),  # type: ignore[arg-type]
    )


def _failed(report_rows: list) -> dict[str, str]:  # type: ignore[type-arg]
    return {r.name: r.detail for r in report_rows if not r.passed}


def test_an_unchanged_release_passes_every_row() -> None:
    old = _run(_answer(["Par", "is"]))
    report = compare(old, _run(_answer(["Par", "is"])))
    assert report.passed, report.table()
    assert {r.kind for r in report.rows} == {"case", "environment", "identity", "performance"}
    assert "gate PASSED: 0 of" in report.table()


def test_moved_text_fails_its_case_at_the_first_different_token() -> None:
    report = compare(_run(_answer(["Par", "is", "."])), _run(_answer(["Par", "am", "."])))
    assert _failed(report.rows) == {"c": "text moved at token 1"}


def test_log_prob_distance_counts_only_before_the_texts_part() -> None:
    loose = {"exact_text": False, "logprob_distance": 0.05}
    old = _run(_answer(["a", "b"], logprob=-0.10), tolerances=loose)
    near = compare(old, _run(_answer(["a", "b"], logprob=-0.14)))
    assert near.passed, near.table()
    far = compare(old, _run(_answer(["a", "b"], logprob=-0.30)))
    assert _failed(far.rows) == {"c": "log-prob distance 0.2000 > 0.05"}


def test_prompt_tokens_finish_reason_and_usage_arithmetic() -> None:
    old = _run(_answer(["a"]), tolerances={"exact_text": False})
    new = _answer(
        ["a"],
        finish_reason="length",
        usage={"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 99},
    )
    detail = _failed(compare(old, _run(new)).rows)["c"]
    assert detail == (
        "finish_reason stop -> length; prompt_tokens 10 -> 12; usage does not add up: "
        "{'prompt_tokens': 12, 'completion_tokens': 1, 'total_tokens': 99}"
    )


def test_a_refusal_case_must_be_refused_the_same_way() -> None:
    refused = Answer(id="c", status=400, request_sha256="b" * 64, error_code="invalid_value")
    assert compare(_run(refused), _run(dataclasses.replace(refused))).passed
    answered = _answer(["ok"])
    assert _failed(compare(_run(refused), _run(answered)).rows) == {
        "c": "refusal moved: HTTP 400 invalid_value -> 200 None"
    }


def test_a_schema_answer_must_stay_valid_and_the_request_must_be_the_frozen_one() -> None:
    old = _answer(["{}"], schema_valid=True)
    assert _failed(compare(_run(old), _run(dataclasses.replace(old, schema_valid=False))).rows) == {
        "c": "the answer no longer matches its json_schema"
    }
    other = dataclasses.replace(old, request_sha256="d" * 64)
    assert _failed(compare(_run(old), _run(other)).rows) == {
        "c": "the request or its evidence differs from the frozen one"
    }


def test_a_schema_answer_invalid_in_the_golden_may_stay_invalid() -> None:
    old = _answer(["{"], schema_valid=False)
    assert compare(_run(old), _run(dataclasses.replace(old))).passed


def test_a_figure_the_golden_did_not_measure_is_reported_not_failed() -> None:
    """Streams whose tokens all came in one chunk measure no inter-token gap: a zero baseline
    bounds nothing, so a candidate that measured gaps is not failed for it."""
    unmeasured = dataclasses.replace(PERF, itl_p50_s=0.0, itl_p99_s=0.0)
    rows = {
        r.name: r for r in compare(_run(_answer(["a"]), perf=unmeasured), _run(_answer(["a"]))).rows
    }
    assert rows["itl_p99_s"].passed and rows["itl_p99_s"].detail.startswith("no baseline")
    assert rows["ttft_p50_s"].detail.startswith(f"{PERF.ttft_p50_s:g} -> ")


def test_performance_regressions_beyond_the_tolerances_fail() -> None:
    slower = dataclasses.replace(PERF, ttft_p50_s=0.14, itl_p99_s=0.09, throughput_tok_s=30.0)
    failed = _failed(compare(_run(_answer(["a"])), _run(_answer(["a"]), perf=slower)).rows)
    assert set(failed) == {"itl_p99_s", "throughput_tok_s"}  # TTFT +40% is within +50%
    assert failed["throughput_tok_s"].startswith("60 -> 30 (0.50x")


def test_a_longer_perf_context_is_that_many_words_before_the_timed_prompt() -> None:
    assert perf_prompt(0) == PERF_PROMPT == perf_prompt(Tolerances().perf_context_words)
    context, prompt = perf_prompt(300).split("\n\n")
    assert len(context.split()) == 300 and prompt == PERF_PROMPT


def test_identity_changes_are_reported_and_environment_changes_fail() -> None:
    new_template = IDENTITY | {"chat_template": "e" * 64}
    report = compare(_run(_answer(["a"])), _run(_answer(["a"]), identity=new_template))
    assert report.passed
    rows = {r.name: r.detail for r in report.rows if r.kind == "identity"}
    assert rows["chat_template"] == "changed" and rows["weights"] == "same"
    avx2 = ENV | {"kernel_isa": "avx2"}
    assert _failed(compare(_run(_answer(["a"])), _run(_answer(["a"]), env=avx2)).rows) == {
        "kernel_isa": '"avx512" -> "avx2"'
    }


def test_case_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "cases.json"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    path.write_text(json.dumps({"cases": [{"id": "a", "body": body}, {"id": "a", "body": body}]}))
    with pytest.raises(GateError, match="unique ids"):
        load_cases(path)
    path.write_text(json.dumps({"cases": [{"id": "a", "body": body | {"model": "x"}}]}))
    with pytest.raises(GateError, match="sets model and stream"):
        load_cases(path)
    path.write_text(json.dumps({"cases": [{"id": "a", "body": body}], "tolerances": {"speed": 1}}))
    with pytest.raises(GateError, match="not a case file"):
        load_cases(path)
    cases, tolerances = load_cases(Path("examples/gate/cases.json"))
    assert len(cases) == 10 and sum(c.refusal for c in cases) == 1
    assert tolerances.logprob_distance == 0.05


def test_the_case_file_carries_each_modality_and_the_seeds_worked_example() -> None:
    cases = {c.id: c.body for c in load_cases(Path("examples/gate/cases.json"))[0]}

    def parts(case: str) -> list[str]:
        content = cases[case]["messages"][0]["content"]
        return [p["type"] for p in content] if isinstance(content, list) else ["text"]

    assert parts("image")[0] == "image_url" and parts("audio")[0] == "audio_url"
    assert parts("video")[0] == "video_url"
    # the seed's order: the PNG, the WAV and the MP4, then the text
    assert parts("worked-example") == ["image_url", "audio_url", "video_url", "text"]
    worked = cases["worked-example"]["messages"][0]["content"]
    for part, mime in zip(worked, ("image/png", "audio/wav", "video/mp4"), strict=False):
        assert part[part["type"]]["url"].startswith(f"data:{mime};base64,")
    assert worked[3]["text"] == PROMPT
    assert {"json-schema", "tool-call", "adversarial-temperature"} <= set(cases)


def test_a_plan_round_trips_through_json_with_its_identity() -> None:
    plan = inferd_plan()
    again = plan_from_dict(json.loads(json.dumps(plan_to_dict(plan))))
    assert again == plan and again.identity_sha256() == plan.identity_sha256()
    data = plan_to_dict(plan)
    del data["limits"]["dtype"]
    with pytest.raises(PlanError):
        plan_from_dict(data)
    with pytest.raises(PlanError, match="lacks 'engine'"):
        plan_from_dict({})


def _config_plan(root: Path, models: dict[str, object]) -> LaunchPlan:
    """An inferd plan of a config bundle at ``root`` (named by its digest), route ``tiny``."""
    base = inferd_plan(local_root=str(root))
    bundle = Path(base.model.local_dir)
    bundle.mkdir(parents=True)
    (bundle / "models.json").write_text(json.dumps(models))
    model = dataclasses.replace(
        base.model, format=ModelFormat.CONFIG, entry="models.json", route="tiny"
    )
    return dataclasses.replace(base, model=model)


def test_a_config_plan_is_identified_by_the_model_its_route_names(tmp_path: Path) -> None:
    plan = _config_plan(
        tmp_path,
        {
            "a": {"Plain": {"model_id": "./other"}, "alias": "other"},
            "b": {"Plain": {"model_id": "./tiny"}, "alias": "tiny"},
        },
    )
    bundle = Path(plan.model.local_dir)
    for name in ("tiny", "other"):
        (bundle / name).mkdir()
        (bundle / name / "model.safetensors").write_bytes(name.encode())
    (bundle / "tiny" / "processor_config.json").write_text("{}")
    assert served_model_path(plan) == (bundle / "tiny").resolve()
    identity = model_identity(served_model_path(plan))
    assert identity["processor"] is not None
    assert identity["weights"] != model_identity(bundle / "other")["weights"]


@pytest.mark.parametrize(
    "models",
    [
        {"b": {"Plain": {"model_id": "./missing"}, "alias": "tiny"}},
        {"b": {"Plain": {"model_id": "../escaped"}, "alias": "tiny"}},
        {"b": {"Plain": {"model_id": "./other"}, "alias": "other"}},
    ],
)
def test_a_config_plan_whose_route_is_not_in_its_bundle_is_refused(
    tmp_path: Path, models: dict[str, object]
) -> None:
    plan = _config_plan(tmp_path, models)
    (Path(plan.model.local_dir) / "other").mkdir()
    (tmp_path / "escaped").mkdir()
    with pytest.raises(ValueError, match="names no model 'tiny' inside its bundle"):
        served_model_path(plan)


def test_canary_refuses_a_mirrored_share_outside_zero_to_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for port in (8301, 8302):
        path = tmp_path / f"{port}.json"
        path.write_text(json.dumps(plan_to_dict(inferd_plan(port=port))))
        paths.append(str(path))
    args = ["gate", "canary", *paths, "--cases", "examples/gate/cases.json"]
    assert main([*args, "--mirror-share", "1.5"]) == 2
    assert "--mirror-share must be in (0, 1], got 1.5" in capsys.readouterr().err
