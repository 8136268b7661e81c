"""Standard benchmarks (evaluation.suites): the spec's rules, a staged task's confinement, the LM wrapper's
request translation and the guard on a suite (the vLLM side: tests/serving/test_evaluate.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from loraflow.errors import SpecError
from loraflow.evaluation import gate_rule, suites
from loraflow.evaluation.gate_rule import GateError
from loraflow.evaluation.suites import SuiteError
from loraflow.pipeline import plan
from loraflow.spec.schema import validate_spec
from loraflow.steps import gate
from tests.spec_defaults import GATE

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "pipelines" / "tiny-llama-lora.yaml"
SERVING_TASKS = ROOT / "tests" / "serving" / "suite_tasks"
GSM8K = {"name": "gsm8k", "task": "gsm8k", "metric": "exact_match,strict-match", "limit": 50}
STAGED = {
    "name": "parity",
    "task": "parity_gen",
    "source": "gs://team/suites/parity",
    "metric": "exact_match,first-word",
}


def _spec(suite_list: list[Any], guard: Any = None) -> dict[str, Any]:
    data = yaml.safe_load(TINY.read_text())
    data["evaluation"]["suites"] = suite_list
    data["gate"]["guard"] = guard
    return data


# ------------------------------------------------------------------------------------ spec and plan


def test_suites_are_planned_into_both_evaluations_a_staged_one_as_an_input() -> None:
    plans = plan.stage_plans(validate_spec(_spec([GSM8K, STAGED], {"suite": "gsm8k", "max_drop": 0.02}), "s.yaml"))
    for stage in ("evaluate_base", "evaluate_tuned"):
        sent = plans[stage].config["suites"]
        assert [s["name"] for s in sent] == ["gsm8k", "parity"]
        assert sent[1]["source"] == "gs://team/suites/parity/"  # a folder, whatever the spec wrote
        assert plans[stage].inputs["suite_parity"] == plan.Source("gs://team/suites/parity/")
        assert "suite_gsm8k" not in plans[stage].inputs  # lm-eval's own task: no staged folder
    assert plans["gate"].config["guard"]["suite"] == "gsm8k"
    assert "set" not in plans["gate"].config["guard"]  # a guard on a set keeps its cache key: no "suite" either


def test_without_suites_the_evaluations_keep_their_cache_keys() -> None:
    plans = plan.stage_plans(validate_spec(_spec([]), "s.yaml"))
    assert "suites" not in plans["evaluate_base"].config


def test_the_spec_refuses_bad_suites_naming_each_problem_and_the_fix() -> None:
    bad = [
        {"name": "GSM", "task": "gsm8k", "metric": "exact_match"},
        {"name": "gsm8k", "task": "gsm8k; rm", "metric": "acc,none", "source": "/home/me/tasks"},
        {"name": "gsm8k", "task": "gsm8k", "metric": "acc,none", "limit": 0},
    ]
    with pytest.raises(SpecError) as err:
        validate_spec(_spec(bad), "s.yaml")
    message = str(err.value)
    assert "evaluation.suites.0.name: 'GSM' is not a suite name" in message
    assert "write METRIC,FILTER as lm-eval reports it (exact_match,strict-match; acc,none)" in message
    assert "'gsm8k; rm' is not an lm-eval task name" in message
    assert "evaluation.suites.1.source" in message and "write gs://BUCKET/PATH" in message
    assert "evaluation.suites.2.limit" in message
    with pytest.raises(SpecError, match="suite name\\(s\\) gsm8k listed twice; give each suite its own name"):
        validate_spec(_spec([GSM8K, GSM8K]), "s.yaml")


def test_a_guard_names_a_set_or_a_scored_suite() -> None:
    with pytest.raises(SpecError, match=r"gate\.guard\.suite 'mmlu' is not one of evaluation\.suites \(gsm8k\)"):
        validate_spec(_spec([GSM8K], {"suite": "mmlu"}), "s.yaml")
    with pytest.raises(SpecError, match="name either set \\(a guard set\\) or suite"):
        validate_spec(_spec([GSM8K], {"suite": "gsm8k", "set": "general-mc-v1"}), "s.yaml")
    with pytest.raises(SpecError, match="name either set \\(a guard set\\) or suite"):
        validate_spec(_spec([GSM8K], {"max_drop": 0.1}), "s.yaml")


def test_the_production_specs_name_gsm8k() -> None:
    for path in sorted((ROOT / "pipelines").glob("*.yaml")):
        if path.name.startswith("tiny-"):
            continue
        spec = validate_spec(yaml.safe_load(path.read_text()), path.name)
        assert "gsm8k" in [s.task for s in spec.evaluation.suites], path.name


# ------------------------------------------------------------------------------------ a staged task


def _task(folder: Path, text: str, name: str = "t") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text(json.dumps({"q": "1+1", "a": "2"}) + "\n")
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


GOOD = """task: t
dataset_path: json
dataset_kwargs:
  data_files:
    test: docs.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{q}}"
