"""The promotion rule: is the tuned model better than the base model on the same examples, did it keep what
the base could do (the regression guard), and does it beat the registry's champion?

Pure and deterministic (numpy only): the gate step reads the evaluations and the verified champion and
calls :func:`decide`, :func:`guard_check` (or :func:`suite_guard_check`), :func:`with_guard` and :func:`against_champion`; every setting
comes from its config (``loraflow.spec.step_configs.GateConfig``: the spec's ``gate`` section), none has a
default here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.evaluation import suites
from loraflow.evaluation.metrics import METRICS

#: The whole rule in one sentence (decision.json records it).
RULE = (
    "promote iff delta >= min_improvement and the lower bound of the paired bootstrap interval > 0, "
    "the regression guard (gate.guard) passes when there is one, "
    "and, when a champion is registered, the tuned metric beats the champion's"
)


class GateError(LoraflowError):
    """The two evaluations cannot be compared (different examples, nothing to compare)."""


@dataclass(frozen=True)
class Paired:
    """Two models' outcomes on the same examples: the paired comparison both rules decide on, with its settings."""

    n: int
    base: float
    tuned: float
    delta: float  # the mean per-example gain (tuned - base; base - tuned where lower is better)
    ci: tuple[float, float]
    confidence: float
    fixed: int  # examples the tuned model does better on (base wrong, tuned right)
    broken: int  # ... worse on (base right, tuned wrong)
    bootstrap_samples: int
    seed: int

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ci"] = list(self.ci)
        return out

    def evidence(self) -> dict[str, Any]:
        """The fields as keyword arguments, for a verdict built on them."""
        return {f.name: getattr(self, f.name) for f in fields(Paired)}


@dataclass(frozen=True)
class Decision(Paired):
    """The promotion rule's verdict (:func:`decide`) with its evidence."""

    promote: bool
    metric: str
    min_improvement: float
    reason: str


def decide(
    base: Mapping[str, bool],
    tuned: Mapping[str, bool],
    *,
    metric: str,
    min_improvement: float,
    confidence: float,
    bootstrap_samples: int,
    seed: int,
    higher_is_better: bool,
) -> Decision:
    """Paired comparison of two per-example outcomes on the same example ids.

    Args:
        base, tuned: example id -> outcome (True = the metric counts it, e.g. answered correctly).
            Both must hold exactly the same ids; anything else is refused with GateError, since an
            unpaired comparison would measure the sample, not the model.
        metric: name of the metric, recorded in the decision.
        min_improvement: the smallest gain in the metric (tuned - base, absolute; base - tuned for
            a metric where lower is better) worth promoting.
        confidence: level of the two-sided percentile confidence interval of the gain.
        bootstrap_samples, seed: the paired bootstrap (examples resampled with replacement, the
            same resample for both models); fixed seed, so a decision is reproducible.
        higher_is_better: the metric's direction (loraflow/evaluation/metrics.py).

    Returns:
        A Decision with both scores, the gain ``delta``, its bootstrap interval ``ci``, the counts
        of fixed (the tuned model better on the example) and broken (worse) examples.

    Rule: promote iff ``delta >= min_improvement`` **and** the interval's lower bound is
    ``> 0``: the gain must be large enough to matter and the tuned model must be better beyond
    resampling noise. (A stricter rule, lower bound ``>= min_improvement``, needs far more eval
    examples for the same gain; it is a one-line change here if wanted.)
    """
    p = paired(base, tuned, confidence=confidence, bootstrap_samples=bootstrap_samples, seed=seed,
               higher_is_better=higher_is_better)  # fmt: skip
    decision = Decision(**p.evidence(), promote=False, metric=metric, min_improvement=min_improvement, reason="")
    return _verdict(decision, "rose" if higher_is_better else "fell")


def paired(
    base: Mapping[str, bool],
    tuned: Mapping[str, bool],
    *,
    confidence: float,
    bootstrap_samples: int,
    seed: int,
    higher_is_better: bool,
) -> Paired:
    """The paired comparison both rules decide on (:func:`decide`, :func:`guard_check`): the same ids in
    both (GateError otherwise), the paired bootstrap's percentile interval of the mean gain."""
    _check_settings(confidence, bootstrap_samples)
    ids = _paired_ids(base, tuned)
    b, t = _outcomes(base, ids), _outcomes(tuned, ids)
    gain = (t - b) if higher_is_better else (b - t)  # per example: +1 better, -1 worse, 0 the same
    return Paired(
        n=len(ids),
        base=float(b.mean()),
        tuned=float(t.mean()),
        delta=float(gain.mean()),
        ci=_interval(gain, confidence, bootstrap_samples, seed),
        confidence=confidence,
        fixed=int((gain > 0).sum()),
        broken=int((gain < 0).sum()),
        bootstrap_samples=bootstrap_samples,
        seed=seed,
    )


