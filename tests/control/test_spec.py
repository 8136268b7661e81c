"""The spec schema: shipped specs validate; broken ones fail with every problem named and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loraflow.errors import SpecError
from loraflow.spec.cache import discover
from loraflow.spec.schema import load_spec, validate_spec, with_overrides

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
TINY = PIPELINES / "tiny-llama-lora.yaml"


def tiny_data() -> dict:
    return yaml.safe_load(TINY.read_text())


@pytest.mark.parametrize("path", discover(PIPELINES), ids=lambda p: p.name)
def test_shipped_specs_validate(path: Path) -> None:
    spec = load_spec(path)
    assert spec.name == path.stem
    assert path.read_text().startswith("#"), "each shipped spec opens with a comment saying what it runs"


def test_every_problem_is_reported_at_once() -> None:
    data = tiny_data()
    data["training"]["steps"] = "many"
    data["lora"]["rank"] = 0
    data["data"]["train"] = "/home/me/train.jsonl"
    data["gate"]["surprise"] = True
    del data["base_model"]["maxtext_model"]
    with pytest.raises(SpecError) as err:
        validate_spec(data, "broken.yaml")
    paths = {p for p, _ in err.value.problems}
    assert {"training.steps", "lora.rank", "data.train", "gate.surprise", "base_model.maxtext_model"} <= paths
    text = str(err.value)
    assert "broken.yaml: 5 problem(s)" in text
    assert "write gs://BUCKET/PATH" in text  # the fix, not just the complaint
    assert "unknown key; remove it" in text
    assert "required; add it" in text


@pytest.mark.parametrize(
    ("change", "where", "says"),
    [
        (lambda d: d.update(name="Tiny_LLama"), "name", "lowercase letters"),
        (lambda d: d.update(name="tiny-llama-lora\n"), "name", "lowercase letters"),  # `$` would let it through
        (lambda d: d.update(schedule="every day"), "schedule", "five fields"),
        (lambda d: d.update(schedule={"asset": "s3://x/y"}), "schedule", "gs://"),
        (lambda d: d.update(artifact_root="gs://bucket/../other"), "artifact_root", "'..'"),
        (
            lambda d: d["data"]["expectations"]["row_count"].update(min=0),
            "data.expectations.row_count.min",
            "greater than or equal to 1",
        ),
        (
            lambda d: d["evaluation"].update(answer_pattern="(unclosed"),
            "evaluation.answer_pattern",
            "regular expression",
        ),
        (lambda d: d["evaluation"].update(answer_pattern="no group"), "evaluation.answer_pattern", "capturing group"),
        (lambda d: d["compute"].update(lora_sfft={"launcher": "local"}), "compute", "unknown stage"),
        (lambda d: d["compute"].update(lora_sft={"launcher": "vertex"}), "compute.lora_sft", "needs image"),
        (lambda d: d["compute"].update(lora_sft={"launcher": "local", "hosts": 4}), "compute.lora_sft", "hosts: 1"),
        (lambda d: d["params"].append({"path": "training.nope"}), "(top level)", "training.nope is not a setting"),
        (lambda d: d["params"].append({"path": "lora"}), "(top level)", "is a section"),
        (lambda d: d["training"].update(dtype="float16"), "training.dtype", "float32"),
        (lambda d: d["training"].update(checkpoint_storage="sync"), "training.checkpoint_storage", "'direct'"),
        (lambda d: d["lora"].update(quantization="fp8"), "lora.quantization", "write float8_e4m3fn"),
        (lambda d: d["lora"].update(quantization="int3"), "lora.quantization", "'nf4'"),
        (lambda d: d["lora"].update(tile_size=64), "lora", "set quantization"),
        # the tiny model: emb 128, head_dim 64, mlp 256 (loraflow.dev.tinymodel)
        (
            lambda d: d["lora"].update(quantization="nf4", tile_size=128),
            "(top level)",
            "lora.tile_size 128 must divide the dimension each quantized kernel contracts over, but not head_dim 64 "
            "(out); set lora.tile_size to one that divides them all, e.g. 64",
        ),
        (lambda d: d["lora"].update(quantization="int8", tile_size=48), "(top level)", "emb_dim 128 (query, key"),
    ],
)
def test_broken_spec_names_key_and_fix(change, where: str, says: str) -> None:
    data = tiny_data()
    change(data)
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert any(p == where and says in m for p, m in err.value.problems), err.value.problems


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nlora: [unclosed\n")
    with pytest.raises(SpecError) as err:
        load_spec(bad)
    assert "line" in err.value.problems[0][0] and "not valid YAML" in err.value.problems[0][1]


def test_file_name_must_match_pipeline_name(tmp_path: Path) -> None:
    other = tmp_path / "other.yaml"
    other.write_text(TINY.read_text())
    with pytest.raises(SpecError, match="make them match"):
        load_spec(other)


def test_overrides_are_validated_like_the_spec() -> None:
    spec = load_spec(TINY)
    assert with_overrides(spec, {"training.steps": 20}).training.steps == 20
    with pytest.raises(SpecError) as err:
        with_overrides(spec, {"training.steps": 0, "lora.rank": "big"})
    assert {p for p, _ in err.value.problems} == {"training.steps", "lora.rank"}


@pytest.mark.parametrize(
    "uri",
    ["gs://bucket/a/./b", "gs://bucket/a//b", "gs://bucket/./a", "gs://bucket//a", "gs:///a", "gs://", "s3://b/a"],
)
def test_gcs_uris_with_an_empty_or_dot_segment_are_refused(uri: str) -> None:
    data = tiny_data()
    data["data"]["train"] = uri
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert any(p == "data.train" and "write gs://BUCKET/PATH" in m for p, m in err.value.problems), err.value.problems


@pytest.mark.parametrize("uri", ["gs://bucket/a\nb", "gs://bucket/a\x00b", "gs://bucket/a\x7fb"])
def test_gcs_uris_with_a_control_character_are_refused(uri: str) -> None:
    data = tiny_data()
    data["data"]["train"] = uri
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert dict(err.value.problems)["data.train"].endswith("contains a control character; write the path without it")


def test_gcs_uris_lose_their_trailing_slash() -> None:
    data = tiny_data()
    data["base_model"]["hf_checkpoint"] = "gs://bucket/models/tiny/"
    data["data"]["train"] = "gs://bucket/data/train.jsonl"
    spec = validate_spec(data, "x.yaml")
    assert spec.base_model.hf_checkpoint == "gs://bucket/models/tiny"
    assert spec.data.train == "gs://bucket/data/train.jsonl"


def test_a_stage_without_its_own_compute_section_uses_default_then_local() -> None:
    data = tiny_data()
    data["compute"] = {
        "default": {"launcher": "local", "env": {"TF_CPP_MIN_LOG_LEVEL": "1"}},
        "lora_sft": {"launcher": "local"},
    }
    spec = validate_spec(data, "x.yaml")
    assert spec.compute_for("validate_data").env == {"TF_CPP_MIN_LOG_LEVEL": "1"}  # default
    assert spec.compute_for("lora_sft").env == {}  # its own section, not merged with default
    data["compute"] = {}
    assert validate_spec(data, "x.yaml").compute_for("lora_sft").launcher == "local"


def test_a_value_of_the_wrong_type_is_named_with_what_was_given() -> None:
    data = tiny_data()
    data["training"]["steps"] = "many"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    (message,) = [m for p, m in err.value.problems if p == "training.steps"]
    assert "valid integer" in message and "(got 'many')" in message
    assert message[0].islower()  # the hint continues "training.steps: ..."
    data["training"]["steps"] = [1]  # not a string to parse: a type error
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert dict(err.value.problems)["training.steps"] == "input should be a valid integer (got [1])"


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("remat_policy", "gs://b/x", "the value 'gs://b/x' is not one of full, minimal"),
        ("attention", "/etc/x", "the value '/etc/x' is not one of autoselected"),
        ("remat_policy", "a\x01b", "the value 'a\\x01b' is not one of"),
        ("head_dim", 0, "the value 0 is not a whole number from 1 to 1048576"),
        ("head_dim", 64.0, "the value 64.0 is not a whole number"),
        ("float32_logits", 1, "the value 1 is not true or false"),
        ("Scan-Layers", True, "Scan-Layers: is not a MaxText setting name"),
        ("scan_layers", False, "scan_layers: is not on the allow-list"),  # loraflow sets it (the checkpoint's layout)
        ("base_output_directory", "out", "base_output_directory: is not on the allow-list"),
    ],
)
def test_model_overrides_off_the_allow_list_or_of_another_value_are_refused(key: str, value: object, says: str) -> None:
    data = tiny_data()
    data["base_model"]["model_overrides"] = {key: value}
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert any(p.startswith("base_model.model_overrides") and says in m for p, m in err.value.problems), (
        err.value.problems
    )


def test_plain_model_overrides_pass() -> None:
    data = tiny_data()
    data["base_model"]["model_overrides"] = {"remat_policy": "minimal", "attention": "flash", "base_mlp_dim": 256,
                                             "ici_fsdp_parallelism": -1, "float32_logits": True}  # fmt: skip
    assert validate_spec(data, "x.yaml").base_model.model_overrides == data["base_model"]["model_overrides"]


def test_a_spec_that_is_no_mapping_is_refused_as_a_whole() -> None:
    with pytest.raises(SpecError) as err:
        validate_spec(["name: x"], "list.yaml")
    assert err.value.problems == [("(top level)", "a spec is a YAML mapping of keys such as name, base_model, data")]
    assert "list.yaml" in str(err.value)


def test_a_value_that_fits_no_branch_of_a_union_is_reported_at_its_own_key() -> None:
    data = tiny_data()
    data["base_model"]["model_overrides"] = {"scan_layers": [1]}  # str | int | float | bool
    data["params"][0]["minimum"] = "low"  # int | float
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert {p for p, _ in err.value.problems} == {"base_model.model_overrides.scan_layers", "params.0.minimum"}
    assert len(err.value.problems) == 6  # each branch's complaint, once


def test_a_refusal_reads_as_the_rule_and_names_the_value_given() -> None:
    data = tiny_data()
    data["data"]["train"] = "/home/me/x"
    data["training"]["dtype"] = "float16"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    problems = dict(err.value.problems)
    assert problems["data.train"] == "'/home/me/x' is not a GCS URI; write gs://BUCKET/PATH"  # no "Value error, "
    assert problems["training.dtype"] == "Input should be 'float32' or 'bfloat16' (got 'float16')"


def test_a_gcs_uri_names_a_valid_bucket() -> None:
    data = tiny_data()
    data["data"]["train"] = "gs://-bucket/train.jsonl"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert [p for p, _ in err.value.problems] == ["data.train"]


def test_a_gs_uri_ending_in_a_capital_x_keeps_it() -> None:
    """URIs lose a trailing '/' and nothing else (an `rstrip("XX/XX")` mutant of make mutate)."""
    data = tiny_data()
    data["artifact_root"] = "gs://loraflow-demo/runsX/"
    data["data"]["train"] = "gs://loraflow-demo/datasets/trainX"
    spec = validate_spec(data, "x.yaml")
    assert (spec.artifact_root, spec.data.train) == ("gs://loraflow-demo/runsX", "gs://loraflow-demo/datasets/trainX")


MULTI_HOST = {"launcher": "vertex", "image": "i", "machine_type": "ct5lp-hightpu-4t", "tpu_topology": "4x4", "hosts": 4}


def test_a_multi_host_training_stage_takes_either_checkpoint_storage() -> None:
    """Both modes work on hosts that share no disk: staged (every host stages its own shards and uploads
    its part; the step is committed once all have) and direct (Orbax writes gs:// itself)."""
    for storage in ("staged", "direct"):
        data = tiny_data()
        data["compute"]["lora_sft"] = MULTI_HOST
        data["training"]["checkpoint_storage"] = storage
        spec = validate_spec(data, "x.yaml")
        assert spec.training.checkpoint_storage == storage
    # The same holds when the hosts come from the default compute entry, and for trigger overrides.
    data = tiny_data()
    local = {"launcher": "local"}
    data["compute"] = {"default": MULTI_HOST, "validate_data": local, "evaluate_base": local, "evaluate_tuned": local}
    data["training"]["checkpoint_storage"] = "direct"
    spec = validate_spec(data, "x.yaml")
    assert with_overrides(spec, {"training.checkpoint_storage": "staged"}).training.checkpoint_storage == "staged"
    with pytest.raises(SpecError, match="checkpoint_storage"):
        with_overrides(spec, {"training.checkpoint_storage": "local"})


# ------------------------------------------------------------------ numbers, sources (issue 41)


def test_a_number_the_number_check_refuses_is_named_once_beside_every_other_problem() -> None:
    data = tiny_data()
    data["training"]["steps"] = 10**20  # also breaks no pydantic bound: only the number check refuses it
    data["evaluation"]["seed"] = 10**20
    data["lora"]["rank"] = 10**20  # breaks its le=1024 too: said once, by the number check
    data["training"]["batch_size"] = 0
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert err.value.source == "x.yaml"
    too_large = "is too large (got 1e+20); a spec's numbers are at most 9007199254740992 (2**53)"
    assert [(p, m.startswith(too_large)) for p, m in err.value.problems] == [
        ("lora.rank", True), ("training.steps", True), ("evaluation.seed", True),
        ("training.batch_size", False),
    ]  # fmt: skip
    del data["training"]["batch_size"], data["lora"]["rank"], data["training"]["steps"]
    with pytest.raises(SpecError) as err:  # valid to pydantic: refused by the number check alone
        validate_spec(data, "y.yaml")
    assert err.value.source == "y.yaml" and [p for p, _ in err.value.problems] == ["evaluation.seed"]


def test_a_boolean_or_text_for_a_number_says_what_yaml_made_of_it_and_what_to_write() -> None:
    data = tiny_data()
    data["lora"]["alpha"], data["training"]["steps"] = True, "200"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "x.yaml")
    assert dict(err.value.problems) == {
        "lora.alpha": "input should be a valid number (got True): YAML reads true, false, yes, no, on and off as "
        "booleans; write a number such as 0.05",
        "training.steps": "input should be a valid integer (got '200'): text is no number; write a whole number "
        "such as 100, without quotes",
    }