doc_to_target: "{{a}}"
"""


def test_a_staged_task_is_handed_over_with_its_data_files_inside_its_folder(tmp_path: Path) -> None:
    config = suites.task_config(_task(tmp_path / "suite", GOOD), "t")
    assert config["dataset_kwargs"] == {"data_files": {"test": [str(tmp_path / "suite" / "docs.jsonl")]}}
    assert config["doc_to_text"] == "{{q}}"
    shipped = suites.task_config(SERVING_TASKS / "parity_mc.yaml", "parity_mc")
    assert shipped["output_type"] == "multiple_choice"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            GOOD + "process_docs: !function utils.process\n",
            r"^suite task t\.yaml uses a YAML tag \(could not determine a constructor for the tag '!function'\); "
            r"'!function' imports Python and loraflow runs no code from a spec: write the step as a Jinja template or "
            r"a filter in the YAML$",
        ),
        (GOOD + "include: ../../lm_eval/tasks/gsm8k/gsm8k.yaml\n", "'include' is refused"),
        (GOOD + "unsafe_code: true\n", "'unsafe_code' is refused"),
        (
            GOOD.replace("dataset_path: json", "dataset_path: openai/gsm8k"),
            r"^suite task t\.yaml: dataset_path must be one of json, csv, parquet \(files staged beside the YAML; "
            r"nothing is downloaded at run time\), not 'openai/gsm8k'$",
        ),
        (GOOD.replace("test: docs.jsonl", "test: ../docs.jsonl"), "must be a path relative to the task's folder"),
        (GOOD.replace("test: docs.jsonl", "test: /etc/passwd"), "must be a path relative to the task's folder"),
        (
            GOOD.replace("test: docs.jsonl", "test: other.jsonl"),
            r"^suite task t\.yaml: data file 'other\.jsonl' is not staged beside the task YAML$",
        ),
        (GOOD.replace("dataset_kwargs:\n  data_files:\n    test: docs.jsonl\n", ""), "data_files: .*only .got None"),
        (
            GOOD.replace("output_type: generate_until", "output_type: loglikelihood_rolling"),
            r"^suite task t\.yaml: output_type 'loglikelihood_rolling' is not scored by loraflow; use one of: "
            r"generate_until, multiple_choice, loglikelihood$",
        ),
        (GOOD.replace("test: docs.jsonl", "test: sub\\docs.jsonl"), "must be a path relative to the task's folder"),
        (GOOD.replace("test: docs.jsonl", "test: 3"), "data file 3 must be a path relative"),
        (GOOD.replace("    test: docs.jsonl", "    test: [docs.jsonl, other.jsonl]"), "'other.jsonl' is not staged"),
        (GOOD.replace("  data_files:\n    test: docs.jsonl", "  data_files: docs.jsonl"), "data_files: .*only"),
        (GOOD.replace("dataset_kwargs:\n  data_files:\n    test: docs.jsonl", "dataset_kwargs: [1]"), "only"),
        (GOOD.replace("task: t", "task: u"), "defines task 'u', not 't'"),
        (GOOD + "dataset_name: main\n", "dataset_path must be one of"),
        (GOOD.replace("  data_files:", "  trust_remote_code: true\n  data_files:"), "data_files: .*only"),
        ("[1, 2]", "is not a task"),
        ("task: [", r"^suite task t\.yaml is not valid YAML: while parsing a flow node$"),
        (GOOD + "x: " + "[" * 17 + "]" * 17 + "\n", "^suite task t\\.yaml nests deeper than 16 levels$"),
    ],
)
def test_a_staged_task_that_would_run_code_or_read_elsewhere_is_refused(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(SuiteError, match=message):
        suites.task_config(_task(tmp_path / "suite", text), "t")


def test_a_huge_task_file_is_refused_unread(tmp_path: Path) -> None:
    path = _task(tmp_path, GOOD + "#" * suites.MAX_TASK_BYTES)
    with pytest.raises(SuiteError, match="larger than 256 KiB"):
        suites.task_config(path, "t")
    path.write_text(GOOD + "#" * (suites.MAX_TASK_BYTES - len(GOOD) - 1) + "\n")  # exactly the bound: read
    assert suites.task_config(path, "t")["task"] == "t"


def test_a_task_at_the_limits_is_read_and_one_that_is_not_text_is_refused(tmp_path: Path) -> None:
    deep = _task(tmp_path / "a", GOOD + "x: " + "[" * 16 + "]" * 16 + "\n")  # 16 levels below the task
    assert suites.task_config(deep, "t")["x"] == [[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]
    two = _task(tmp_path / "b", GOOD.replace("    test: docs.jsonl", "    test: [docs.jsonl, docs.jsonl]"))
    assert suites.task_config(two, "t")["dataset_kwargs"]["data_files"]["test"] == [str(two.parent / "docs.jsonl")] * 2
    binary = _task(tmp_path / "c", "")
    binary.write_bytes(GOOD.encode() + b"doc_to_choice: \xff\n")
    with pytest.raises(SuiteError, match=r"^suite task t\.yaml is not UTF-8 text \(byte 182\)$"):
        suites.task_config(binary, "t")


# ------------------------------------------------------------------------------------ request translation


def test_generation_settings_become_stop_strings_and_a_budget() -> None:
    request = suites.generation_request({"until": ["Question:", "</s>"], "max_gen_toks": 32}, "<|end|>", 16)
    assert request == suites.GenerationRequest(["Question:", "</s>", "<|end|>"], 32)
    assert suites.generation_request({"until": "\n\n"}, "<|end|>", 16) == suites.GenerationRequest(
        ["\n\n", "<|end|>"], 16
    )
    assert suites.generation_request(
        {"until": ["<|end|>"], "do_sample": False, "temperature": 0.0}, "<|end|>", 8
    ).stop == ["<|end|>"]
    assert suites.generation_request({}, "", 8) == suites.GenerationRequest([], 8)
    assert suites.generation_request({"max_gen_toks": 1}, "", 8).max_tokens == 1  # one token is a budget


@pytest.mark.parametrize(
    ("gen_kwargs", "message"),
    [
        ({"do_sample": True}, "^a suite is scored greedily, as the eval set: set do_sample: false and temperature: 0$"),
        ({"temperature": 0.7}, "scored greedily"),
        (
            {"top_p": 0.9},
            r"^generation_kwargs \['top_p'\] are not supported; a suite may set until, max_gen_toks, do_sample, "
            r"temperature$",
        ),
        ({"until": [""]}, "until must be strings"),
        ({"until": [3]}, "until must be strings"),
        ({"max_gen_toks": -2}, "at least 1"),
        ({"max_gen_toks": 0.5}, "at least 1"),
    ],
)
def test_generation_settings_loraflow_does_not_score_are_refused(gen_kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SuiteError, match=message):
        suites.generation_request(gen_kwargs, "<|end|>", 8)


def test_a_generation_is_cut_at_its_first_stop_string() -> None:
    assert suites.cut_at_stops("42\nQuestion: next", ["Question:", "\n"]) == "42"
    assert suites.cut_at_stops("42 Question:", ["Question:"]) == "42 "
    assert suites.cut_at_stops("42", ["Question:"]) == "42"
    assert suites.cut_at_stops("42 Question: 7 Question: 8", ["Question:"]) == "42 "  # the first, not the last
    assert suites.cut_at_stops("Question: 7", ["Question:"]) == ""  # a stop at the start leaves nothing


def test_a_continuation_scores_its_own_tokens_after_the_context() -> None:
    tokens = [1, 5, 7, 9]
    logprobs = [None, {5: -0.5, 6: -1.0}, {7: -0.25, 8: -2.0}, {9: -3.0, 4: -0.1}]
    assert suites.continuation_score(logprobs, tokens, 2) == (-3.25, False)  # 9 was not the likeliest
    assert suites.continuation_score(logprobs, tokens, 3) == (-3.0, False)
    assert suites.continuation_score(logprobs[:3], tokens[:3], 1) == (-0.75, True)
    assert suites.continuation_score(logprobs, tokens, 4) == (0.0, True)  # an empty continuation
    with pytest.raises(SuiteError, match="3 prompt log-probabilities for 4 tokens"):
        suites.continuation_score(logprobs[:3], tokens, 2)
    with pytest.raises(SuiteError, match="continuation from 0"):
        suites.continuation_score(logprobs, tokens, 0)


# ------------------------------------------------------------------------------------ results and the guard


def _samples(values: list[float], filter_name: str = "strict-match") -> list[dict[str, Any]]:
    return [{"doc_id": i, "filter": filter_name, "exact_match": v} for i, v in enumerate(values)]


def test_a_suite_result_is_its_metric_and_each_documents_value_in_document_order() -> None:
    results = {"gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1}}
    samples = _samples([0.0] * 12) + _samples([1.0] * 12, "flexible-extract")
    samples[10]["exact_match"] = 1.0
    samples[2]["exact_match"] = 1.0
    entry = suites.suite_result("gsm8k", "exact_match,strict-match", results, samples)
    assert entry["task"] == "gsm8k" and entry["metric"] == "exact_match,strict-match"
    assert entry["value"] == 0.25 and entry["stderr"] == 0.1 and entry["n"] == 12
    assert entry["ids"] == [str(i) for i in range(12)]  # 2 before 10
    assert entry["values"] == [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0]
    with pytest.raises(SuiteError, match=r"reports no 'acc,none'; it reports: exact_match,strict-match$"):
        suites.suite_result("gsm8k", "acc,none", results | {"gsm8k": results["gsm8k"] | {"alias": "gsm8k"}}, samples)
    two = {"gsm8k": results["gsm8k"] | {"exact_match,flexible-extract": 0.5}}
    with pytest.raises(SuiteError, match=r"it reports: exact_match,flexible-extract, exact_match,strict-match$"):
        suites.suite_result("gsm8k", "acc,none", two, samples)
    with pytest.raises(SuiteError, match=r"reports no 'acc,none'; it reports: nothing$"):
        suites.suite_result("gsm8k", "acc,none", {}, samples)
    for stderr in ("N/A", float("nan")):  # lm-eval without bootstrap iterations; a single document
        unknown = {"gsm8k": results["gsm8k"] | {"exact_match_stderr,strict-match": stderr}}
        assert suites.suite_result("gsm8k", "exact_match,strict-match", unknown, samples)["stderr"] is None


def _entry(values: list[int], task: str = "gsm8k") -> dict[str, Any]:
    return {
        "task": task,
        "metric": "exact_match,strict-match",
        "ids": [str(i) for i in range(len(values))],
        "values": values,
    }


def _suite_guard(base: dict[str, Any], tuned: dict[str, Any], max_drop: float) -> gate_rule.GuardCheck:
    settings = {name: getattr(GATE, name) for name in ("confidence", "bootstrap_samples", "seed")}
    return gate_rule.suite_guard_check(base, tuned, suite="gsm8k", max_drop=max_drop, rule="estimate", **settings)


def test_a_suite_guard_is_the_paired_guard_over_its_documents() -> None:
    base = _entry([1] * 10 + [0] * 10)
    dropped = _entry([1] * 8 + [0] * 12)  # two documents lost: a drop of 0.1
    check = _suite_guard(base, dropped, 0.05)
    assert not check.passed and check.broken == 2 and check.delta == pytest.approx(-0.1)
    assert "suite gsm8k (gsm8k, exact_match,strict-match)" in check.reason
    assert "more than the allowed 0.050" in check.reason
    assert _suite_guard(base, dropped, 0.1).passed
    assert _suite_guard(base, base, 0.0).passed
    # the gate's bootstrap settings, its seed included: the same interval as the guard on a set of those answers
    as_set = gate_rule.guard_check(
        {str(i): v == 1 for i, v in enumerate(base["values"])},
        {str(i): v == 1 for i, v in enumerate(dropped["values"])},
        max_drop=0.05, rule="estimate", guard_set="x", confidence=GATE.confidence,
        bootstrap_samples=GATE.bootstrap_samples, seed=GATE.seed,
    )  # fmt: skip
    assert check.ci == as_set.ci
    # on 200 documents, 30 fixed and 36 broken, resampling with another seed moves the interval's ends
    mixed_base = _entry([1] * 36 + [0] * 30 + [1] * 70 + [0] * 64)
    mixed_tuned = _entry([0] * 36 + [1] * 30 + [1] * 70 + [0] * 64)
    seeded = [
        gate_rule.guard_check(
            suites.outcomes(mixed_base, "b"), suites.outcomes(mixed_tuned, "t"), max_drop=0.05, rule="estimate",
            guard_set="x", confidence=GATE.confidence, bootstrap_samples=GATE.bootstrap_samples, seed=seed,
        ).ci
        for seed in (GATE.seed, GATE.seed + 1)
    ]  # fmt: skip
    assert seeded[0] != seeded[1] and _suite_guard(mixed_base, mixed_tuned, 0.05).ci == seeded[0]


def test_a_suite_guard_refuses_what_cannot_be_paired() -> None:
    with pytest.raises(
        GateError,
        match=r"^the evaluations scored suite gsm8k differently \(base gsm8k exact_match,strict-match, tuned "
        r"gsm8k_cot exact_match,strict-match\); re-run both evaluations with this spec$",
    ):
        _suite_guard(_entry([1, 0]), _entry([1, 0], task="gsm8k_cot"), 0.05)
    flexible = _entry([1, 0]) | {"metric": "exact_match,flexible-extract"}
    with pytest.raises(GateError, match=r"\(base gsm8k exact_match,strict-match, tuned gsm8k exact_match,flexible"):
        _suite_guard(_entry([1, 0]), flexible, 0.05)
    with pytest.raises(
        SuiteError,
        match=r"^base_eval suite gsm8k: metric exact_match,strict-match is not right/wrong per document \(values "
        r"other than 0 and 1\); a guard needs such a metric \(exact_match, acc\)$",
    ):
        _suite_guard(_entry([1, 0.5]), _entry([1, 0]), 0.05)
    with pytest.raises(SuiteError, match=r"^tuned_eval suite gsm8k: the suite's ids and values are missing or of"):
        _suite_guard(_entry([1, 0]), _entry([1, 0]) | {"values": [1]}, 0.05)
    with pytest.raises(SuiteError, match="ids and values are missing"):
        _suite_guard({k: v for k, v in _entry([1, 0]).items() if k != "ids"}, _entry([1, 0]), 0.05)
    with pytest.raises(GateError, match="cover different examples"):
        _suite_guard(_entry([1, 0]), _entry([1, 0, 1]), 0.05)


def test_the_shipped_gsm8k_task_is_accepted_once_its_data_is_staged_beside_it(tmp_path: Path) -> None:
    staged = tmp_path / "gsm8k"
    staged.mkdir()
    (staged / "gsm8k.yaml").write_text((ROOT / "pipelines" / "suites" / "gsm8k" / "gsm8k.yaml").read_text())
    row = json.dumps({"question": "2+2?", "answer": "2+2=4\n#### 4"}) + "\n"
    for split in ("test", "train"):
        (staged / f"{split}.jsonl").write_text(row)
    config = suites.task_config(staged / "gsm8k.yaml", "gsm8k")
    assert config["dataset_kwargs"]["data_files"]["train"] == [str(staged / "train.jsonl")]
    assert [f["name"] for f in config["filter_list"]] == ["strict-match", "flexible-extract"]


def _evaluation(folder: Path, task_pattern: str, suites_scored: dict[str, Any]) -> Path:
    """An evaluate-shaped directory: predictions and metrics.json with its suites."""
    import pandas as pd

    folder.mkdir(parents=True)
    correct = [c == "1" for c in task_pattern]
    ids = [f"eval-{i:04d}" for i in range(len(correct))]
    pd.DataFrame({"id": ids, "correct": correct, "generation": [f"g{c}" for c in correct]}).to_parquet(
        folder / "predictions.parquet"
    )
    metrics = {"accuracy": sum(correct) / len(correct), "n": len(correct), "suites": suites_scored}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def _no_suite(side: str) -> str:
    """The gate's refusal, whole, of an evaluation (``side``: base_eval or tuned_eval) that scored no gsm8k."""
    return (
        rf"^{side}: the evaluation scored no suite 'gsm8k', but gate.guard.suite asks for it; re-run its "
        r"evaluate stage with this spec \(evaluation.suites is part of its cache key\)$"
    )


