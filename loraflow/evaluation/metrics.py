"""The metrics an evaluation reports and the gate may gate on, each declared once.

A metric is the share of eval examples its scorer counts. Each row of :data:`METRICS` says

* ``name``: the spec's ``gate.metric`` value and the rate's key in ``metrics.json``;
* ``column``: the per-example outcome: a bool column of ``predictions.parquet``, the list of that
  name in ``metrics.json`` (for the gate's paired comparison) and ``n_<column>``, its count;
* ``description``: what it measures (the spec reference lists it);
* ``scorer``: how one example is scored from its outputs (:class:`loraflow.evaluation.scoring.Outputs`);
* ``higher_is_better``: whether the gate promotes on a rise (True) or a fall.

The spec schema takes the allowed ``gate.metric`` and ``evaluation.metrics`` values from here, the
evaluate step scores the metrics the spec chooses (:class:`Scoring`: ``evaluation.metrics`` and
``gate.metric``; :data:`DEFAULT_METRICS` when it names none), the gate reads the metric's column,
the run report shows every metric an evaluation scored. A new metric is a scorer in ``scoring.py``
and a row here (docs/architecture.md, "Adding a metric").

Standard library only: the spec schema imports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from loraflow.evaluation import scoring


@dataclass(frozen=True)
class Metric:
    name: str
    column: str
    description: str
    scorer: Callable[[scoring.Outputs], bool]
    higher_is_better: bool = True


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric(
            "accuracy",
            "correct",
            "share of examples whose answer equals the reference (both normalised); a format failure is wrong",
            scoring.exact_match,
        ),
        Metric(
            "format_rate",
            "format_ok",
            "share of examples in which an answer is found (by evaluation.answer_pattern, or in the "
            "<answer> tags when evaluation.answer_format is tagged)",
            scoring.answer_found,
        ),
        Metric(
            "numeric_accuracy",
            "numeric_correct",
            "share of examples whose answer's last number equals the reference's (1,000 = 1000.0); no number is wrong",
            scoring.numeric_match,
        ),
        Metric(
            "approx_accuracy",
            "approx_correct",
            "share of examples whose answer's last number is within evaluation.relative_tolerance of the "
            "reference's (relative; a reference of 0 needs 0)",
            scoring.numeric_close,
        ),
        Metric(
            "tagged_format_rate",
            "tagged_format_ok",
            "share of generations laid out as <reasoning>...</reasoning> then <answer>...</answer>, each tag once",
            scoring.tagged_format_ok,
        ),
    )
}

#: What an evaluation scores when nothing chooses (``evaluation.metrics``' default).
DEFAULT_METRICS: tuple[str, ...] = ("accuracy", "format_rate")


def check_name(name: str) -> str:
    """``name`` when it is a metric of the table; else a ValueError naming the allowed ones."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; use one of: {', '.join(METRICS)}")
    return name


def described() -> str:
    """Every metric with what it measures, for the spec reference."""
    return "; ".join(f"`{m.name}`: {m.description}" for m in METRICS.values())


def check_names(names: Sequence[str]) -> list[str]:
    """``names`` when each is a metric of the table, once; else a ValueError naming the problem."""
    for name in names:
        check_name(name)
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        raise ValueError(f"metric(s) named twice: {', '.join(twice)}")
    return list(names)


