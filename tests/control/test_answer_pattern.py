"""evaluation.answer_pattern is the spec author's regular expression, searched in every generation: a
pattern that backtracks catastrophically is stopped at a time limit per generation and fails the
evaluation naming itself, instead of holding the evaluate step for hours (issue 29, item 10)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from loraflow.errors import LoraflowError
from loraflow.evaluation import metrics as metric_table
from loraflow.evaluation import scoring
from tests.spec_defaults import scoring as spec_scoring

REPO = Path(__file__).resolve().parents[2]
CATASTROPHIC = r"((a|aa)+)+b"  # with Python's re: 81 s on 20 characters, about 1.6 times longer per character more


def test_a_catastrophic_pattern_is_stopped_at_the_time_limit_naming_itself_and_the_fix() -> None:
    """Run apart, so that a pattern that is not stopped fails this test after 60 s instead of hanging it."""
    code = textwrap.dedent(
        f"""
        import time
        from loraflow.evaluation import scoring
        started = time.monotonic()
        try:
            scoring.extract_answer("a" * 40, {CATASTROPHIC!r})
        except Exception as exc:
            print(type(exc).__name__, round(time.monotonic() - started, 1), exc)
        else:
            print("matched", round(time.monotonic() - started, 1))
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{CATASTROPHIC} ran for 60 s on 40 characters without being stopped")
    kind, seconds, message = done.stdout.split(" ", 2)
    assert kind == "AnswerPatternTimeout", done.stdout + done.stderr
    assert float(seconds) < scoring.PATTERN_TIME_LIMIT_S + 5
    assert CATASTROPHIC in message and f"{scoring.PATTERN_TIME_LIMIT_S:g} s" in message
    assert "evaluation.answer_pattern" in message and "nested" in message


def test_the_evaluation_fails_as_a_refusal_not_a_crash() -> None:
    """A LoraflowError: the step program exits 2 with the message, and Airflow does not retry it."""
    settings = spec_scoring(answer_pattern=CATASTROPHIC)
    started = time.monotonic()
    with pytest.raises(LoraflowError, match=re.escape(CATASTROPHIC)):
        metric_table.score_all(["the answer is 4", "a" * 40], ["4", "4"], settings=settings)
    assert time.monotonic() - started < scoring.PATTERN_TIME_LIMIT_S + 5


def test_a_sound_pattern_is_searched_as_before_on_long_generations() -> None:
    generation = "reasoning " * 100_000 + "The answer: Even."
    assert scoring.extract_answer(generation, r"answer:\s*(\w+)") == "Even"
    assert scoring.extract_answer("  ODD!", re.compile(r"^\s*(odd|even)", re.IGNORECASE)) == "ODD"
    assert scoring.extract_answer("v1.7", r"(?<![\w.])(\d+)$") is None
    assert scoring.extract_answer("x = 7", r"(?<![\w.])(\d+)$") == "7"
    assert scoring.extract_answer("no answer here", r"answer:\s*(\w+)") is None