def _check_settings(confidence: float, bootstrap_samples: int) -> None:
    if not 0.0 < confidence < 1.0:
        raise GateError(f"confidence must lie strictly between 0 and 1 (got {confidence})")
    if bootstrap_samples < 1:
        raise GateError(f"bootstrap_samples must be at least 1 (got {bootstrap_samples})")


def _paired_ids(base: Mapping[str, bool], tuned: Mapping[str, bool]) -> list[str]:
    """The example ids both evaluations hold, sorted; GateError unless they hold the same ones."""
    only_base = sorted(set(base) - set(tuned))
    only_tuned = sorted(set(tuned) - set(base))
    if only_base or only_tuned:
        raise GateError(
            f"the two evaluations cover different examples: {len(only_base)} id(s) only in base "
            f"(e.g. {only_base[:3]}), {len(only_tuned)} only in tuned (e.g. {only_tuned[:3]}); "
            "evaluate both models on the same eval set"
        )
    if not base:
        raise GateError("the evaluations hold no examples; nothing to compare")
    return sorted(base)


def _outcomes(outcome: Mapping[str, bool], ids: list[str]) -> Any:
    """The outcomes in ``ids`` order as a float array of 0 and 1."""
    import numpy as np

    return np.array([bool(outcome[i]) for i in ids], dtype=np.float64)


