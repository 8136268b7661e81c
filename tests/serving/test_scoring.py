"""Unit tests of loraflow.evaluation.scoring and .metrics: extraction, normalisation, format failures, aggregation."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from loraflow.evaluation import metrics, scoring
from loraflow.evaluation.metrics import ScoredExample
from loraflow.spec.schema import EvaluationSpec
from tests.spec_defaults import scoring as spec_scoring

SPEC = spec_scoring()  # a spec's evaluation section without scoring keys: accuracy and format_rate
PATTERN = EvaluationSpec().answer_pattern


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
    assert scoring.extract_answer(generation, PATTERN) == expected


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
    assert metrics.score(" Even.", "even", SPEC) == ScoredExample("Even.", {"correct": True, "format_ok": True})
    assert metrics.score("odd", "even", SPEC) == ScoredExample("odd", {"correct": False, "format_ok": True})
    assert metrics.score("", "even", SPEC) == ScoredExample(None, {"correct": False, "format_ok": False})
    # an answer that normalises to nothing is a format failure too
    assert metrics.score("?!", "even", SPEC) == ScoredExample("?!", {"correct": False, "format_ok": False})


def test_score_normalises_reference() -> None:
    assert metrics.score("even", "  EVEN. ", SPEC).outcomes["correct"]


def test_score_exact_match_not_prefix() -> None:
    assert not metrics.score("evenly", "even", SPEC).outcomes["correct"]


def test_score_all_length_mismatch() -> None:
    with pytest.raises(ValueError, match="2 generations but 1 references"):
        metrics.score_all(["a", "b"], ["a"], SPEC)


def test_aggregate() -> None:
    scored = metrics.score_all(["even", "odd", "", "Odd."], ["even", "even", "odd", "odd"], SPEC)
    m = metrics.aggregate(scored, SPEC.metrics)
    assert m["n"] == 4
    assert m["n_correct"] == 2
    assert m["n_format_ok"] == 3
    assert m["accuracy"] == pytest.approx(0.5)
    assert m["format_rate"] == pytest.approx(0.75)
    assert m["correct"] == [True, False, False, True]
    assert m["format_ok"] == [True, True, False, True]


def test_aggregate_empty() -> None:
    m = metrics.aggregate([], SPEC.metrics)
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

    json.dumps(metrics.aggregate(metrics.score_all(["even"], ["even"], SPEC), SPEC.metrics))


def test_scoring_imports_no_heavy_modules() -> None:
    code = "import sys, loraflow.evaluation.metrics; print(sorted(m for m in ('vllm','pandas','torch','numpy') if m in sys.modules))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------ numbers, tags, the numeric scorers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "42"),
        ("The answer is 12 apples.", "12"),
        ("3 + 4 = 7.", "7"),  # several numbers: the last
        ("-5", "-5"),
        ("\u22127", "-7"),  # the Unicode minus
        ("+3", "3"),
        ("is -3.", "-3"),
        ("10-3", "3"),  # a dash glued to a number is no sign
        ("5 - -2 = 7", "7"),
        ("3.50", "3.5"),
        (".5", "0.5"),
        ("1,000", "1000"),
        ("$1,234,567.25 in total", "1234567.25"),
        ("1,2,3", "3"),  # commas of a list are no thousands separators
        ("12kg", "12"),
        ("x3", "3"),
        ("7.", "7"),
    ],
)
def test_last_number(text: str, expected: str) -> None:
    from decimal import Decimal

    assert scoring.last_number(text) == Decimal(expected)


@pytest.mark.parametrize("text", ["", None, "no number here", "-", "e", "..."])
def test_last_number_none(text: str | None) -> None:
    assert scoring.last_number(text) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<reasoning>3 + 4 = 7</reasoning><answer>7</answer>", "7"),
        ("<answer> 12 apples \n</answer>", "12 apples"),
        ("<answer>1</answer><answer>2</answer>", "1"),  # duplicated: the first
        ("<answer><answer>5</answer></answer>", "5"),  # nested: the innermost
        ("<answer></answer>", None),
        ("<answer>  </answer>", None),
        ("<answer>7", None),  # not closed
        ("7</answer>", None),
        ("7", None),
        ("</answer>7<answer>", None),  # wrong order
    ],
)
def test_tagged_answer(text: str, expected: str | None) -> None:
    assert scoring.tagged_answer(text) == expected


@pytest.mark.parametrize(
    ("generation", "ok"),
    [
        ("<reasoning>3 + 4 = 7</reasoning><answer>7</answer>", True),
        ("  <reasoning>\nadd\n</reasoning>\n<answer>7</answer>\n", True),
        ("<reasoning>add</reasoning> so: <answer>7</answer>", True),  # anything between, as the notebook
        ("<answer>7</answer>", False),  # missing reasoning
        ("<reasoning>add</reasoning>", False),  # missing answer
        ("<reasoning>add</reasoning><answer>7", False),  # answer not closed
        ("<answer>7</answer><reasoning>add</reasoning>", False),  # wrong order
        ("</reasoning>add<reasoning><answer>7</answer>", False),  # tags reversed
        ("<reasoning>a</reasoning><answer>7</answer><answer>8</answer>", False),  # duplicated
        ("<reasoning>a<reasoning>b</reasoning></reasoning><answer>7</answer>", False),  # nested
        ("<reasoning> </reasoning><answer>7</answer>", False),  # blank reasoning
        ("<reasoning>a</reasoning><answer> </answer>", False),  # blank answer
        ("So: <reasoning>a</reasoning><answer>7</answer>", False),  # text before
        ("<reasoning>a</reasoning><answer>7</answer> and more", False),  # text after
        ("", False),
    ],
)
def test_tagged_format_ok(generation: str, ok: bool) -> None:
    assert scoring.tagged_format_ok(scoring.Outputs.of(generation, "7", PATTERN, "pattern", 0.1)) is ok


def _numeric(generation: str, reference: str, tolerance: float = 0.1, fmt: str = "pattern") -> tuple[bool, bool]:
    outputs = scoring.Outputs.of(generation, reference, r"(.*)", fmt, tolerance)
    return scoring.numeric_match(outputs), scoring.numeric_close(outputs)


@pytest.mark.parametrize(
    ("generation", "reference", "exact", "close"),
    [
        ("7", "7", True, True),
        ("The total is 1,000 apples.", "1000", True, True),
        ("7.0", "7", True, True),
        ("-4", "-4", True, True),
        ("4", "-4", False, False),
        ("8", "7", False, False),  # 14% off
        ("105", "100", False, True),  # 5% off
        ("110", "100", False, True),  # exactly 10%: within
        ("111", "100", False, False),
        ("-95", "-100", False, True),  # negative reference: relative to |reference|
        ("0", "0", True, True),
        ("0.001", "0", False, False),  # a reference of 0 needs exactly 0
        ("no number", "7", False, False),
        ("7", "seven", False, False),  # a reference without a number matches nothing
        ("", "7", False, False),
    ],
)
def test_numeric_match_and_close(generation: str, reference: str, exact: bool, close: bool) -> None:
    assert _numeric(generation, reference) == (exact, close)


def test_numeric_close_tolerance() -> None:
    assert _numeric("120", "100", tolerance=0.2) == (False, True)
    assert _numeric("101", "100", tolerance=0.0) == (False, False)
    assert _numeric("100", "100", tolerance=0.0) == (True, True)
    assert _numeric("200", "100", tolerance=1.0) == (False, True)


def test_tagged_answer_is_the_source_and_the_reference_is_unwrapped() -> None:
    reference = "<reasoning>3 + 4 = 7</reasoning><answer>7</answer>"
    outputs = scoring.Outputs.of(
        "<reasoning>3 + 4 is 7</reasoning><answer>7 apples</answer>", reference, PATTERN, "tagged", 0.1
    )
    assert outputs.answer == "7 apples" and outputs.expected == "7"
    assert scoring.numeric_match(outputs) and not scoring.exact_match(outputs)
    # A plain reference stays as it is.
    assert scoring.Outputs.of("<answer>7</answer>", "7", PATTERN, "tagged", 0.1).expected == "7"
    # Untagged generation: no answer, every answer metric wrong.
    missing = scoring.Outputs.of("7", reference, PATTERN, "tagged", 0.1)
    assert missing.answer is None and not scoring.answer_found(missing) and not scoring.numeric_match(missing)


def test_unknown_answer_format_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown answer_format 'xml'"):
        scoring.Outputs.of("a", "a", PATTERN, "xml", 0.1)


def test_score_with_settings_scores_the_chosen_metrics() -> None:
    settings = spec_scoring(
        metrics=["accuracy", "numeric_accuracy", "approx_accuracy", "tagged_format_rate"], answer_format="tagged"
    )
    got = metrics.score(
        "<reasoning>2 + 3 = 5</reasoning><answer>5.0</answer>",
        "<reasoning>x</reasoning><answer>5</answer>",
        settings=settings,
    )
    assert got == ScoredExample(
        "5.0", {"correct": False, "numeric_correct": True, "approx_correct": True, "tagged_format_ok": True}
    )


def test_aggregate_chosen_metrics() -> None:
    chosen = ("numeric_accuracy", "approx_accuracy")
    settings = spec_scoring(metrics=list(chosen), relative_tolerance=0.5)
    scored = metrics.score_all(["10", "14", "x", "-2"], ["10", "10", "10", "-1"], settings=settings)
    m = metrics.aggregate(scored, chosen)
    assert m == {
        "n": 4,
        "n_numeric_correct": 1,
        "n_approx_correct": 2,
        "numeric_accuracy": 0.25,
        "approx_accuracy": 0.5,
        "numeric_correct": [True, False, False, False],
        "approx_correct": [True, True, False, False],
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metrics": ("acuracy",)}, "unknown metric 'acuracy'"),
        ({"metrics": ("accuracy", "accuracy")}, "named twice: accuracy"),
        ({"answer_format": "xml"}, "unknown answer_format"),
        ({"relative_tolerance": 1.5}, r"relative_tolerance must lie in \[0, 1\]"),
        ({"relative_tolerance": -0.1}, r"relative_tolerance must lie in \[0, 1\]"),
    ],
)
def test_scoring_settings_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPEC, **kwargs)
