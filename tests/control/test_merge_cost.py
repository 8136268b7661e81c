"""What merging a QLoRA adapter cost (loraflow/evaluation/merge_cost.py) and where the report shows it."""

from __future__ import annotations

import pytest

from loraflow.errors import ArtifactError
from loraflow.evaluation import merge_cost
from loraflow.evaluation.metrics import Scoring
from loraflow.reporting import report

# What evaluate_tuned's metrics.json records of its config (the scoring settings among the rest).
CONFIG = {
    "metrics": ["numeric_accuracy", "tagged_format_rate"],
    "answer_pattern": r"^\s*([^\s<]+)",
    "answer_format": "tagged",
    "relative_tolerance": 0.1,
    "max_new_tokens": 64,
}
SETTINGS = Scoring.recorded(CONFIG, "evaluate_tuned's metrics.json")


def _tagged(n: int) -> str:
    return f"<reasoning>x</reasoning><answer>{n}</answer>"


def _merged_row(i: int, reference: int, output: str, numeric: bool, tagged: bool) -> dict:
    return {
        "id": str(i),
        "reference": _tagged(reference),
        "generation": output,
        "numeric_correct": numeric,
        "tagged_format_ok": tagged,
    }


def test_scores_the_trainers_answers_with_the_evaluations_settings_on_the_shared_examples() -> None:
    merged = [
        _merged_row(0, 3, _tagged(3), True, True),
        _merged_row(1, 5, _tagged(4), False, True),
        _merged_row(2, 7, "7", False, False),
        _merged_row(3, 9, _tagged(9), True, True),  # the trainer did not answer this one
    ]
    quantized = [
        {"id": "0", "output": _tagged(3)},  # right, same as merged
        {"id": "1", "output": _tagged(5)},  # right where merged was wrong
        {"id": "2", "output": "<answer>7"},  # right number, broken format
    ]
    cost = merge_cost.compare(quantized, merged, SETTINGS)
    assert cost is not None and cost["n"] == 3 and cost["identical_outputs"] == 1
    rows = {r["metric"]: r for r in cost["metrics"]}
    assert list(rows) == ["numeric_accuracy", "tagged_format_rate"]
    assert rows["numeric_accuracy"]["quantized"] == pytest.approx(2 / 3)  # "<answer>7" has no closing tag
    assert rows["numeric_accuracy"]["merged"] == pytest.approx(1 / 3)
    assert rows["numeric_accuracy"]["change"] == pytest.approx(-1 / 3)
    assert rows["tagged_format_rate"]["quantized"] == pytest.approx(2 / 3)
    assert rows["tagged_format_rate"]["merged"] == pytest.approx(2 / 3)


def test_no_shared_examples_is_no_comparison() -> None:
    assert merge_cost.compare([{"id": "9", "output": "x"}], [_merged_row(0, 1, "1", True, True)], SETTINGS) is None


def test_the_settings_are_the_recorded_ones_and_a_missing_one_is_refused_not_guessed() -> None:
    """They were read with fallbacks of their own (the default metrics, "pattern", 0.1): a metrics.json that
    did not record a setting was scored with a value the evaluation never used."""
    assert SETTINGS == Scoring(("numeric_accuracy", "tagged_format_rate"), r"^\s*([^\s<]+)", "tagged", 0.1)
    assert Scoring.recorded(CONFIG | {"relative_tolerance": 0.5}, "x").relative_tolerance == 0.5
    partial = {k: v for k, v in CONFIG.items() if k not in ("answer_format", "relative_tolerance")}
    with pytest.raises(ArtifactError, match=r"^evaluate_tuned's metrics.json records no answer_format, "
                       r"relative_tolerance in its config; re-run the evaluate stage$"):  # fmt: skip
        Scoring.recorded(partial, "evaluate_tuned's metrics.json")


def test_the_report_shows_the_comparison_under_before_and_after() -> None:
    cost = {
        "n": 100,
        "identical_outputs": 97,
        "metrics": [{"metric": "numeric_accuracy", "quantized": 0.99, "merged": 0.98, "change": -0.01}],
    }
    base = {"numeric_accuracy": 0.0, "n": 400}
    tuned = {"numeric_accuracy": 0.98, "n": 400}
    page = report.render({"base_metrics": base, "tuned_metrics": tuned, "merge_cost": cost})
    assert "What merging cost (QLoRA)" in page and "97" in page and "-0.010" in page
    assert "What merging cost" not in report.render({"base_metrics": base, "tuned_metrics": tuned})
