"""The metrics an evaluation reports and the gate may gate on, each declared once.

A metric is the share of eval examples its scorer counts. Each row of :data:`METRICS` says

* ``name``: the spec's ``gate.metric`` value and the rate's key in ``metrics.json``;
* ``column``: the per-example outcome: a bool column of ``predictions.parquet``, the list of that
  name in ``metrics.json`` (for the gate's paired comparison) and ``n_<column>``, its count;
* ``description``: what it measures (the spec reference lists it);
* ``scorer``: how one example is scored from its outputs (:class:`loraflow.evaluation.scoring.Outputs`);
* ``higher_is_better``: whether the gate promotes on a rise (True) or a fall.

The spec schema takes the allowed ``gate.metric`` and ``evaluation.metrics`` values from here (and
writes the default choice itself), the evaluate step scores the metrics the spec chooses
(:class:`Scoring`, built once from its config: ``evaluation.metrics`` and ``gate.metric``), the gate reads the metric's column,
the run report shows every metric an evaluation scored. A new metric is a scorer in ``scoring.py``
and a row here (docs/architecture.md, "Adding a metric").

Standard library only: the spec schema imports it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

from loraflow.errors import ArtifactError
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


def chosen(names: Iterable[str]) -> list[Metric]:
    """The metrics of ``names``, in table order."""
    wanted = set(names)
    return [m for m in METRICS.values() if m.name in wanted]


@dataclass(frozen=True)
class Scoring:
    """How an evaluation scores: which metrics, where the answer comes from, the numeric tolerance.

    ``metrics``: names of the table, scored in table order; ``answer_pattern``: the regex of
    ``answer_format="pattern"`` (compiled here, once); ``answer_format``: ``"pattern"`` or ``"tagged"`` (the
    ``<answer>`` tags); ``relative_tolerance``: :func:`loraflow.evaluation.scoring.numeric_close`'s. No field
    has a default: build it from a config (:meth:`of`) or from what an evaluation recorded (:meth:`recorded`).
    """

    metrics: tuple[str, ...]
    answer_pattern: str | re.Pattern[str]
    answer_format: str
    relative_tolerance: float

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
        """The settings of an evaluate config (``loraflow.spec.step_configs.EvaluateConfig``, or the spec's
        ``evaluation`` section)."""
        return cls(tuple(config.metrics), config.answer_pattern, config.answer_format, float(config.relative_tolerance))

    @classmethod
    def recorded(cls, config: Mapping[str, Any], where: str) -> Scoring:
        """The settings an evaluation recorded: its metrics.json ``config`` (the evaluate config as it ran), read
        from ``where``; a config that lacks one is refused naming it."""
        missing = [name for name in SETTINGS if name not in config]
        if missing:
            raise ArtifactError(f"{where} records no {', '.join(missing)} in its config; re-run the evaluate stage")
        return cls.of(SimpleNamespace(**{name: config[name] for name in SETTINGS}))

    @property
    def chosen(self) -> list[Metric]:
        """The metrics scored, in table order."""
        return chosen(self.metrics)

    def outputs(self, generation: str, reference: str) -> scoring.Outputs:
        return scoring.Outputs.of(
            generation, reference, self.answer_pattern, self.answer_format, self.relative_tolerance
        )


#: The evaluate config's keys a :class:`Scoring` is built from (its fields).
SETTINGS = tuple(f.name for f in fields(Scoring))


@dataclass(frozen=True)
class ScoredExample:
    """One generation scored: the extracted answer (raw) and, per metric column, whether it counts."""

    answer: str | None
    outcomes: dict[str, bool]


def score(generation: str, reference: str, settings: Scoring) -> ScoredExample:
    """Score one generation against its reference with the scorer of every metric ``settings`` chooses."""
    outputs = settings.outputs(generation, reference)
    return ScoredExample(outputs.answer, {m.column: bool(m.scorer(outputs)) for m in settings.chosen})


def score_all(generations: Sequence[str], references: Sequence[str], settings: Scoring) -> list[ScoredExample]:
    """Score generations against references pairwise (the sequences must have the same length)."""
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations but {len(references)} references")
    return [score(g, r, settings) for g, r in zip(generations, references, strict=True)]


def aggregate(scored: Iterable[ScoredExample], metrics: Sequence[str]) -> dict[str, Any]:
    """The metrics named in ``metrics`` over the scored examples, in input order.

    Returns ``n`` and, per metric, ``n_<column>`` (how many examples count), ``<name>``
    (``n_<column> / n``, 0.0 when ``n == 0``; format failures count as wrong) and ``<column>`` (the
    per-example bools, for paired comparisons): ``n, n_correct, n_format_ok, accuracy, format_rate,
    correct, format_ok`` for accuracy and format_rate.
    """
    items = list(scored)
    n = len(items)
    named = chosen(check_names(metrics))
    columns = {m.column: [bool(s.outcomes[m.column]) for s in items] for m in named}
    counts = {f"n_{column}": sum(values) for column, values in columns.items()}
    rates = {m.name: counts[f"n_{m.column}"] / n if n else 0.0 for m in named}
    return {"n": n, **counts, **rates, **columns}
