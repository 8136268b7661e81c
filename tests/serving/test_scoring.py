"""Unit tests of loraflow.evaluation.scoring and .metrics: extraction, normalisation, format failures, aggregation."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.evaluation import metrics, scoring
from loraflow.evaluation.metrics import ScoredExample


@pytest.mark.parametrize(
    ("generation", "expected"),
    [
        ("even", "even"),
        ("  odd", "odd"),
        ("\neven and more words", "even"),
        ("even<|end|>", "even"),
        ("Odd.", "Odd."),
        ("", None),
        ("   ", None),
        ("<|end|>", None),
    ],
)
def test_extract_default_pattern(generation: str, expected: str | None) -> None:
    assert scoring.extract_answer(generation) == expected


def test_extract_custom_pattern_group_one() -> None:
    pattern = r"answer:\s*(\w+)"
    assert scoring.extract_answer("The answer: Even, clearly", pattern) == "Even"
    assert scoring.extract_answer("no answer here", pattern) is None


def test_extract_pattern_without_group_uses_whole_match() -> None:
    assert scoring.extract_answer("xx even yy", r"even|odd") == "even"


def test_extract_empty_capture_is_format_failure() -> None:
    assert scoring.extract_answer("abc", r"^(\d*)") is None


def test_extract_accepts_compiled_pattern() -> None:
    assert scoring.extract_answer("  odd!", re.compile(r"^\s*([A-Za-z]+)")) == "odd"


def test_invalid_pattern_raises_value_error() -> None:
    with pytest.raises(ValueError, match="not a valid regular expression"):
        scoring.compile_pattern(r"([a-z")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("even", "even"),
        ("  Even.\n", "even"),
        ("ODD!!", "odd"),
        ("odd?!.", "odd"),
        ("odd .", "odd"),
        ("ÉVEN", "éven"),
        ("Straße", "strasse"),
        ("even。", "even"),
        ("...", ""),
        ("e.g.", "e.g"),
    ],
)
def test_normalize(text: str, expected: str) -> None:
    assert scoring.normalize(text) == expected


def test_score_correct_wrong_and_format_failure() -> None:
    assert metrics.score(" Even.", "even") == ScoredExample("Even.", {"correct": True, "format_ok": True})
    assert metrics.score("odd", "even") == ScoredExample("odd", {"correct": False, "format_ok": True})
    assert metrics.score("", "even") == ScoredExample(None, {"correct": False, "format_ok": False})
    # an answer that normalises to nothing is a format failure too
    assert metrics.score("?!", "even") == ScoredExample("?!", {"correct": False, "format_ok": False})


def test_score_normalises_reference() -> None:
    assert metrics.score("even", "  EVEN. ").outcomes["correct"]


def test_score_exact_match_not_prefix() -> None:
    assert not metrics.score("evenly", "even").outcomes["correct"]


def test_score_all_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 generations but 1 references"):
        metrics.score_all(["a", "b"], ["a"])


def test_aggregate() -> None:
    scored = metrics.score_all(["even", "odd", "", "Odd."], ["even", "even", "odd", "odd"])
    m = metrics.aggregate(scored)
    assert m["n"] == 4
    assert m["n_correct"] == 2
    assert m["n_format_ok"] == 3
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["format_rate"] == pytest.approx(0.75)
    assert m["correct"] == [True, False, False, True]
    assert m["format_ok"] == [True, True, False, True]


def test_aggregate_empty() -> None:
    m = metrics.aggregate([])
    assert m == {
        "n": 0,
        "n_correct": 0,
        "n_format_ok": 0,
        "accuracy": 0.0,
        "format_rate": 0.0,
        "correct": [],
        "format_ok": [],
    }


def test_aggregate_is_json_serialisable() -> None:
    import json

    json.dumps(metrics.aggregate(metrics.score_all(["even"], ["even"])))


def test_scoring_imports_no_heavy_modules() -> None:
    code = "import sys, loraflow.evaluation.metrics; print(sorted(m for m in ('vllm','pandas','torch','numpy') if m in sys.modules))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"
