"""The triggerer's lane: a run's conf may set the spec's declared params and nothing else. A key that is no
declared param (a typo such as ``training_step``) fails the run's first task, naming the key and the
nearest declared one, before any stage launches anything or a dataset version is claimed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from loraflow.errors import SpecError
from loraflow.spec.schema import check_trigger_keys, trigger_fields, validate_spec

REPO = Path(__file__).resolve().parents[2]
DATA = yaml.safe_load((REPO / "pipelines" / "tiny-llama-lora.yaml").read_text())
SPEC = validate_spec(DATA, "tiny")
DECLARED = sorted(trigger_fields(SPEC))
DEFAULTS = {name: field["default"] for name, field in trigger_fields(SPEC).items()}


def test_a_typo_is_refused_naming_the_key_and_the_nearest_declared_param() -> None:
    with pytest.raises(SpecError) as err:
        check_trigger_keys(SPEC, [*DEFAULTS, "training_step"])
    [(key, message)] = err.value.problems
    assert key == "training_step"
    assert "did you mean training_steps?" in message
    assert "Trigger parameters: " + ", ".join(DECLARED) in message
    assert "the run's trigger parameters" in str(err.value) and "tiny-llama-lora" in str(err.value)


def test_a_dotted_setting_as_conf_key_is_pointed_at_its_param_name() -> None:
    with pytest.raises(SpecError, match=r"lora\.rank: .*did you mean lora_rank\?"):
        check_trigger_keys(SPEC, ["lora.rank"])


def test_a_pipeline_without_params_refuses_any_conf_key_and_says_so() -> None:
    bare = validate_spec({**DATA, "params": []}, "bare")
    check_trigger_keys(bare, [])
    with pytest.raises(SpecError, match="none: this pipeline declares no params"):
        check_trigger_keys(bare, ["training_steps"])


@given(st.sets(st.sampled_from(DECLARED)), st.sets(st.text(min_size=1, max_size=20)))
def test_exactly_the_keys_that_are_no_declared_param_are_refused(declared: set[str], others: set[str]) -> None:
    unknown = others - set(DECLARED)
    if not unknown:
        check_trigger_keys(SPEC, declared | others)
        return
    with pytest.raises(SpecError) as err:
        check_trigger_keys(SPEC, declared | others)
    assert [key for key, _ in err.value.problems] == sorted(unknown)


# ------------------------------------------------------------------------- at the operators


class FakeTI:
    def xcom_pull(self, task_ids: str) -> Any:
        return None

    def xcom_push(self, key: str, value: Any) -> None:
        pass


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records any attempt to prepare or run a stage (there must be none)."""
    from loraflow.pipeline import runner

    seen: list[str] = []
    for name in ("run_stage", "prepare_stage"):
        monkeypatch.setattr(runner, name, lambda *a, _n=name, **k: seen.append(_n))
    return seen


@pytest.mark.parametrize("stage", ["validate_data", "convert_checkpoint", "lora_sft", "report"])
def test_every_stage_task_fails_on_an_unknown_conf_key_before_it_launches(stage: str, launches: list[str]) -> None:
    from operators.stages import OPERATORS

    op = OPERATORS[stage].for_spec(DATA)
    context = {"params": {**DEFAULTS, "training_step": 5}, "run_id": "manual__1", "ti": FakeTI()}
    with pytest.raises(
        SpecError, match=r"training_step: is not a trigger parameter of this pipeline; did you mean training_steps\?"
    ):
        op.execute(context)
    assert launches == []


def test_resolve_spec_takes_the_declared_keys(launches: list[str]) -> None:
    from operators.stages import resolve_spec

    assert resolve_spec(DATA, {**DEFAULTS, "training_steps": 37}).training.steps == 37
    assert resolve_spec(DATA, {}) == SPEC


def test_pick_dataset_refuses_an_unknown_conf_key_before_it_claims_a_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraflow.pipeline import handoff
    from operators.handoff import PickDatasetOperator

    data = {**DATA, "name": "tiny-handoff", "handoff": {"prefix": "gs://team-data/handoff"}}
    data["data"] = {k: v for k, v in data["data"].items() if k not in ("train", "eval")}
    claims: list[str] = []
    monkeypatch.setattr(handoff, "pick", lambda *a, **k: claims.append("pick"))
    op = PickDatasetOperator(spec=validate_spec(data, "t").model_dump(mode="json"))
    with pytest.raises(SpecError, match=r"gate_min_improvment: .*did you mean gate_min_improvement\?"):
        op.execute({"params": {**DEFAULTS, "gate_min_improvment": 0.1}, "run_id": "manual__1", "ti": FakeTI()})
    assert claims == []


def test_each_param_is_a_trigger_form_field_with_its_value_type_bounds_and_choices() -> None:
    data = yaml.safe_load(yaml.safe_dump(DATA))
    data["params"] = [
        {"path": "training.steps", "description": "optimizer steps", "minimum": 10, "maximum": 2000},
        {"path": "training.learning_rate", "minimum": 0.00001},
        {"path": "training.dtype", "enum": ["float32", "bfloat16"]},
        {"path": "lora.rank"},
    ]
    fields = trigger_fields(validate_spec(data, "tiny"))
    assert fields == {
        "training_steps": {"default": 200, "title": "training.steps", "type": "integer", "minimum": 10,
                           "maximum": 2000, "description": "optimizer steps (minimum 10, maximum 2000)"},
        "training_learning_rate": {"default": 0.003, "title": "training.learning_rate", "type": "number",
                                   "minimum": 1e-05, "description": "overrides training.learning_rate (minimum 1e-05)"},
        "training_dtype": {"default": SPEC.training.dtype, "title": "training.dtype", "type": "string",
                           "enum": ["float32", "bfloat16"], "description": "overrides training.dtype"},
        "lora_rank": {"default": 16, "title": "lora.rank", "type": "integer", "description": "overrides lora.rank"},
    }  # fmt: skip


