"""The metrics an evaluation reports and the gate may gate on, each declared once.

A metric is the share of eval examples its scorer counts. Each row of :data:`METRICS` says

* ``name``: the spec's ``gate.metric`` value and the rate's key in ``metrics.json``;
* ``column``: the per-example outcome: a bool column of ``predictions.parquet``, the list of that
  name in ``metrics.json`` (for the gate's paired comparison) and ``n_<column>``, its count;
* ``description``: what it measures (the spec reference lists it);
* ``scorer``: how one example is scored from its outputs (:class:`loraflow.evaluation.scoring.Outputs`);
* ``higher_is_better``: whether the gate promotes on a rise (True) or a fall.

The spec schema takes the allowed ``gate.metric`` values from here, the evaluate step scores every
metric of the table, the gate reads the metric's column, the run report shows every metric. A new
metric is a scorer in ``scoring.py`` and a row here (docs/architecture.md, "Adding a metric").

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
            "share of examples in which evaluation.answer_pattern finds an answer",
            scoring.answer_found,
        ),
    )
}


def check_name(name: str) -> str:
    """``name`` when it is a metric of the table; else a ValueError naming the allowed ones."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; use one of: {', '.join(METRICS)}")
    return name


def described() -> str:
    """Every metric with what it measures, for the spec reference."""
    return "; ".join(f"`{m.name}`: {m.description}" for m in METRICS.values())


@dataclass(frozen=True)
class ScoredExample:
    """One generation scored: the extracted answer (raw) and, per metric column, whether it counts."""

    answer: str | None
    outcomes: dict[str, bool]


def score(generation: str, reference: str, pattern: str | re.Pattern[str] | None = None) -> ScoredExample:
    """Score one generation against its reference with every metric's scorer."""
    outputs = scoring.Outputs.of(generation, reference, pattern)
    return ScoredExample(outputs.answer, {m.column: bool(m.scorer(outputs)) for m in METRICS.values()})


def score_all(
    generations: Sequence[str], references: Sequence[str], pattern: str | re.Pattern[str] | None = None
) -> list[ScoredExample]:
    """Score generations against references pairwise (the sequences must have the same length)."""
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations but {len(references)} references")
    compiled = scoring.compile_pattern(pattern)
    return [score(g, r, compiled) for g, r in zip(generations, references, strict=True)]


def aggregate(scored: Iterable[ScoredExample]) -> dict[str, Any]:
    """Every metric over the scored examples, in input order.

    Returns ``n`` and, per metric, ``n_<column>`` (how many examples count), ``<name>``
    (``n_<column> / n``, 0.0 when ``n == 0``; format failures count as wrong) and ``<column>`` (the
    per-example bools, for paired comparisons): ``n, n_correct, n_format_ok, accuracy, format_rate,
    correct, format_ok`` today.
    """
    items = list(scored)
    n = len(items)
    columns = {m.column: [bool(s.outcomes[m.column]) for s in items] for m in METRICS.values()}
    counts = {f"n_{column}": sum(values) for column, values in columns.items()}
    rates = {m.name: counts[f"n_{m.column}"] / n if n else 0.0 for m in METRICS.values()}
    return {"n": n, **counts, **rates, **columns}
