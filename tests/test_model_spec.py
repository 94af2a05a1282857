"""Models files (JSON and TOML): the shape they take and every mistake reported by key path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferd.serving.spec import ModelSpec, SpecError, load_models_file, parse_models

GOOD_JSON = {
    "chat": {"GGUF": {"model_id": "smollm2"}, "max_seqs": 4},
    "embed": {"Embedding": {"model_id": "minilm", "alias": "text-embedding"}},
    "local": {
        "GGUF": {"quantized_model_id": "models", "quantized_filename": "tiny.Q4_K_M.gguf"},
        "dtype": "f32",
        "max_seq_len": 1024,
    },
}

GOOD_TOML = """
[chat]
max_seqs = 4
[chat.GGUF]
model_id = "smollm2"

[embed.Embedding]
model_id = "minilm"
alias = "text-embedding"

[local]
dtype = "f32"
max_seq_len = 1024
[local.GGUF]
quantized_model_id = "models"
quantized_filename = "tiny.Q4_K_M.gguf"
"""


def test_json_and_toml_give_the_same_specs(tmp_path: Path) -> None:
    (tmp_path / "models.json").write_text(json.dumps(GOOD_JSON))
    (tmp_path / "models.toml").write_text(GOOD_TOML)
    from_json = load_models_file(tmp_path / "models.json")
    assert from_json == load_models_file(tmp_path / "models.toml")
    chat, embed, local = from_json
    assert chat == ModelSpec(model_id="smollm2", kind="GGUF", label="chat", max_seqs=4)
    assert (embed.kind, embed.api_id, embed.label) == ("Embedding", "text-embedding", "embed")
    assert (local.model_id, local.filename, local.api_id) == (
        "models",
        "tiny.Q4_K_M.gguf",
        "tiny.Q4_K_M",
    )
    assert (local.dtype, local.max_seq_len) == ("f32", 1024)


def test_api_ids_come_from_the_source(tmp_path: Path) -> None:
    gguf = tmp_path / "SmolThing-7B.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "all-MiniLM").mkdir()
    specs = parse_models(
        {
            "a": {"GGUF": {"model_id": str(gguf)}},
            "b": {"Embedding": {"model_id": str(tmp_path / "all-MiniLM")}},
            "c": {"Plain": {"model_id": "org/name"}},
        }
    )
    assert [s.api_id for s in specs] == ["SmolThing-7B.Q4_0", "all-MiniLM", "org/name"]


def test_chat_templates_from_text_file_and_tokenizer_config(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x' }}"}))
    specs = parse_models(
        {
            "a": {"GGUF": {"model_id": "smollm2"}, "jinja_explicit": "t.jinja"},
            "b": {"GGUF": {"model_id": "x.gguf"}, "chat_template": "tokenizer_config.json"},
            "c": {
                "GGUF": {"model_id": "y.gguf"},
                "chat_template": "{% for m in messages %}{% endfor %}",
            },
        },
        base=tmp_path,
    )
    assert [s.chat_template for s in specs] == [
        "{{ messages[0].content }}",
        "{{ 'x' }}",
        "{% for m in messages %}{% endfor %}",
    ]


@pytest.mark.parametrize(
    ("doc", "problem"),
    [
        ([], "expected an object mapping labels to model entries, got an array"),
        ({}, "no models"),
        (
            {"a": "smollm2"},
            "a: expected an object with one of GGUF, Plain, VisionPlain, Embedding, got a string",
        ),
        (
            {"a": {"max_seqs": 2}},
            "a: expected exactly one model kind (GGUF, Plain, VisionPlain, Embedding); found none",
        ),
        ({"a": {"Speech": {"model_id": "x"}}}, "a.Speech: unknown key"),
        (
            {"a": {"GGUF": {"model_id": "x"}, "Embedding": {"model_id": "y"}}},
            "a: expected exactly one model kind (GGUF, Plain, VisionPlain, Embedding); "
            "found GGUF, Embedding",
        ),
        ({"a": {"GGUF": "smollm2"}}, "a.GGUF: expected an object with model_id, got a string"),
        ({"a": {"GGUF": {}}}, "a.GGUF.model_id: required"),
        (
            {"a": {"GGUF": {"model_id": 7}}},
            "a.GGUF.model_id: expected a non-empty string, got a number 7",
        ),
        ({"a": {"GGUF": {"model_id": "x", "quantize": "q4"}}}, "a.GGUF.quantize: unknown key"),
        (
            {"a": {"GGUF": {"quantized_model_id": "dir"}}},
            "a.GGUF.quantized_filename: required with quantized_model_id",
        ),
        (
            {"a": {"Embedding": {"model_id": "m", "quantized_filename": "f.gguf"}}},
            "a.Embedding.quantized_filename: only GGUF entries take quantized_filename",
        ),
        (
            {"a": {"GGUF": {"model_id": "x"}, "max_seq_len": "4k"}},
            'a.max_seq_len: expected a positive integer, got a string "4k"',
        ),
        (
            {"a": {"GGUF": {"model_id": "x"}, "max_seqs": 0}},
            "a.max_seqs: expected a positive integer, got a number 0",
        ),
        (
            {"a": {"GGUF": {"model_id": "x"}, "max_seqs": True}},
            "a.max_seqs: expected a positive integer, got a boolean true",
        ),
        (
            {"a": {"GGUF": {"model_id": "x"}, "dtype": "fp16"}},
            "a.dtype: expected one of auto, bf16, f16, f32, got 'fp16'",
        ),
        (
            {"a": {"GGUF": {"model_id": "x", "dtype": "f32"}, "dtype": "f32"}},
            "a.GGUF.dtype: also given at a.dtype; give it once",
        ),
        (
            {"a": {"Embedding": {"model_id": "m"}, "chat_template": "{{ x }}"}},
            "a.chat_template: does not apply to Embedding models",
        ),
        (
            {"a": {"GGUF": {"model_id": "x"}, "alias": "default"}},
            "a.alias: 'default' names the default model",
        ),
        (
            {"a": {"GGUF": {"model_id": "x"}, "jinja_explicit": "missing.jinja"}},
            "a.jinja_explicit: expected a readable template file",
        ),
        (
            {"my model": {"GGUF": {"model_id": "smollm2"}}, "b": {"GGUF": {"model_id": "smollm2"}}},
            "b: serves under the API id 'smollm2', as \"my model\" does; give one of them an alias",
        ),
    ],
)
def test_mistakes_are_reported_with_their_key_path(doc: object, problem: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_models(doc, base=Path("/nonexistent"))
    assert any(problem in p for p in info.value.problems), info.value.problems


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    path.write_text(
        json.dumps({"a": {"GGUF": {}}, "b": {"GGUF": {"model_id": "x"}, "max_seqs": -1}})
    )
    with pytest.raises(SpecError) as info:
        load_models_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: 2 problems:")
    assert "a.GGUF.model_id: required" in message and "b.max_seqs" in message


def test_in_situ_quant_names() -> None:
    doc = {
        "a": {"GGUF": {"model_id": "smollm2"}, "in_situ_quant": "Q4K"},
        "b": {"Plain": {"model_id": "org/b", "in_situ_quant": "q8"}},
    }
    assert [s.in_situ_quant for s in parse_models(doc)] == ["q4", "q8"]
    with pytest.raises(SpecError, match=r"a.in_situ_quant: expected q8 or q4 .* got 'Q6K'"):
        parse_models({"a": {"GGUF": {"model_id": "smollm2"}, "in_situ_quant": "Q6K"}})


def test_kv_cache_dtype_per_model() -> None:
    doc = {
        "a": {"GGUF": {"model_id": "smollm2"}, "kv_cache_dtype": "int8"},
        "b": {"Plain": {"model_id": "org/b"}},
    }
    assert [s.kv_cache_dtype for s in parse_models(doc)] == ["int8", None]
    with pytest.raises(SpecError, match=r"a.kv_cache_dtype: expected one of auto, .* got 'q4'"):
        parse_models({"a": {"GGUF": {"model_id": "smollm2"}, "kv_cache_dtype": "q4"}})
    with pytest.raises(SpecError, match=r"e.kv_cache_dtype: does not apply to Embedding"):
        parse_models({"e": {"Embedding": {"model_id": "minilm"}, "kv_cache_dtype": "int8"}})
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        ModelSpec(model_id="x", kv_cache_dtype="fp8")


def test_hf_config_overrides_per_model_are_an_object() -> None:
    overrides = {"rope_scaling": {"factor": 2.0}}
    doc = {
        "a": {"Plain": {"model_id": "org/a"}, "hf_config_overrides": overrides},
        "b": {"Plain": {"model_id": "org/b"}},
    }
    specs = parse_models(doc)
    assert [s.config_overrides for s in specs] == [overrides, None]
    with pytest.raises(SpecError, match=r"a.hf_config_overrides: expected an object"):
        parse_models({"a": {"Plain": {"model_id": "org/a"}, "hf_config_overrides": "x"}})
    with pytest.raises(SpecError, match=r"e.hf_config_overrides: does not apply to Embedding"):
        parse_models({"e": {"Embedding": {"model_id": "minilm"}, "hf_config_overrides": {}}})
    with pytest.raises(ValueError, match="hf_config_overrides must be a JSON object, got int"):
        ModelSpec("x", hf_config_overrides="3")


def test_matformer_slices_per_model_name_a_table_beside_the_file(tmp_path: Path) -> None:
    """mistral.rs's keys: the table's path is read against the models file's folder; the
    slice name goes with it."""
    doc = {
        "a": {
            "Plain": {"model_id": "org/a"},
            "matformer_config_path": "slices.csv",
            "matformer_slice_name": "Config for official E2B Model",
        },
        "b": {"Plain": {"model_id": "org/b"}},
    }
    path = tmp_path / "models.json"
    path.write_text(json.dumps(doc))
    specs = load_models_file(path)
    assert specs[0].matformer == (str(tmp_path / "slices.csv"), "Config for official E2B Model")
    assert specs[1].matformer is None
    with pytest.raises(SpecError, match=r"e.matformer_slice_name: does not apply to Embedding"):
        parse_models({"e": {"Embedding": {"model_id": "minilm"}, "matformer_slice_name": "x"}})
    with pytest.raises(SpecError, match=r"a: matformer_config_path and matformer_slice_name go"):
        parse_models({"a": {"Plain": {"model_id": "org/a"}, "matformer_slice_name": "x"}})
    with pytest.raises(ValueError, match="needs both the table and the slice name"):
        ModelSpec("x", matformer_slice="E2B")


def test_tool_call_parser_names_a_syntax() -> None:
    doc = {
        "a": {"GGUF": {"model_id": "smollm2"}, "tool_call_parser": "mistral"},
        "b": {"Plain": {"model_id": "org/b", "tool_call_parser": "pythonic"}},
        "c": {"Plain": {"model_id": "org/c"}},
    }
    assert [s.tool_call_parser for s in parse_models(doc)] == ["mistral", "pythonic", None]
    with pytest.raises(SpecError, match=r"a.tool_call_parser: expected one of hermes, .* 'xml'"):
        parse_models({"a": {"GGUF": {"model_id": "smollm2"}, "tool_call_parser": "xml"}})
    with pytest.raises(SpecError, match=r"e\.Embedding\.tool_call_parser: does not apply"):
        parse_models({"e": {"Embedding": {"model_id": "minilm", "tool_call_parser": "hermes"}}})
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ModelSpec("smollm2", tool_call_parser="xml")


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read the models file"):
        load_models_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_models_file(tmp_path / "bad.json")
    (tmp_path / "bad.toml").write_text("[a\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_models_file(tmp_path / "bad.toml")


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "inferd", "serve", "--port", "9", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_serve_reports_file_problems_before_loading_anything(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"chat": {"GGUF": {"model_id": "smollm2"}, "max_seqs": "many"}}))
    out = _serve("--config", str(path))
    assert out.returncode == 2
    assert 'chat.max_seqs: expected a positive integer, got a string "many"' in out.stderr
    assert "loaded" not in out.stderr


def test_serve_refuses_an_unknown_default_and_config_with_m(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[chat.GGUF]\nmodel_id = "smollm2"\n')
    out = _serve("--config", str(path), "--default-model-id", "nope")
    assert out.returncode == 2
    assert "the default model 'nope' is not among the models: smollm2" in out.stderr
    out = _serve("--config", str(path), "-m", "smollm2")
    assert out.returncode == 2 and "give -m or --config, not both" in out.stderr
    out = _serve("--config", str(path), "--tool-call-parser", "mistral")
    assert out.returncode == 2 and "use tool_call_parser" in out.stderr
    out = _serve("--tool-call-parser", "xml")
    assert out.returncode == 2 and "invalid choice: 'xml'" in out.stderr


def test_mmproj_is_a_projector_file_beside_a_gguf_model(tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "mmproj.gguf").write_bytes(b"GGUF")
    doc = {"vlm": {"GGUF": {"model_id": "lm.gguf"}, "mmproj": "proj/mmproj.gguf"}}
    [spec] = parse_models(doc, base=tmp_path)
    assert spec.mmproj == str(tmp_path / "proj" / "mmproj.gguf")  # against the file's folder
    assert parse_models({"a": {"GGUF": {"model_id": "smollm2"}}})[0].mmproj is None
    bad = {
        "plain": {"Plain": {"model_id": "dir", "mmproj": "proj/mmproj.gguf"}},
        "missing": {"GGUF": {"model_id": "lm.gguf"}, "mmproj": "proj/none.gguf"},
    }
    with pytest.raises(SpecError) as err:
        parse_models(bad, base=tmp_path)
    assert err.value.problems == [
        "plain.Plain.mmproj: only GGUF entries take a projector (mmproj)",
        f"missing.mmproj: expected a projector .gguf file; {tmp_path}/proj/none.gguf is not a file",
    ]


def test_lora_adapters_per_model_as_a_table_or_name_path_strings(tmp_path: Path) -> None:
    for name in ("pirate", "poet", "a/b"):
        (tmp_path / "adapters" / name).mkdir(parents=True)
    toml = """