def _interval(gain: Any, confidence: float, bootstrap_samples: int, seed: int) -> tuple[float, float]:
    """The paired bootstrap's two-sided percentile interval of the mean gain."""
    import numpy as np

    n = len(gain)
    rng = np.random.default_rng(seed)
    deltas = np.empty(bootstrap_samples)
    chunk = max(1, (1 << 22) // n)  # keep each (chunk, n) index block to a few MB
    for start in range(0, bootstrap_samples, chunk):
        stop = min(bootstrap_samples, start + chunk)
        idx = rng.integers(0, n, size=(stop - start, n))
        deltas[start:stop] = gain[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = (float(x) for x in np.quantile(deltas, [alpha, 1.0 - alpha]))
    return lo, hi


def _verdict(d: Decision, moved: str) -> Decision:
    """``d`` with its verdict: promoted or not, and why (``moved``: how the metric moves when it improves)."""
    (lo, hi), pct = d.ci, f"{d.confidence:.0%}"
    scores = f"({d.base:.3f} -> {d.tuned:.3f})"
    if d.delta < d.min_improvement:
        reason = (
            f"{d.metric} {moved} by {d.delta:+.3f} {scores}, less than the required "
            f"{d.min_improvement:+.3f}; not promoted"
        )
        return replace(d, promote=False, reason=reason)
    if lo <= 0.0:
        reason = (
            f"{d.metric} {moved} by {d.delta:+.3f} but the {pct} interval [{lo:+.3f}, {hi:+.3f}] reaches 0: "
            f"the gain may be noise on {d.n} examples; not promoted (evaluate on more examples)"
        )
        return replace(d, promote=False, reason=reason)
    reason = (
        f"{d.metric} {moved} by {d.delta:+.3f} {scores} >= {d.min_improvement:+.3f}, "
        f"{pct} interval [{lo:+.3f}, {hi:+.3f}] above 0; {d.fixed} examples fixed, {d.broken} broken"
    )
    return replace(d, promote=True, reason=reason)


#: A drop this close to max_drop counts as max_drop (a mean of n outcomes is not exact in floating point).
_TOLERANCE = 1e-9
GUARD_RULES = ("estimate", "interval")


@dataclass(frozen=True)
class GuardCheck(Paired):
    """The regression guard's verdict (``gate.guard``, :func:`guard_check`) with its evidence; ``delta`` is
    tuned - base accuracy on the guard set."""

    passed: bool
    set: str
    max_drop: float
    rule: str
    reason: str


def guard_check(
    base: Mapping[str, bool],
    tuned: Mapping[str, bool],
    *,
    max_drop: float,
    rule: str,
    guard_set: str,
    confidence: float,
    bootstrap_samples: int,
    seed: int,
) -> GuardCheck:
    """Did fine-tuning keep what the base model could do? Paired over the guard set's questions.

    Args:
        base, tuned: question id -> answered correctly, the same ids in both (GateError otherwise).
        max_drop: the most the accuracy may fall (base - tuned, a share: 0.05 = 5 points).
        rule: ``estimate``: pass iff the measured change ``tuned - base >= -max_drop``; ``interval``:
            pass iff that holds **and** the paired bootstrap interval's lower bound ``>= -max_drop`` (the
            drop is shown, beyond resampling noise, to be at most max_drop: a non-inferiority test, which
            needs a large guard set).
        guard_set, confidence, bootstrap_samples, seed: as :func:`decide`; the set's name is recorded.
    """
    if rule not in GUARD_RULES:
        raise GateError(f"unknown guard rule {rule!r}; use one of: {', '.join(GUARD_RULES)}")
    if not 0.0 <= max_drop <= 1.0:
        raise GateError(f"max_drop must lie in [0, 1] (got {max_drop})")
    p = paired(
        base, tuned, confidence=confidence, bootstrap_samples=bootstrap_samples, seed=seed, higher_is_better=True
    )
    (lo, hi), pct = p.ci, f"{confidence:.0%}"
    scores = f"accuracy {p.base:.3f} -> {p.tuned:.3f} ({p.delta:+.3f}) on {p.n} questions"
    evidence = f"{pct} interval [{lo:+.3f}, {hi:+.3f}]; {p.broken} questions broken, {p.fixed} fixed"
    if p.delta < -max_drop - _TOLERANCE:
        passed = False
        reason = (
            f"guard {guard_set}: {scores}, a drop of {-p.delta:.3f}, more than the allowed {max_drop:.3f} "
            f"(by {-p.delta - max_drop:.3f}); {evidence}"
        )
    elif rule == "interval" and lo < -max_drop - _TOLERANCE:
        passed = False
        reason = (
            f"guard {guard_set}: {scores}, but the {pct} interval's lower bound {lo:+.3f} allows a drop of "
            f"{-lo:.3f}, more than the allowed {max_drop:.3f}: the guard cannot show the drop is small enough "
            f"(a larger guard set narrows the interval; rule estimate judges the measured drop only); {evidence}"
        )
    else:
        passed = True
        within = "the change and the interval's lower bound within" if rule == "interval" else "within"
        reason = f"guard {guard_set}: {scores}, {within} the allowed drop of {max_drop:.3f}; {evidence}"
    return GuardCheck(**p.evidence(), passed=passed, set=guard_set, max_drop=max_drop, rule=rule, reason=reason)


def suite_guard_check(
    base: Mapping[str, Any],
    tuned: Mapping[str, Any],
    *,
    suite: str,
    max_drop: float,
    rule: str,
    confidence: float,
    bootstrap_samples: int,
    seed: int,
) -> GuardCheck:
    """The regression guard on a standard benchmark (``gate.guard.suite``): :func:`guard_check` over the suite's
    documents, each right or wrong by the suite's metric.

    Args:
        base, tuned: the suite's entry of each evaluation's metrics.json (``suites.<name>``: task, metric, ids,
            values); both must hold the same task and metric (GateError otherwise: re-run the evaluations).
        suite: the suite's name; max_drop, rule, confidence, bootstrap_samples, seed: as :func:`guard_check`.
    """
    scored = {(e.get("task"), e.get("metric")) for e in (base, tuned)}
    if len(scored) != 1:
        raise GateError(
            f"the evaluations scored suite {suite} differently (base {base.get('task')} {base.get('metric')}, tuned "
            f"{tuned.get('task')} {tuned.get('metric')}); re-run both evaluations with this spec"
        )
    return guard_check(
        suites.outcomes(base, f"base_eval suite {suite}"),
        suites.outcomes(tuned, f"tuned_eval suite {suite}"),
        max_drop=max_drop,
        rule=rule,
        guard_set=f"suite {suite} ({base.get('task')}, {base.get('metric')})",
        confidence=confidence,
        bootstrap_samples=bootstrap_samples,
        seed=seed,
    )


def with_guard(decision: Decision, guard: GuardCheck | None) -> Decision:
    """The decision once the guard is taken into account: a failed guard refuses promotion, saying by how much."""
    if guard is None:
        return decision
    if guard.passed or not decision.promote:
        return replace(decision, reason=f"{decision.reason}; {guard.reason}")
    reason = f"{decision.reason}; but the regression guard failed: {guard.reason}; not promoted"
    return replace(decision, promote=False, reason=reason)


@dataclass(frozen=True)
class Champion:
    """The registry's champion as the gate step verified it (``loraflow.registry.store.champion``: its model a
    committed merge_adapter of this pipeline, its evaluation the committed evaluate_tuned of that model), with
    the decision's metric measured from that evaluation's predictions."""

    version: int
    version_uri: str
    run_id: Any  # as its registry version records it (shown, never trusted)
    model_fingerprint: str
    gate_manifest: str
    evaluation_manifest: str
    eval_set_fingerprint: str | None
    measured: float | None  # None: its evaluation has no per-example column for the metric
    recorded: Any  # what its registry version records for the metric: noted where it differs, never compared
    recorded_figure: float | None  # ``recorded`` when it is a finite number


@dataclass(frozen=True)
class ChampionComparison:
    """What :func:`against_champion` found: the decision, what was compared (decision.json's ``champion``) and notes."""

    decision: Decision
    record: dict[str, Any] | None
    notes: list[str]


def against_champion(
    decision: Decision, champion: Champion | None, model_fingerprint: str | None, eval_fingerprint: str | None
) -> ChampionComparison:
    """The decision once the registry's champion is taken into account.

    ``model_fingerprint``, ``eval_fingerprint``: the tuned model's and its eval set's. Promotion needs the tuned
    model to beat the champion's measured figure strictly; the champion itself (same model fingerprint) is never
    promoted again; a champion whose evaluation has no figure for the metric blocks promotion.
    """
    if champion is None:
        return ChampionComparison(decision, None, [])
    metric = METRICS[decision.metric]
    record: dict[str, Any] = {
        "version": champion.version,
        "version_uri": champion.version_uri,
        "run_id": champion.run_id,
        "model_fingerprint": champion.model_fingerprint,
        "gate_manifest": champion.gate_manifest,
        "evaluation_manifest": champion.evaluation_manifest,
        "metric": metric.name,
        "value": champion.measured,
    }
    notes = _recorded_differently(champion, metric.name)
    if champion.eval_set_fingerprint and eval_fingerprint and champion.eval_set_fingerprint != eval_fingerprint:
        notes.append(
            f"the champion (version {champion.version}) was evaluated on another eval set; its {metric.name} is "
            "compared as measured on that set"
        )
    who = f"the champion (version {champion.version}, run {champion.run_id})"
    measured = champion.measured
    if model_fingerprint and model_fingerprint == champion.model_fingerprint:
        verdict, beats = f"the tuned model is {who} itself", False
    elif measured is None:
        verdict = f"{who}'s evaluation has no per-example {metric.column!r} column, so it cannot be compared"
        beats = False
    elif decision.tuned > measured if metric.higher_is_better else decision.tuned < measured:
        verdict, beats = f"{metric.name} {decision.tuned:.3f} beats {who}: {measured:.3f}", True
    else:
        verdict, beats = f"{metric.name} {decision.tuned:.3f} does not beat {who}: {measured:.3f}", False
    record["verdict"] = verdict
    record["beaten"] = beats
    if not decision.promote:
        return ChampionComparison(replace(decision, reason=f"{decision.reason} ({verdict})"), record, notes)
    if beats:
        return ChampionComparison(replace(decision, reason=f"{decision.reason}; {verdict}"), record, notes)
    reason = f"{decision.reason}; but {verdict}: not promoted"
    return ChampionComparison(replace(decision, promote=False, reason=reason), record, notes)


def _recorded_differently(champion: Champion, metric: str) -> list[str]:
    """A note when the champion's version records another figure than its evaluation gives."""
    if champion.measured is None:
        return []
    if champion.recorded_figure is not None and abs(champion.recorded_figure - champion.measured) <= 1e-9:
        return []
    shown = repr(champion.recorded)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return [
        f"the champion's version {champion.version} records {metric} {shown}; measured from its committed "
        f"evaluation {champion.evaluation_manifest} it is {champion.measured:.6f}, which is what is compared"
    ]
