"""Each step's typed config: built from the spec by the planner, parsed by the step, no drift.

A step run by hand with only the pipeline's identity (model, registry, names) must behave like the
same step in a pipeline whose spec leaves every setting out; every knob a step honours is a spec
key or listed as internal (and documented); an unknown key is refused naming it and the known ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from loraflow.errors import LoraflowError
from loraflow.pipeline import plan
from loraflow.spec import step_configs
from loraflow.spec.schema import DataSpec, EvaluationSpec, GateSpec, LoraSpec, PipelineSpec, TrainingSpec, validate_spec
from loraflow.spec.step_configs import STEP_CONFIGS, StepConfig, parse
from loraflow.steps import gate, publish, validate_data

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = {
    "name": "bare",
    "artifact_root": "gs://bucket/artifacts",
    "base_model": {"hf_checkpoint": "gs://bucket/hf", "maxtext_model": "llama3.1-8b"},
    "data": {"train": "gs://bucket/train.jsonl", "eval": "gs://bucket/eval.jsonl"},
}
# What identifies the pipeline rather than tuning a step: the spec has no default for these.
IDENTITY = {"model_name", "model_overrides", "registry_uri", "pipeline", "artifact_root"}
# The spec sections each step's settings come from.
SECTIONS: dict[type[StepConfig], tuple[type[BaseModel], ...]] = {
    step_configs.LoraSftConfig: (LoraSpec, TrainingSpec),
    step_configs.EvaluateConfig: (EvaluationSpec,),
    step_configs.GateConfig: (GateSpec,),
}


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].get_default(call_default_factory=True)


def _bare_spec() -> PipelineSpec:
    return validate_spec(MINIMAL, "bare.yaml")


def _identity(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k in IDENTITY}


@pytest.mark.parametrize("stage", list(STEP_CONFIGS))
def test_a_step_run_by_hand_behaves_like_the_pipeline_with_the_spec_defaults(stage: str) -> None:
    sent = plan.stage_plans(_bare_spec())[stage].config
    by_hand = parse(STEP_CONFIGS[stage], _identity(sent))
    assert by_hand.wire() == sent


@pytest.mark.parametrize(("config_cls", "sections"), list(SECTIONS.items()))
def test_config_defaults_are_the_spec_defaults(config_cls: type[StepConfig], sections: tuple) -> None:
    for section in sections:
        for name in section.model_fields:
            assert name in config_cls.model_fields, f"{config_cls.__name__} lacks spec key {name}"
            assert _default(config_cls, name) == _default(section, name), name


def test_the_drifted_defaults_are_the_specs_now() -> None:
    """The values the steps used to keep for themselves (gate 0.3, training 200 steps at 3e-3, ...)."""
    sft, ev, gt = step_configs.LoraSftConfig(), step_configs.EvaluateConfig(), step_configs.GateConfig()
    assert (sft.steps, sft.learning_rate, sft.max_length, sft.dtype) == (100, 1e-4, 512, "bfloat16")
    assert (ev.max_new_tokens, ev.max_model_len, ev.dtype) == (16, 1024, _default(TrainingSpec, "dtype"))
    assert gt.min_improvement == _default(GateSpec, "min_improvement") == 0.0
    assert step_configs.ValidateDataConfig().expectations == _default(DataSpec, "expectations")


@pytest.mark.parametrize("stage", list(STEP_CONFIGS))
def test_every_knob_is_a_spec_key_or_documented_internal(stage: str) -> None:
    config_cls = STEP_CONFIGS[stage]
    sent = plan.stage_plans(_bare_spec())[stage].config
    # publish.vertex_model_registry, the evaluations' guard_set and suites and lora_sft's tuning are sent only
    # when the spec has them (the bare spec has not)
    only_when_set = {
        "lora_sft": {"tuning"},
        "publish": {"vertex_model_registry"},
        "evaluate_base": {"guard_set", "suites"},
        "evaluate_tuned": {"guard_set", "suites"},
    }
    expected = set(sent) | only_when_set.get(stage, set())
    assert set(config_cls.model_fields) - set(config_cls.INTERNAL) == expected
    assert not set(config_cls.INTERNAL) & set(sent), "internal knobs are never sent (nor in a cache key)"
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for name, why in config_cls.INTERNAL.items():
        assert why, name
        assert f"`{name}`" in architecture, f"{stage}'s internal knob {name} is not in docs/architecture.md"


@pytest.mark.parametrize("stage", list(STEP_CONFIGS))
def test_an_unknown_key_is_refused_naming_it_and_the_known_ones(stage: str) -> None:
    config_cls = STEP_CONFIGS[stage]
    sent = plan.stage_plans(_bare_spec())[stage].config
    with pytest.raises(LoraflowError, match=r"unknown config key\(s\) 'min_improvment'; known: ") as err:
        parse(config_cls, {**sent, "min_improvment": 0.1})
    assert all(name in str(err.value) for name in config_cls.model_fields)
    assert str(err.value).startswith(f"{config_cls.STEP}: ")


def test_the_steps_parse_their_config_with_their_class() -> None:
    with pytest.raises(
        LoraflowError, match=r"gate: unknown config key\(s\) 'min_improvment'; known: .*min_improvement"
    ):
        gate.resolve_config({"min_improvment": 0.1})
    assert gate.resolve_config({}).min_improvement == 0.0
    with pytest.raises(LoraflowError, match=r"publish: unknown config key\(s\) 'registry'"):
        publish.resolve_config({"registry": "gs://b/r", "pipeline": "p", "run_id": "r"}, has_model_input=True)
    with pytest.raises(LoraflowError, match=r"validate_data: unknown config key\(s\) 'expectation'"):
        validate_data.resolve_config({"expectation": {}})


def test_a_bad_value_names_its_key_and_a_missing_required_one_says_so() -> None:
    with pytest.raises(LoraflowError, match=r"lora_sft: invalid config: steps: .*greater than or equal to 1 \(got 0\)"):
        parse(step_configs.LoraSftConfig, {"steps": 0})
    with pytest.raises(LoraflowError, match=r"convert_checkpoint: invalid config: model_name: required; add it"):
        parse(step_configs.ConvertCheckpointConfig, {})
    with pytest.raises(LoraflowError, match=r"merge_adapter: invalid config: shard_size_mb"):
        parse(step_configs.MergeAdapterConfig, {"shard_size_mb": 0})
    with pytest.raises(LoraflowError, match=r"must be a JSON object"):
        parse(step_configs.GateConfig, [1])