[chat]
[chat.GGUF]
model_id = "smollm2"
[chat.lora]
pirate = "adapters/pirate"
poet = "adapters/poet"

[other.Plain]
model_id = "dir"
lora = ["deep=adapters/a/b"]
"""
    (tmp_path / "models.toml").write_text(toml)
    chat, other = load_models_file(tmp_path / "models.toml")
    adapters = tmp_path / "adapters"
    assert chat.lora == (("pirate", str(adapters / "pirate")), ("poet", str(adapters / "poet")))
    assert other.lora == (("deep", str(adapters / "a" / "b")),)
    assert parse_models({"a": {"GGUF": {"model_id": "smollm2"}}})[0].lora == ()
    bad = {
        "chat": {"GGUF": {"model_id": "smollm2"}, "lora": {"default": "adapters/pirate"}},
        "two": {"Plain": {"model_id": "x"}, "lora": ["pirate=adapters/pirate", "oops", 3]},
        "gone": {"Plain": {"model_id": "y", "lora": {"lost": "adapters/none"}}},
        "emb": {"Embedding": {"model_id": "minilm"}, "lora": {"e": "adapters/poet"}},
        "kind": {"Plain": {"model_id": "z"}, "lora": "adapters/poet"},
        "x": {"Plain": {"model_id": "x"}, "lora": {"pirate": "adapters/pirate"}},
        "clash": {"Plain": {"model_id": "w"}, "lora": {"x": "adapters/poet"}},
        "dup": {"Plain": {"model_id": "v"}, "lora": ["pirate=adapters/poet"]},
    }
    with pytest.raises(SpecError) as err:
        parse_models(bad, base=tmp_path)
    assert err.value.problems == [
        "chat.lora.default: 'default' names the default model; choose another name",
        'two.lora[1]: expected "NAME=PATH", got a string "oops"',
        'two.lora[2]: expected "NAME=PATH", got a number 3',
        f"gone.Plain.lora.lost: expected a PEFT adapter directory; {adapters}/none is not one",
        "emb.lora: does not apply to Embedding models",
        "kind.lora: expected an object mapping adapter names to directories (or an array of "
        '"NAME=PATH"), got a string',
        "clash.lora.x: serves under the API id 'x', as x does; rename one",
        "dup.lora.pirate: serves under the API id 'pirate', as x.lora.pirate does; rename one",
    ]


def test_engine_settings_per_model(tmp_path: Path) -> None:
    """A model's own imatrix, prefix_cache_n, max_decode_steps_before_prefill and no_kv_cache;
    0 and false are settings, absent is the server's."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    doc = {
        "a": {
            "GGUF": {"model_id": "smollm2"},
            "in_situ_quant": "q8",
            "imatrix": "m.gguf",
            "prefix_cache_n": 0,
            "max_decode_steps_before_prefill": 4,
        },
        "b": {"Plain": {"model_id": "org/b", "no_kv_cache": False}},
    }
    a, b = parse_models(doc, base=tmp_path)
    assert (a.imatrix, a.prefix_cache_n, a.max_decode_steps_before_prefill, a.no_kv_cache) == (
        str(tmp_path / "m.gguf"),
        0,
        4,
        None,
    )
    assert (b.imatrix, b.prefix_cache_n, b.no_kv_cache) == (None, None, False)
    bad = {
        "a": {"GGUF": {"model_id": "smollm2"}, "imatrix": "none.dat", "prefix_cache_n": -1},
        "b": {"GGUF": {"model_id": "smollm2"}, "max_decode_steps_before_prefill": 0},
        "c": {"GGUF": {"model_id": "smollm2"}, "no_kv_cache": "yes"},
        "e": {"Embedding": {"model_id": "minilm"}, "no_kv_cache": True},
    }
    with pytest.raises(SpecError) as err:
        parse_models(bad, base=tmp_path)
    assert err.value.problems == [
        f"a.imatrix: expected an importance matrix file; {tmp_path}/none.dat is not a file",
        "a.prefix_cache_n: expected a non-negative integer (0: no prefix caching), got a number -1",
        "b.max_decode_steps_before_prefill: expected a positive integer, got a number 0",
        'c.no_kv_cache: expected true or false, got a string "yes"',
        "e.no_kv_cache: does not apply to Embedding models",
    ]