@dataclass(frozen=True)
class Scoring:
    """How an evaluation scores: which metrics, where the answer comes from, the numeric tolerance.

    ``metrics``: names of the table, scored in table order; ``answer_pattern``: the regex of
    ``answer_format="pattern"``; ``answer_format``: ``"pattern"`` or ``"tagged"`` (the ``<answer>``
    tags); ``relative_tolerance``: :func:`loraflow.evaluation.scoring.numeric_close`'s.
    """

    metrics: tuple[str, ...] = DEFAULT_METRICS
    answer_pattern: str | re.Pattern[str] | None = None
    answer_format: str = "pattern"
    relative_tolerance: float = scoring.DEFAULT_RELATIVE_TOLERANCE

    def __post_init__(self) -> None:
        check_names(self.metrics)
        if self.answer_format not in scoring.ANSWER_FORMATS:
            raise ValueError(
                f"unknown answer_format {self.answer_format!r}; use one of: {', '.join(scoring.ANSWER_FORMATS)}"
            )
        if not 0 <= self.relative_tolerance <= 1:
            raise ValueError(f"relative_tolerance must lie in [0, 1], got {self.relative_tolerance}")
        object.__setattr__(self, "answer_pattern", scoring.compile_pattern(self.answer_pattern))

    @classmethod
    def of(cls, config: Any) -> Scoring:
        """The settings of an evaluate config (``loraflow.spec.step_configs.EvaluateConfig``)."""
        return cls(tuple(config.metrics), config.answer_pattern, config.answer_format, float(config.relative_tolerance))

    @property
    def chosen(self) -> list[Metric]:
        """The metrics scored, in table order."""
        return [m for m in METRICS.values() if m.name in self.metrics]

    def outputs(self, generation: str, reference: str) -> scoring.Outputs:
        return scoring.Outputs.of(
            generation, reference, self.answer_pattern, self.answer_format, self.relative_tolerance
        )


@dataclass(frozen=True)
class ScoredExample:
    """One generation scored: the extracted answer (raw) and, per metric column, whether it counts."""

    answer: str | None
    outcomes: dict[str, bool]


def _settings(pattern: str | re.Pattern[str] | None, settings: Scoring | None) -> Scoring:
    if settings is None:
        return Scoring(answer_pattern=pattern)
    if pattern is not None:
        raise ValueError("give the answer pattern in the Scoring settings, not beside them")
    return settings


def score(
    generation: str,
    reference: str,
    pattern: str | re.Pattern[str] | None = None,
    *,
    settings: Scoring | None = None,
) -> ScoredExample:
    """Score one generation against its reference with the scorer of every chosen metric.

    ``settings`` chooses the metrics and the answer's source; without them, :data:`DEFAULT_METRICS`
    with ``pattern`` (``None``: the default pattern).
    """
    chosen = _settings(pattern, settings)
    outputs = chosen.outputs(generation, reference)
    return ScoredExample(outputs.answer, {m.column: bool(m.scorer(outputs)) for m in chosen.chosen})


def score_all(
    generations: Sequence[str],
    references: Sequence[str],
    pattern: str | re.Pattern[str] | None = None,
    *,
    settings: Scoring | None = None,
) -> list[ScoredExample]:
    """Score generations against references pairwise (the sequences must have the same length)."""
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations but {len(references)} references")
    chosen = _settings(pattern, settings)
    return [score(g, r, settings=chosen) for g, r in zip(generations, references, strict=True)]


def aggregate(scored: Iterable[ScoredExample], metrics: Sequence[str] | None = None) -> dict[str, Any]:
    """The chosen metrics (``None``: :data:`DEFAULT_METRICS`) over the scored examples, in input order.

    Returns ``n`` and, per metric, ``n_<column>`` (how many examples count), ``<name>``
    (``n_<column> / n``, 0.0 when ``n == 0``; format failures count as wrong) and ``<column>`` (the
    per-example bools, for paired comparisons): ``n, n_correct, n_format_ok, accuracy, format_rate,
    correct, format_ok`` by default.
    """
    items = list(scored)
    n = len(items)
    chosen = Scoring(tuple(DEFAULT_METRICS if metrics is None else metrics)).chosen
    columns = {m.column: [bool(s.outcomes[m.column]) for s in items] for m in chosen}
    counts = {f"n_{column}": sum(values) for column, values in columns.items()}
    rates = {m.name: counts[f"n_{m.column}"] / n if n else 0.0 for m in chosen}
    return {"n": n, **counts, **rates, **columns}
