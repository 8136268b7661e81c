"""gate_rule.decide on constructed outcomes, and the gate step on evaluate-shaped artifacts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from loraflow.evaluation import gate_rule
from loraflow.evaluation.gate_rule import GateError, GuardCheck
from loraflow.evaluation.metrics import Metric
from loraflow.steps import gate
from tests.spec_defaults import decide, guard_check


def outcomes(pattern: str, prefix: str = "e") -> dict[str, bool]:
    return {f"{prefix}{i:04d}": c == "1" for i, c in enumerate(pattern)}


def test_clear_improvement_promotes() -> None:
    base = outcomes("0" * 150 + "1" * 50)  # 0.25
    tuned = outcomes("1" * 180 + "0" * 20)  # 0.90
    d = decide(base, tuned, min_improvement=0.3)
    assert d.promote
    assert d.base == pytest.approx(0.25) and d.tuned == pytest.approx(0.9) and d.delta == pytest.approx(0.65)
    assert 0 < d.ci[0] < d.delta < d.ci[1]
    assert d.fixed == 150 and d.broken == 20
    assert "rose by +0.650" in d.reason


def test_no_change_does_not_promote() -> None:
    same = outcomes("01" * 100)
    d = decide(same, dict(same), min_improvement=0.3)
    assert not d.promote
    assert d.delta == 0 and d.ci == (0.0, 0.0) and d.fixed == d.broken == 0
    assert "less than the required" in d.reason
    at_the_spec_default = decide(same, dict(same))  # gate.min_improvement 0.0: the interval refuses it
    assert not at_the_spec_default.promote and "reaches 0" in at_the_spec_default.reason


def test_gain_below_the_threshold_does_not_promote() -> None:
    d = decide(outcomes("0" * 100 + "1" * 100), outcomes("0" * 60 + "1" * 140), min_improvement=0.3)
    assert d.delta == pytest.approx(0.2) and d.ci[0] > 0 and not d.promote


@pytest.mark.parametrize(
    ("base_pattern", "tuned_pattern", "min_improvement"),
    [
        # base all wrong, tuned right on exactly 30 of 100: the mean of the paired differences is
        # 30.0 / 100, which rounds to the same double as the literal 0.3
        ("0" * 100, "1" * 30 + "0" * 70, 0.3),
        # 16 of 64 fixed on top of 16 right: every figure a power-of-two fraction, exact however computed
        ("1" * 16 + "0" * 48, "1" * 32 + "0" * 32, 0.25),
    ],
    ids=["30-of-100", "16-of-64"],
)
def test_gain_exactly_at_the_threshold_promotes(base_pattern: str, tuned_pattern: str, min_improvement: float) -> None:
    d = decide(outcomes(base_pattern), outcomes(tuned_pattern), min_improvement=min_improvement)
    assert d.delta == min_improvement  # on the boundary itself, not a rounding error either side of it
    assert d.ci[0] > 0
    assert d.promote, d.reason
    below = decide(outcomes(base_pattern), outcomes(tuned_pattern), min_improvement=min_improvement + 1e-9)
    assert not below.promote and "less than the required" in below.reason


def test_an_interval_touching_zero_does_not_promote() -> None:
    # 1 of 40 fixed, nothing broken: most resamples hold the fixed example, about a third do not and
    # gain exactly 0, so the 2.5 % quantile is exactly 0.0: "lower bound > 0" must refuse it.
    d = decide(outcomes("0" * 40), outcomes("1" + "0" * 39), min_improvement=0.01)
    assert d.delta == 0.025 and d.ci[0] == 0.0
    assert d.promote is False and "reaches 0" in d.reason


def bootstrap_reference(base: str, tuned: str, samples: int, seed: int, confidence: float) -> tuple[float, float]:
    """The paired percentile bootstrap written out in one block (the code draws it in chunks)."""
    import numpy as np

    diff = np.array([int(t) - int(b) for b, t in zip(base, tuned, strict=True)], dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(diff), size=(samples, len(diff)))
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(diff[idx].mean(axis=1), [tail, 1 - tail])
    return float(lo), float(hi)


@pytest.mark.parametrize(
    ("samples", "seed", "confidence", "repeat"),
    [(2000, 0, 0.95, 5), (500, 7, 0.8, 5), (1, 3, 0.5, 5), (2100, 1, 0.95, 220)],  # 2200 examples: drawn in 2 chunks
)
def test_the_interval_is_the_paired_percentile_bootstrap(
    samples: int, seed: int, confidence: float, repeat: int
) -> None:
    base, tuned = "0011010011" * repeat, "0111011010" * repeat
    d = decide(outcomes(base), outcomes(tuned), bootstrap_samples=samples, seed=seed, confidence=confidence)
    assert d.ci == pytest.approx(bootstrap_reference(base, tuned, samples, seed, confidence), abs=1e-12)


def test_the_decision_records_its_settings() -> None:
    d = decide(outcomes("0" * 50 + "1" * 50), outcomes("1" * 100), min_improvement=0.3)
    assert (d.metric, d.min_improvement, d.confidence, d.bootstrap_samples, d.seed) == ("accuracy", 0.3, 0.95, 2000, 0)
    assert d.promote is True and "95% interval" in d.reason
    assert d.as_dict()["ci"] == list(d.ci)  # a list, as JSON has it
    record = json.loads(json.dumps(d.as_dict()))  # what decision.json holds
    assert record["ci"] == list(d.ci) and record["promote"] is True
    assert {k: record[k] for k in ("metric", "min_improvement", "confidence", "bootstrap_samples", "seed")} == {
        "metric": "accuracy", "min_improvement": 0.3, "confidence": 0.95, "bootstrap_samples": 2000, "seed": 0,
    }  # fmt: skip
    other = decide(outcomes("0" * 50 + "1" * 50), outcomes("1" * 100), metric="exact_match", min_improvement=0.6,
                   confidence=0.9, bootstrap_samples=100, seed=5)  # fmt: skip
    assert (other.metric, other.min_improvement, other.confidence, other.bootstrap_samples, other.seed) == (
        "exact_match", 0.6, 0.9, 100, 5,
    )  # fmt: skip
    assert other.promote is False and "exact_match rose by +0.500" in other.reason


def test_big_gain_on_few_examples_is_noise() -> None:
    # 2 of 5 fixed, 1 broken: delta 0.2 clears a 0.1 threshold, but the interval reaches 0.
    d = decide(outcomes("00010"), outcomes("11000"), min_improvement=0.1)
    assert d.delta == pytest.approx(0.2)
    assert d.ci[0] <= 0 and not d.promote
    assert "may be noise" in d.reason


def test_ci_narrows_with_more_examples_and_is_reproducible() -> None:
    small = decide(outcomes("0011" * 10), outcomes("0111" * 10), min_improvement=0.0)
    large = decide(outcomes("0011" * 200), outcomes("0111" * 200), min_improvement=0.0)
    assert small.delta == pytest.approx(large.delta)
    assert (large.ci[1] - large.ci[0]) < (small.ci[1] - small.ci[0])
    again = decide(outcomes("0011" * 10), outcomes("0111" * 10), min_improvement=0.0)
    assert again.ci == small.ci
    other_seed = decide(outcomes("0011" * 10), outcomes("0111" * 10), min_improvement=0.0, seed=1)
    assert other_seed.delta == small.delta


def test_higher_confidence_gives_a_wider_interval() -> None:
    base, tuned = outcomes("0011" * 25), outcomes("0111" * 25)
    ci90 = decide(base, tuned, confidence=0.90).ci
    ci99 = decide(base, tuned, confidence=0.99).ci
    assert ci99[0] <= ci90[0] and ci99[1] >= ci90[1]


def test_mismatched_ids_are_refused() -> None:
    base = outcomes("0101")
    tuned = outcomes("0101", prefix="x")
    with pytest.raises(GateError, match="different examples: 4 id\\(s\\) only in base"):
        decide(base, tuned)
    with pytest.raises(GateError, match="1 only in tuned"):
        decide(base, {**base, "extra": True})


def test_mismatched_ids_are_refused_naming_three_of_each_side_and_the_fix() -> None:
    base, tuned = outcomes("01010"), outcomes("01010", prefix="x")
    with pytest.raises(GateError) as refused:
        decide(base, tuned)
    assert str(refused.value) == (
        "the two evaluations cover different examples: 5 id(s) only in base (e.g. ['e0000', 'e0001', 'e0002']), "
        "5 only in tuned (e.g. ['x0000', 'x0001', 'x0002']); evaluate both models on the same eval set"
    )


def test_empty_and_bad_settings_are_refused() -> None:
    with pytest.raises(GateError) as empty:
        decide({}, {})
    assert str(empty.value) == "the evaluations hold no examples; nothing to compare"
    for confidence in (0.0, 1.0):
        with pytest.raises(GateError, match="confidence must lie strictly between 0 and 1"):
            decide(outcomes("01"), outcomes("01"), confidence=confidence)
    with pytest.raises(GateError, match=r"bootstrap_samples must be at least 1 \(got 0\)"):
        decide(outcomes("01"), outcomes("01"), bootstrap_samples=0)
    assert decide(outcomes("01"), outcomes("11"), bootstrap_samples=1).bootstrap_samples == 1


# ------------------------------------------------------------------------ the guard and the champion


PROMOTED = decide(outcomes("0" * 80 + "1" * 20), outcomes("1" * 95 + "0" * 5), min_improvement=0.3)  # 0.20 -> 0.95
REFUSED = decide(outcomes("0" * 80 + "1" * 20), outcomes("0" * 70 + "1" * 30), min_improvement=0.3)  # +0.10


def guard(passed: bool) -> GuardCheck:
    """The guard on 100 questions: 0.60 -> 0.58 (passed) or -> 0.45 (failed), at most 0.05 lost."""
    kept = 58 if passed else 45
    check = guard_check(outcomes("1" * 60 + "0" * 40), outcomes("1" * kept + "0" * (100 - kept)), max_drop=0.05)
    assert check.passed is passed
    return check


def test_a_failed_guard_refuses_and_a_passed_one_is_only_reported() -> None:
    assert gate_rule.with_guard(PROMOTED, None) is PROMOTED
    passed = gate_rule.with_guard(PROMOTED, guard(True))
    assert passed.promote is True and passed.reason == f"{PROMOTED.reason}; {guard(True).reason}"
    failed = gate_rule.with_guard(PROMOTED, guard(False))
    assert failed.promote is False
    assert failed.reason == f"{PROMOTED.reason}; but the regression guard failed: {guard(False).reason}; not promoted"
    already = gate_rule.with_guard(REFUSED, guard(False))
    assert already.promote is False and already.reason == f"{REFUSED.reason}; {guard(False).reason}"
    assert failed.delta == PROMOTED.delta and failed.ci == PROMOTED.ci  # the task metric's evidence stays


def champion(measured: float | None, **changes: object) -> gate_rule.Champion:
    """A verified champion, version 2 of run-2, whose registry version records what was measured."""
    fields: dict = {
        "version": 2, "version_uri": "gs://r/tiny/versions/0002.json", "run_id": "run-2",
        "model_fingerprint": "fp-champ", "gate_manifest": "gs://a/tiny/run-2/gate/_MANIFEST.json",
        "evaluation_manifest": "gs://a/tiny/run-2/evaluate_tuned/_MANIFEST.json", "eval_set_fingerprint": "eval-fp",
        "measured": measured, "recorded": measured, "recorded_figure": measured,
    }  # fmt: skip
    return gate_rule.Champion(**(fields | changes))  # type: ignore[arg-type]


def test_without_a_champion_the_decision_stands() -> None:
    judged = gate_rule.against_champion(PROMOTED, None, "fp-new", "eval-fp")
    assert (judged.decision, judged.record, judged.notes) == (PROMOTED, None, [])


def test_beating_the_champion_promotes_and_records_what_was_compared() -> None:
    judged = gate_rule.against_champion(PROMOTED, champion(0.5), "fp-new", "eval-fp")
    assert judged.decision.promote is True and judged.notes == []
    assert (
        judged.decision.reason == f"{PROMOTED.reason}; accuracy 0.950 beats the champion (version 2, run run-2): 0.500"
    )
    assert judged.record == {
        "version": 2, "version_uri": "gs://r/tiny/versions/0002.json", "run_id": "run-2",
        "model_fingerprint": "fp-champ", "gate_manifest": "gs://a/tiny/run-2/gate/_MANIFEST.json",
        "evaluation_manifest": "gs://a/tiny/run-2/evaluate_tuned/_MANIFEST.json", "metric": "accuracy",
        "value": 0.5, "verdict": "accuracy 0.950 beats the champion (version 2, run run-2): 0.500", "beaten": True,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("measured", "fingerprint", "verdict"),
    [
        (0.95, "fp-new", "accuracy 0.950 does not beat the champion (version 2, run run-2): 0.950"),  # a tie
        (0.97, "fp-new", "accuracy 0.950 does not beat the champion (version 2, run run-2): 0.970"),
        (0.5, "fp-champ", "the tuned model is the champion (version 2, run run-2) itself"),
        (
            None,
            "fp-new",
            "the champion (version 2, run run-2)'s evaluation has no per-example 'correct' column, "
            "so it cannot be compared",
        ),
    ],
    ids=["tie", "better-champion", "the-champion-itself", "no-figure"],
)
def test_a_champion_not_beaten_refuses_promotion(measured: float | None, fingerprint: str, verdict: str) -> None:
    judged = gate_rule.against_champion(PROMOTED, champion(measured), fingerprint, "eval-fp")
    assert (
        judged.decision.promote is False and judged.decision.reason == f"{PROMOTED.reason}; but {verdict}: not promoted"
    )
    assert judged.record is not None and judged.record["beaten"] is False and judged.record["verdict"] == verdict
    refused = gate_rule.against_champion(REFUSED, champion(measured), fingerprint, "eval-fp").decision
    assert refused.promote is False and refused.reason == f"{REFUSED.reason} ({verdict.replace('0.950 ', '0.300 ')})"


def test_a_refused_decision_says_what_the_champion_comparison_found() -> None:
    judged = gate_rule.against_champion(REFUSED, champion(0.1, recorded=0.2, recorded_figure=0.2), "fp-new", "x")
    assert judged.decision.promote is False and judged.record is not None and judged.record["beaten"] is True
    assert len(judged.notes) == 2  # what it records and its other eval set are noted whatever the verdict
    assert (
        judged.decision.reason == f"{REFUSED.reason} (accuracy 0.300 beats the champion (version 2, run run-2): 0.100)"
    )


def test_where_lower_is_better_the_champion_is_beaten_by_a_lower_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(gate_rule.METRICS, "error_rate", Metric("error_rate", "wrong", "", lambda o: False, False))
    base, tuned = outcomes("1" * 50 + "0" * 50), outcomes("1" * 20 + "0" * 80)  # 0.50 -> 0.20 wrong
    d = decide(base, tuned, metric="error_rate", min_improvement=0.2, higher_is_better=False)
    assert gate_rule.against_champion(d, champion(0.3), "fp-new", None).decision.promote is True
    lost = gate_rule.against_champion(d, champion(0.1), "fp-new", None).decision
    assert lost.promote is False and "error_rate 0.200 does not beat the champion" in lost.reason
    tie = gate_rule.against_champion(d, champion(0.2), "fp-new", None).decision
    assert tie.promote is False and "does not beat" in tie.reason  # a tie is no win either way


def test_notes_say_where_the_champions_version_or_eval_set_differ() -> None:
    judged = gate_rule.against_champion(PROMOTED, champion(0.5, recorded=-1, recorded_figure=-1.0), "fp-new", "eval-fp")
    assert judged.notes == [
        "the champion's version 2 records accuracy -1; measured from its committed evaluation "
        "gs://a/tiny/run-2/evaluate_tuned/_MANIFEST.json it is 0.500000, which is what is compared"
    ]
    assert judged.decision.promote is True  # what the version records is never compared
    long = gate_rule.against_champion(PROMOTED, champion(0.5, recorded="x" * 200, recorded_figure=None), "fp", None)
    assert f"records accuracy '{'x' * 76}...; measured from" in long.notes[0]  # repr cut to 80 characters
    for text, shown in (("x" * 78, repr("x" * 78)), ("x" * 79, f"'{'x' * 76}...")):  # a repr of 80, of 81
        note = gate_rule.against_champion(PROMOTED, champion(0.5, recorded=text, recorded_figure=None), "fp", None)
        assert f"records accuracy {shown}; measured from" in note.notes[0]
    for measured, recorded, noted in ((0.5, 0.5 + 1e-10, False), (0.0, 1e-9, False), (0.5, 0.9, True)):
        differing = champion(measured, recorded=recorded, recorded_figure=recorded)  # within 1e-9 is the same
        assert bool(gate_rule.against_champion(PROMOTED, differing, "fp-new", "eval-fp").notes) is noted
    assert gate_rule.against_champion(PROMOTED, champion(None, recorded=0.9), "fp-new", "eval-fp").notes == []
    other_set = gate_rule.against_champion(PROMOTED, champion(0.5), "fp-new", "other-eval-fp").notes
    assert other_set == [
        "the champion (version 2) was evaluated on another eval set; its accuracy is compared as measured on that set"
    ]
    assert gate_rule.against_champion(PROMOTED, champion(0.5, eval_set_fingerprint=None), "fp", "x").notes == []


# ------------------------------------------------------------------------------------ the step


def write_eval(d: Path, pattern: str, generations: list[str] | None = None) -> Path:
    import pandas as pd

    d.mkdir(parents=True)
    ids = [f"eval-{i + 1:06d}" for i in range(len(pattern))]
    correct = [c == "1" for c in pattern]
    frame = pd.DataFrame(
        {
            "id": ids,
            "correct": correct,
            "format_ok": [True] * len(pattern),
            "answer": ["even" if c else "odd" for c in correct],
            "reference": ["even"] * len(pattern),
            "generation": generations or ["even" if c else "odd" for c in correct],
        }
    )
    frame.to_parquet(d / "predictions.parquet")
    acc = sum(correct) / len(correct)
    (d / "metrics.json").write_text(json.dumps({"accuracy": acc, "format_rate": 1.0, "n": len(pattern)}))
    return d


def test_step_promotes_and_writes_the_evidence(tmp_path: Path, make_ctx: Callable) -> None:
    inputs = {
        "base_eval": write_eval(tmp_path / "b", "0" * 80 + "1" * 20),
        "tuned_eval": write_eval(tmp_path / "t", "1" * 95 + "0" * 5),
    }
    ctx = make_ctx("gate", inputs, {"min_improvement": 0.3})
    summary = gate.run(ctx)
    assert summary["promote"] is True
    assert summary["base"] == pytest.approx(0.2) and summary["tuned"] == pytest.approx(0.95)
    assert summary["delta"] == pytest.approx(0.75) and summary["ci"][0] > 0
    decision = json.loads((ctx.out / "decision.json").read_text())
    assert decision["promote"] is True and decision["fixed"] == 80 and decision["broken"] == 5
    assert decision["n"] == 100 and decision["base_metrics"]["n"] == 100
    assert decision["rule"].startswith("promote iff")


def test_step_succeeds_without_promoting(tmp_path: Path, make_ctx: Callable) -> None:
    pattern = "01" * 50
    reworded = ["Even" if c == "1" else "Odd" for c in pattern]  # other words, the same outcomes
    inputs = {
        "base_eval": write_eval(tmp_path / "b", pattern),
        "tuned_eval": write_eval(tmp_path / "t", pattern, reworded),
    }
    ctx = make_ctx("gate", inputs, {})
    summary = gate.run(ctx)
    assert summary["promote"] is False and summary["delta"] == 0
    decision = json.loads((ctx.out / "decision.json").read_text())
    assert decision["identical_generations"] == 0 and decision["champion"] is None
    # identical generations on every example fail the step instead: see test_guards.py


def test_step_refuses_different_eval_sets(tmp_path: Path, make_ctx: Callable) -> None:
    inputs = {"base_eval": write_eval(tmp_path / "b", "01" * 50), "tuned_eval": write_eval(tmp_path / "t", "01" * 40)}
    with pytest.raises(GateError, match="20 id\\(s\\) only in base"):
        gate.run(make_ctx("gate", inputs, {}))


def test_step_reads_predictions_jsonl_when_parquet_is_absent(tmp_path: Path, make_ctx: Callable) -> None:
    import pandas as pd

    base = write_eval(tmp_path / "b", "0" * 50 + "1" * 50)
    tuned = write_eval(tmp_path / "t", "1" * 100)
    for d in (base, tuned):
        pd.read_parquet(d / "predictions.parquet").to_json(d / "predictions.jsonl", orient="records", lines=True)
        (d / "predictions.parquet").unlink()
    summary = gate.run(make_ctx("gate", {"base_eval": base, "tuned_eval": tuned}, {"metric": "accuracy"}))
    assert summary["promote"] is True and summary["delta"] == pytest.approx(0.5)