def test_a_typo_names_the_nearest_param_also_when_written_dotted() -> None:
    with pytest.raises(SpecError) as err:
        check_trigger_keys(SPEC, ["training.step", "lora_rnk", "zzz"])
    hints = {key: message.split("; ")[1].split(" Trigger")[0] for key, message in err.value.problems}
    assert hints == {"training.step": "did you mean training_steps?", "lora_rnk": "did you mean lora_rank?",
                     "zzz": "Trigger parameters: gate_min_improvement, lora_rank, training_learning_rate, "
                            "training_steps. Remove the key from the run's conf, or declare its setting under "
                            "params in the spec"}  # fmt: skip


def test_a_param_for_a_setting_without_a_value_is_a_text_field() -> None:
    data = yaml.safe_load(yaml.safe_dump(DATA))
    data["params"] = [{"path": "base_model.tokenizer"}]
    field = trigger_fields(validate_spec(data, "tiny"))["base_model_tokenizer"]
    assert field["type"] == ["null", "string"] and field["default"] is None


# --------------------------------------------------- values re-checked against their declaration (item 8)


def declaring(*params: dict[str, Any]) -> dict[str, Any]:
    data = yaml.safe_load(yaml.safe_dump(DATA))
    data["params"] = list(params)
    return data


CHOICE = declaring({"path": "training.dtype", "enum": ["float32"]}, {"path": "base_model.tokenizer"},
                   {"path": "training.steps", "minimum": 10, "maximum": 2000})  # fmt: skip
UNBOUNDED = declaring({"path": "training.steps"}, {"path": "lora.alpha"})


@pytest.mark.parametrize(
    ("data", "conf", "says"),
    [
        (DATA, {"training_steps": 1}, "training_steps: 1 is below its minimum 10 (training.steps)"),
        (DATA, {"training_steps": 10**18}, "training_steps: 1000000000000000000 is above its maximum 2000"),
        (DATA, {"training_steps": True}, "training_steps: true is not an integer (training.steps)"),
        (DATA, {"training_steps": "200"}, "training_steps: '200' is not an integer"),
        (DATA, {"training_learning_rate": False}, "training_learning_rate: false is not a number"),
        (DATA, {"lora_rank": 65}, "lora_rank: 65 is above its maximum 64 (lora.rank)"),
        (DATA, {"gate_min_improvement": [0.1]}, "gate_min_improvement: [0.1] is not a number"),
        (DATA, {"gate_min_improvement": None}, "gate_min_improvement: null is not a number"),
        (CHOICE, {"training_dtype": "bfloat16"}, "training_dtype: 'bfloat16' is not one of its enum ('float32')"),
        (CHOICE, {"base_model_tokenizer": 5}, "base_model_tokenizer: 5 is not null or a string"),
        (UNBOUNDED, {"training_steps": True}, "training_steps: true is not an integer"),
        (UNBOUNDED, {"lora_alpha": True}, "lora_alpha: true is not a number"),
    ],
)
def test_resolve_spec_checks_each_value_against_its_declaration(
    data: dict[str, Any], conf: dict[str, Any], says: str, launches: list[str]
) -> None:
    """What Airflow's Param schema checks on a trigger, resolve_spec checks again (a task may be run with
    conf Airflow never validated: a direct call, a DAG parsed from an older spec): JSON Schema's rules,
    true is no number, each bound and choice of the declaration."""
    from operators.stages import resolve_spec

    with pytest.raises(SpecError) as err:
        resolve_spec(data, conf)
    assert any(says in f"{key}: {message}" for key, message in err.value.problems), err.value.problems
    assert "the run's trigger parameters" in str(err.value)
    assert launches == []


def test_resolve_spec_takes_every_value_its_declaration_allows() -> None:
    from operators.stages import resolve_spec

    assert resolve_spec(DATA, {"training_steps": 10}).training.steps == 10
    assert resolve_spec(DATA, {"training_steps": 2000.0}).training.steps == 2000  # JSON Schema: an integer
    assert resolve_spec(DATA, {"training_learning_rate": 0.1}).training.learning_rate == 0.1
    assert resolve_spec(DATA, {"gate_min_improvement": -1}).gate.min_improvement == -1
    assert (
        resolve_spec(CHOICE, {"training_dtype": "float32", "base_model_tokenizer": None}).base_model.tokenizer is None
    )
    tokenizer = "gs://loraflow-demo/sources/tok"
    assert resolve_spec(CHOICE, {"base_model_tokenizer": tokenizer}).base_model.tokenizer == tokenizer


def test_an_error_echoes_at_most_the_start_of_a_huge_value() -> None:
    """A 5 MB conf value (or key) is refused with its first characters and its length, not all of it."""
    from operators.stages import resolve_spec

    huge = "x" * 5_000_000
    for conf in ({"training_learning_rate": huge}, {"training_dtype": huge}, {huge: 1}):
        with pytest.raises(SpecError) as err:
            resolve_spec(CHOICE if "training_dtype" in conf else DATA, conf)
        assert len(str(err.value)) < 2000 and "5000000 characters" in str(err.value), str(err.value)[:300]
    with pytest.raises(SpecError) as err:
        validate_spec({**DATA, "training": {**DATA["training"], "dtype": huge}}, "tiny")
    assert len(str(err.value)) < 2000 and "5000000 characters" in str(err.value)