def test_the_gate_step_refuses_a_model_that_lost_ground_on_a_guarding_suite(tmp_path: Path, make_ctx: Callable) -> None:
    config = {"min_improvement": 0.3, "guard": {"suite": "gsm8k", "max_drop": 0.05}}
    base = {"gsm8k": _entry([1] * 60 + [0] * 40)}
    inputs = {
        "base_eval": _evaluation(tmp_path / "b", "0" * 80 + "1" * 20, base),
        "tuned_eval": _evaluation(tmp_path / "t", "1" * 95 + "0" * 5, {"gsm8k": _entry([1] * 45 + [0] * 55)}),
    }
    ctx = make_ctx("gate", inputs, config)
    summary = gate.run(ctx)
    assert summary["promote"] is False and summary["guard"] == {"passed": False, "delta": pytest.approx(-0.15)}
    decision = json.loads((ctx.out / "decision.json").read_text())
    assert decision["guard"]["set"] == "suite gsm8k (gsm8k, exact_match,strict-match)"
    assert decision["guard"]["broken"] == 15 and decision["delta"] == pytest.approx(0.75)
    assert "but the regression guard failed: guard suite gsm8k" in decision["reason"]
    inputs["tuned_eval"] = _evaluation(tmp_path / "t2", "1" * 95 + "0" * 5, {"gsm8k": _entry([1] * 58 + [0] * 42)})
    assert gate.run(make_ctx("gate", inputs, config))["promote"] is True
    inputs["tuned_eval"] = _evaluation(tmp_path / "t3", "1" * 95 + "0" * 5, {})
    with pytest.raises(GateError, match=_no_suite("tuned_eval")):
        gate.run(make_ctx("gate", inputs, config))


