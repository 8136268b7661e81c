"""Scoring generations against references: answer extraction, normalisation, metrics.

Pure functions on strings and lists (standard library only), shared by the evaluate step program
and anything that re-scores its ``predictions``. One example is scored in three steps:

1. **extract**: ``answer_pattern`` (a regular expression, searched with :func:`re.search`) picks the
   answer out of the generation; group 1 is the answer (the whole match when the pattern has no
   group). A generation the pattern does not match, or whose answer normalises to nothing, is a
   *format failure*: it has no answer and counts as wrong.
2. **normalise**: strip whitespace, casefold, strip trailing punctuation (``"Even."`` -> ``"even"``).
   The reference is normalised the same way.
3. **compare**: exact match of the two normalised strings.

:func:`aggregate` turns the per-example results into ``accuracy`` and ``format_rate`` (both over
all ``n`` examples) and keeps the per-example ``correct`` / ``format_ok`` lists, in input order, so
that a later gate can compare two evaluations of the same eval set example by example (paired
bootstrap, McNemar).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: First "word-ish" token of the generation: everything up to whitespace or a ``<`` (the start of
#: a special token such as ``<|end|>`` if it was not stripped).
DEFAULT_ANSWER_PATTERN = r"^\s*([^\s<]+)"

_ASCII_PUNCT = frozenset(string.punctuation)


def compile_pattern(pattern: str | re.Pattern[str] | None = None) -> re.Pattern[str]:
    """Compile ``pattern`` (``None`` -> :data:`DEFAULT_ANSWER_PATTERN`).

    Raises :class:`ValueError` with the reason when the pattern is not a valid regular expression.
    """
    if pattern is None:
        pattern = DEFAULT_ANSWER_PATTERN
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"answer_pattern {pattern!r} is not a valid regular expression ({exc})") from None


def _is_punct(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def normalize(text: str) -> str:
    """Strip, casefold and drop trailing punctuation (ASCII and Unicode), e.g. ``" Even.\\n"`` -> ``"even"``."""
    out = text.strip().casefold()
    end = len(out)
    while end and (_is_punct(out[end - 1]) or out[end - 1].isspace()):
        end -= 1
    return out[:end]


def extract_answer(generation: str, pattern: str | re.Pattern[str] | None = None) -> str | None:
    """The raw answer the pattern finds in ``generation`` (group 1, else the whole match), or ``None``.

    ``None`` means a format failure: no match, or an empty capture. The answer is returned as
    matched (not normalised); see :func:`normalize`.
    """
    compiled = compile_pattern(pattern)
    m = compiled.search(generation)
    if m is None:
        return None
    answer = m.group(1) if compiled.groups >= 1 else m.group(0)
    if answer is None or not answer.strip():
        return None
    return answer


@dataclass(frozen=True)
class ScoredExample:
    """The score of one generation: the extracted answer (raw), whether it had the format, whether it is right."""

    answer: str | None
    format_ok: bool
    correct: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def score(generation: str, reference: str, pattern: str | re.Pattern[str] | None = None) -> ScoredExample:
    """Score one generation against its reference (see the module docstring for the rules)."""
    answer = extract_answer(generation, pattern)
    normalized = normalize(answer) if answer is not None else ""
    if not normalized:
        return ScoredExample(answer=answer, format_ok=False, correct=False)
    return ScoredExample(answer=answer, format_ok=True, correct=normalized == normalize(reference))


def score_all(
    generations: Sequence[str], references: Sequence[str], pattern: str | re.Pattern[str] | None = None
) -> list[ScoredExample]:
    """Score generations against references pairwise (the sequences must have the same length)."""
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations but {len(references)} references")
    compiled = compile_pattern(pattern)
    return [score(g, r, compiled) for g, r in zip(generations, references, strict=True)]


def aggregate(scored: Iterable[ScoredExample]) -> dict[str, Any]:
    """Metrics over scored examples, in input order.

    Returns ``{"n", "n_correct", "n_format_ok", "accuracy", "format_rate", "correct", "format_ok"}``
    where ``accuracy = n_correct / n`` and ``format_rate = n_format_ok / n`` (format failures count
    as wrong; both are 0.0 when ``n == 0``), and ``correct`` / ``format_ok`` are per-example lists of
    bools for paired comparisons.
    """
    items = list(scored)
    n = len(items)
    correct = [bool(s.correct) for s in items]
    format_ok = [bool(s.format_ok) for s in items]
    n_correct, n_format_ok = sum(correct), sum(format_ok)
    return {
        "n": n,
        "n_correct": n_correct,
        "n_format_ok": n_format_ok,
        "accuracy": n_correct / n if n else 0.0,
        "format_rate": n_format_ok / n if n else 0.0,
        "correct": correct,
        "format_ok": format_ok,
    }
