"""What merging a QLoRA adapter cost (loraflow/evaluation/merge_cost.py) and where the report shows it."""

from __future__ import annotations

import pytest

from loraflow.evaluation import merge_cost
from loraflow.reporting import report

CONFIG = {"metrics": ["numeric_accuracy", "tagged_format_rate"], "answer_format": "tagged", "relative_tolerance": 0.1}


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
    cost = merge_cost.compare(quantized, merged, CONFIG)
    assert cost is not None and cost["n"] == 3 and cost["identical_outputs"] == 1
    rows = {r["metric"]: r for r in cost["metrics"]}
    assert list(rows) == ["numeric_accuracy", "tagged_format_rate"]
    assert rows["numeric_accuracy"]["quantized"] == pytest.approx(2 / 3)  # "<answer>7" has no closing tag
    assert rows["numeric_accuracy"]["merged"] == pytest.approx(1 / 3)
    assert rows["numeric_accuracy"]["change"] == pytest.approx(-1 / 3)
    assert rows["tagged_format_rate"]["quantized"] == pytest.approx(2 / 3)
    assert rows["tagged_format_rate"]["merged"] == pytest.approx(2 / 3)


def test_no_shared_examples_is_no_comparison() -> None:
    assert merge_cost.compare([{"id": "9", "output": "x"}], [_merged_row(0, 1, "1", True, True)], CONFIG) is None


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