def test_a_models_engine_settings_reach_its_engine(smollm2_gguf: Path, tmp_path: Path) -> None:
    """The entry's settings replace the server's for that model alone."""
    from inferd.config import EngineConfig
    from inferd.serving.loading import ModelLoadError, load_spec
    from inferd.serving.served import ServedModel

    server = EngineConfig(dtype="f32", max_num_seqs=2, max_model_len=256, prefix_cache_n=8)
    spec = ModelSpec(
        str(smollm2_gguf), prefix_cache_n=0, max_decode_steps_before_prefill=3, no_kv_cache=True
    )
    model = load_spec(spec, server)
    try:
        assert isinstance(model, ServedModel)
        cfg = model.engine_config
        assert (cfg.prefix_cache_n, cfg.max_decode_steps_before_prefill, cfg.no_kv_cache) == (
            0,
            3,
            True,
        )
        assert not cfg.caches_prefixes and cfg.max_num_seqs == 2
    finally:
        model.shutdown()
    (tmp_path / "m.dat").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="goes with in-situ quantization"):
        load_spec(ModelSpec(str(smollm2_gguf), imatrix=str(tmp_path / "m.dat")), server)


def test_serve_refuses_imatrix_beside_a_models_file(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text('[chat.GGUF]\nmodel_id = "smollm2"\n')
    (tmp_path / "m.dat").write_bytes(b"")
    out = _serve("--config", str(path), "--isq", "q8", "--imatrix", str(tmp_path / "m.dat"))
    assert out.returncode == 2
    assert "with --config, give it on that model's entry" in out.stderr
