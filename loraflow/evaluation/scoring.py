"""Scoring one generation against its reference: answer extraction, normalisation, the scorers.

Pure functions on strings (standard library only), shared by the evaluate step program and anything
that re-scores its ``predictions``. Which scorers an evaluation runs, and the metric each one
makes, is the metric table's (:mod:`loraflow.evaluation.metrics`). The exact-match scorer behind
``accuracy`` works in three steps:

1. **extract**: ``answer_pattern`` (a regular expression, searched with :func:`re.search`) picks the
   answer out of the generation; group 1 is the answer (the whole match when the pattern has no
   group). A generation the pattern does not match, or whose answer normalises to nothing, is a
   *format failure*: it has no answer and counts as wrong.
2. **normalise**: strip whitespace, casefold, strip trailing punctuation (``"Even."`` -> ``"even"``).
   The reference is normalised the same way.
3. **compare**: exact match of the two normalised strings.

A scorer (:func:`exact_match`, :func:`answer_found`) takes an example's :class:`Outputs` and
says whether the example counts for its metric.
"""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass

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
class Outputs:
    """What a scorer sees of one example: the generation, its reference and ``answer_pattern``'s answer."""

    generation: str
    reference: str
    answer: str | None  # as extracted (not normalised); None: the pattern found none

    @classmethod
    def of(cls, generation: str, reference: str, pattern: str | re.Pattern[str] | None = None) -> Outputs:
        return cls(generation, reference, extract_answer(generation, pattern))


def answer_found(outputs: Outputs) -> bool:
    """The format check: the pattern found an answer that does not normalise to nothing."""
    return outputs.answer is not None and bool(normalize(outputs.answer))


def exact_match(outputs: Outputs) -> bool:
    """The answer equals the reference once both are normalised; a format failure is wrong."""
    return answer_found(outputs) and normalize(str(outputs.answer)) == normalize(outputs.reference)
