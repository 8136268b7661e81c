"""The metric table (loraflow/evaluation/metrics.py): the spec, the gate and the report take their metrics from it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow.errors import SpecError
from loraflow.evaluation import metrics
from loraflow.evaluation.metrics import METRICS
from loraflow.reporting import report
from loraflow.spec.reference import render
from loraflow.spec.schema import load_spec, validate_spec
from loraflow.spec.step_configs import EvaluateConfig
from loraflow.steps import gate
from tests.spec_defaults import decide
from tests.spec_defaults import scoring as spec_scoring

SPEC = Path(__file__).resolve().parents[2] / "pipelines" / "tiny-llama-lora.yaml"


def test_an_unknown_gate_metric_is_refused_naming_the_allowed_ones() -> None:
    data = load_spec(SPEC).model_dump(mode="json")
    data["gate"]["metric"] = "acuracy"
    with pytest.raises(SpecError) as err:
        validate_spec(data, "spec")
    message = str(err.value)
    assert "gate.metric" in message and "'acuracy'" in message
    assert all(name in message for name in METRICS)


@pytest.mark.parametrize("name", list(METRICS))
def test_every_metric_may_be_gated_on(name: str) -> None:
    data = load_spec(SPEC).model_dump(mode="json")
    data["gate"]["metric"] = name
    assert validate_spec(data, "spec").gate.metric == name


def test_the_spec_reference_lists_every_metric_with_what_it_measures() -> None:
    row = next(line for line in render().splitlines() if line.startswith("| `gate.metric`"))
    assert all(f"`{m.name}`: {m.description}" in row for m in METRICS.values())


def test_an_evaluation_scores_every_metric_of_the_table() -> None:
    # Every row can be scored and aggregated (an evaluation scores the ones its spec chooses).
    everything = spec_scoring(metrics=list(METRICS))
    scored = metrics.score_all(["even", "odd", "", "Odd."], ["even", "even", "odd", "odd"], settings=everything)
    aggregated = metrics.aggregate(scored, everything.metrics)
    for m in METRICS.values():
        per_example = aggregated[m.column]
        assert len(per_example) == 4 and aggregated[f"n_{m.column}"] == sum(per_example)
        assert aggregated[m.name] == pytest.approx(sum(per_example) / 4)
    assert aggregated["accuracy"] == pytest.approx(0.5) and aggregated["format_rate"] == pytest.approx(0.75)


def _write_eval(d: Path, columns: dict[str, list[bool]]) -> Path:
    import pandas as pd

    d.mkdir(parents=True)
    n = len(next(iter(columns.values())))
    generations = [f"{d.name} {i}" for i in range(n)]  # base and tuned differ: the adapter did something
    frame = pd.DataFrame({"id": [f"e{i:04d}" for i in range(n)], **columns, "generation": generations})
    frame.to_parquet(d / "predictions.parquet")
    rates = {m.name: sum(columns[m.column]) / n for m in METRICS.values()}
    (d / "metrics.json").write_text(json.dumps({**rates, "n": n}))
    return d


@pytest.mark.parametrize("metric", list(METRICS.values()), ids=list(METRICS))
def test_the_gate_compares_the_column_of_the_spec_metric(
    tmp_path: Path, make_ctx: Callable, metric: metrics.Metric
) -> None:
    # The gated metric's column rises from 0.2 to 0.95; every other metric's column stays put.
    rising = {"b": [False] * 80 + [True] * 20, "t": [True] * 95 + [False] * 5}
    flat = [True] * 50 + [False] * 50
    inputs = {
        f"{side}_eval": _write_eval(
            tmp_path / side, {m.column: rising[side[0]] if m is metric else flat for m in METRICS.values()}
        )
        for side in ("base", "tuned")
    }
    ctx = make_ctx("gate", inputs, {"metric": metric.name, "min_improvement": 0.3})
    summary = gate.run(ctx)
    assert summary["promote"] is True and summary["metric"] == metric.name
    assert summary["base"] == pytest.approx(0.2) and summary["tuned"] == pytest.approx(0.95)
    assert json.loads((ctx.out / "decision.json").read_text())["metric"] == metric.name


def test_a_metric_where_lower_is_better_promotes_on_a_fall() -> None:
    base = {f"e{i}": i < 60 for i in range(200)}  # 0.30
    tuned = {f"e{i}": i < 10 for i in range(200)}  # 0.05
    d = decide(base, tuned, metric="error_rate", min_improvement=0.1, higher_is_better=False)
    assert d.promote and d.delta == pytest.approx(0.25) and d.fixed == 50 and d.broken == 0
    assert "error_rate fell by +0.250 (0.300 -> 0.050)" in d.reason
    assert not decide(tuned, base, metric="error_rate", min_improvement=0.1, higher_is_better=False).promote


def test_the_report_shows_every_metric_of_the_table() -> None:
    data = {
        "base_metrics": {**{name: 0.25 for name in METRICS}, "n": 4},
        "tuned_metrics": {**{name: 0.75 for name in METRICS}, "n": 4},
        "stages": [],
    }
    page = report.render(data)
    section = page[page.index('<section id="metrics">') :]
    section = section[: section.index("</section>")]
    for name in METRICS:
        assert f"<td>{name}</td>" in section
    assert section.count("+0.500") == len(METRICS)


# ------------------------------------------------------------------ the scoring keys of the spec


def test_the_scoring_keys_default_to_the_old_behaviour() -> None:
    evaluation = load_spec(SPEC).evaluation
    assert evaluation.metrics == ["accuracy", "format_rate"]
    assert evaluation.answer_format == "pattern" and evaluation.relative_tolerance == 0.1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("relative_tolerance", 1.5, "evaluation.relative_tolerance"),
        ("relative_tolerance", -0.1, "evaluation.relative_tolerance"),
        ("answer_format", "xml", "evaluation.answer_format"),
        ("metrics", ["accuracy", "acuracy"], "unknown metric 'acuracy'"),
        ("metrics", ["accuracy", "accuracy"], "named twice: accuracy"),
        ("metrics", [], "evaluation.metrics"),
    ],
)
def test_a_bad_scoring_key_is_refused(key: str, value: object, message: str) -> None:
    data = load_spec(SPEC).model_dump(mode="json")
    data["evaluation"][key] = value
    with pytest.raises(SpecError, match=message):
        validate_spec(data, "spec")


def test_the_scoring_keys_reach_the_scorer_through_the_evaluate_config() -> None:
    data = load_spec(SPEC).model_dump(mode="json")
    data["evaluation"].update(
        {"metrics": ["numeric_accuracy", "tagged_format_rate"], "answer_format": "tagged", "relative_tolerance": 0.25}
    )
    data["gate"]["metric"] = "approx_accuracy"
    cfg = EvaluateConfig.from_spec(validate_spec(data, "spec"))
    # The gate's metric is scored too, whatever evaluation.metrics says.
    assert cfg.metrics == ["numeric_accuracy", "tagged_format_rate", "approx_accuracy"]
    settings = metrics.Scoring.of(cfg)
    assert [m.name for m in settings.chosen] == ["numeric_accuracy", "approx_accuracy", "tagged_format_rate"]
    reference = "<reasoning>2 + 2 = 4</reasoning><answer>4</answer>"
    got = metrics.score("<reasoning>2 + 2 = 5</reasoning><answer>5</answer>", reference, settings=settings)
    assert got.answer == "5"
    assert got.outcomes == {"numeric_correct": False, "approx_correct": True, "tagged_format_ok": True}


def test_a_spec_gating_on_a_default_metric_scores_the_defaults() -> None:
    cfg = EvaluateConfig.from_spec(load_spec(SPEC))
    assert cfg.metrics == ["accuracy", "format_rate"]
    assert [m.name for m in metrics.Scoring.of(cfg).chosen] == ["accuracy", "format_rate"]


@pytest.mark.parametrize("metric", list(METRICS.values()), ids=list(METRICS))
def test_the_report_samples_are_fixed_or_broken_by_the_gated_metric(metric: metrics.Metric) -> None:
    def row(i: int, ok: bool, generation: str) -> dict:
        others = {m.column: not ok for m in METRICS.values()}  # every other metric says the opposite
        return {"id": f"e{i}", "prompt": "p", "reference": "r", "generation": generation, **others, metric.column: ok}

    base = [row(0, False, "a"), row(1, True, "b")]
    tuned = [row(0, True, "c"), row(1, False, "d")]
    samples = report.sample_outputs(base, tuned, column=metric.column)
    assert [s["id"] for s in samples["fixed"]] == ["e0"] and [s["id"] for s in samples["broken"]] == ["e1"]


TAGGED = spec_scoring(metrics=["tagged_format_rate", "approx_accuracy"], answer_format="tagged")


@pytest.mark.parametrize(
    ("generation", "ok"),
    [
        ("<reasoning>3 + 4</reasoning><answer>7</answer>", True),
        ("  <reasoning>3 + 4</reasoning> so <answer>7</answer>\n", True),  # whitespace around, text between
        ("So: <reasoning>3 + 4</reasoning><answer>7</answer>", False),  # text before <reasoning>
        ("<reasoning>3 + 4</reasoning><answer>7</answer> and 8", False),  # text after </answer>
        ("x<reasoning>3 + 4</reasoning><answer>7</answer>y", False),
    ],
    ids=["plain", "whitespace", "before", "after", "both"],
)
def test_the_tagged_format_check_is_anchored_at_both_ends(generation: str, ok: bool) -> None:
    """tagged_format_rate counts only generations that are the tutorial's layout from the first character to
    the last (the evaluate step scores with these settings; the control suite pins it, not only tests/serving)."""
    scored = metrics.score(generation, "<reasoning>r</reasoning><answer>7</answer>", settings=TAGGED)
    assert scored.outcomes["tagged_format_ok"] is ok


@pytest.mark.parametrize(
    ("answer", "reference", "close"),
    [
        ("90", "100", True),  # 10 off, 10 % of the reference: within (10 % of the answer, 9, is not)
        ("111", "100", False),  # 11 off: beyond 10 % of the reference (10 % of the answer, 11.1, is not)
        ("-91", "-100", True),  # |reference| is the base, whatever the signs
        ("-110", "-100", True),
        ("-111", "-100", False),
        ("0.5", "0", False),  # a reference of 0 needs exactly 0
    ],
)
def test_approx_accuracys_tolerance_is_relative_to_the_reference(answer: str, reference: str, close: bool) -> None:
    tagged = f"<reasoning>r</reasoning><answer>{answer}</answer>"
    scored = metrics.score(tagged, f"<answer>{reference}</answer>", settings=TAGGED)
    assert scored.outcomes["approx_correct"] is close