def test_the_gate_steps_suite_guard_takes_the_specs_settings_and_names_an_evaluation_without_the_suite(
    tmp_path: Path, make_ctx: Callable
) -> None:
    """The guard recorded in decision.json is the suite guard with the gate's own settings (each differing from
    its default: rule, max_drop, confidence, bootstrap samples, seed); a base evaluation that scored no such suite
    is named as the one to re-run."""
    settings = {"confidence": 0.8, "bootstrap_samples": 300, "seed": 7}
    config = {"min_improvement": 0.3, "guard": {"suite": "gsm8k", "max_drop": 0.2, "rule": "interval"}, **settings}
    base_values, tuned_values = [1, 0] * 20, [1, 1, 0, 0] * 10  # the same accuracy, answers moved: a wide interval
    inputs = {
        "base_eval": _evaluation(tmp_path / "b", "0" * 20 + "1" * 20, {"gsm8k": _entry(base_values)}),
        "tuned_eval": _evaluation(tmp_path / "t", "1" * 40, {"gsm8k": _entry(tuned_values)}),
    }
    ctx = make_ctx("gate", inputs, config)
    gate.run(ctx)
    recorded = json.loads((ctx.out / "decision.json").read_text())["guard"]
    expected = gate_rule.suite_guard_check(
        _entry(base_values), _entry(tuned_values), suite="gsm8k", max_drop=0.2, rule="interval", **settings
    )
    assert recorded == expected.as_dict()
    assert recorded["seed"] == 7 and recorded["bootstrap_samples"] == 300 and recorded["rule"] == "interval"
    default_seed = gate_rule.suite_guard_check(
        _entry(base_values), _entry(tuned_values), suite="gsm8k", max_drop=0.2, rule="interval",
        **(settings | {"seed": GATE.seed}),
    )  # fmt: skip
    assert default_seed.ci != expected.ci  # the seed is not the default's by accident
    inputs["base_eval"] = _evaluation(tmp_path / "b2", "0" * 20 + "1" * 20, {})
    with pytest.raises(GateError, match=_no_suite("base_eval")):
        gate.run(make_ctx("gate", inputs, config))