def test_overrides_are_refused_as_trigger_parameters_and_read_as_json_schema_does() -> None:
    spec = load_spec(TINY)
    with pytest.raises(SpecError) as err:
        with_overrides(spec, {"training.steps": 0})
    assert err.value.source == "trigger parameters"
    assert with_overrides(spec, {"training.steps": 300.0}).training.steps == 300  # an integer to JSON Schema
    assert with_overrides(spec, {"lora.alpha": 8.0}).lora.alpha == 8.0
    with pytest.raises(SpecError, match=r"training\.steps"):
        with_overrides(spec, {"training.steps": 300.5})


def test_a_spec_file_is_named_in_its_errors() -> None:
    from loraflow.spec.schema import parse_spec

    with pytest.raises(SpecError) as err:
        parse_spec(TINY.read_bytes(), Path("pipelines/other.yaml"))
    assert err.value.source == "pipelines/other.yaml"
    assert err.value.problems == [("name", "is 'tiny-llama-lora' but the file is other.yaml; make them match")]
    with pytest.raises(SpecError) as err:
        parse_spec(b"name: [", Path("pipelines/broken.yaml"))
    assert err.value.source == "pipelines/broken.yaml"
    with pytest.raises(SpecError) as err:
        parse_spec(TINY.read_bytes().replace(b"steps: 200", b"steps: 0"), Path("pipelines/tiny-llama-lora.yaml"))
    assert err.value.source == "pipelines/tiny-llama-lora.yaml" and [p for p, _ in err.value.problems] == [
        "training.steps"
    ]
