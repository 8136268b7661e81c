"""Scoring one generation against its reference: answer extraction, normalisation, the scorers.

Pure functions on strings (the standard library, and the ``regex`` module for the time limit), shared by the evaluate step program and anything
that re-scores its ``predictions``. Which scorers an evaluation runs, and the metric each one
makes, is the metric table's (:mod:`loraflow.evaluation.metrics`). The exact-match scorer behind
``accuracy`` works in three steps:

1. **extract**: ``answer_pattern`` (a regular expression in Python's syntax) picks the answer out of
   the generation; group 1 is the answer (the whole match when the pattern has no group). A
   generation the pattern does not match, or whose answer normalises to nothing, is a *format
   failure*: it has no answer and counts as wrong. The search runs under a time limit per
   generation (:data:`PATTERN_TIME_LIMIT_S`, see :func:`extract_answer`).
2. **normalise**: strip whitespace, casefold, strip trailing punctuation (``"Even."`` -> ``"even"``).
   The reference is normalised the same way.
3. **compare**: exact match of the two normalised strings.

The answer comes from ``answer_pattern`` (``answer_format="pattern"``, the default) or, with
``answer_format="tagged"``, from the ``<answer>...</answer>`` tags of the format MaxText's LoRA
tutorial teaches (``<reasoning>...</reasoning><answer>...</answer>``, :func:`tagged_answer`); a
reference holding ``<answer>`` tags is then compared by their content too.

The numeric scorers read the *last number* of the answer and of the reference
(:func:`last_number`: ``"-1,234.5 apples."`` -> ``-1234.5``) and compare them exactly
(:func:`numeric_match`) or within a relative tolerance (:func:`numeric_close`,
``|answer - reference| <= tolerance * |reference|``; a reference of 0 needs an answer of 0).
:func:`tagged_format_ok` is the tutorial's format check.

A scorer (:func:`exact_match`, :func:`answer_found`, :func:`numeric_match`, :func:`numeric_close`,
:func:`tagged_format_ok`) takes an example's :class:`Outputs` and says whether the example counts
for its metric.

The settings (the pattern, the answer's source, the tolerance) have no defaults here: they come from the
spec's ``evaluation`` section (loraflow/spec/schema.py, where each default is written), through the
evaluate step's config and :class:`loraflow.evaluation.metrics.Scoring`.
"""

from __future__ import annotations

import functools
import re
import string
import unicodedata
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from loraflow.errors import LoraflowError

_ASCII_PUNCT = frozenset(string.punctuation)

#: Where the answer comes from: ``answer_pattern``'s group 1, or the ``<answer>`` tags.
AnswerFormat = Literal["pattern", "tagged"]
ANSWER_FORMATS: tuple[str, ...] = ("pattern", "tagged")

# A number: an optional sign (not glued to a word or number before it: "10-3" holds 10 and 3), digits
# not glued to a digit or point before them, with optional thousands commas (groups of three only)
# and an optional decimal part.
_NUMBER = re.compile(r"(?:(?<![\w.])([-+\u2212]))?(?<![\d.])((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
_TAGS = ("<reasoning>", "</reasoning>", "<answer>", "</answer>")
# The first <answer>...</answer> pair whose content holds no <answer> (the innermost when nested).
_ANSWER_TAGGED = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
# The tutorial's layout: reasoning, then (after anything) the answer, nothing but whitespace around.
_TAGGED_LAYOUT = re.compile(r"\s*<reasoning>(.*?)</reasoning>.*?<answer>(.*?)</answer>\s*", re.DOTALL)


#: The longest one search of ``answer_pattern`` may take in one generation, in seconds. A sound
#: pattern takes microseconds to milliseconds on the longest generation; one that backtracks
#: catastrophically (``((a|aa)+)+b`` took 81 s on 20 characters with :mod:`re`, and doubles every few
#: characters more) is stopped here and fails the evaluation naming itself (:class:`AnswerPatternTimeout`).
PATTERN_TIME_LIMIT_S = 1.0


class AnswerPatternTimeout(LoraflowError):
    """``answer_pattern`` took longer than :data:`PATTERN_TIME_LIMIT_S` on one generation."""


def compile_pattern(pattern: str | re.Pattern[str]) -> re.Pattern[str]:
    """Compile ``pattern`` (a compiled one is returned as it is).

    Raises :class:`ValueError` with the reason when the pattern is not a valid regular expression.
    """
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


# re's flags and the regex module's (their values differ: re.ASCII is 256, regex.ASCII 128).
_FLAGS = ("IGNORECASE", "MULTILINE", "DOTALL", "VERBOSE", "ASCII")


@functools.lru_cache(maxsize=16)
def _timed(pattern: str, flags: int) -> Any:
    """``pattern`` compiled by the ``regex`` module, whose searches take a ``timeout`` (re's cannot be
    stopped: it holds the interpreter until it is done). Its default mode (VERSION0) is re's syntax and
    matching; the spec's pattern was checked with re.compile."""
    import regex

    regex_flags = 0
    for name in _FLAGS:
        if flags & getattr(re, name):
            regex_flags |= getattr(regex, name)
    try:
        return regex.compile(pattern, regex_flags)
    except regex.error as exc:
        raise ValueError(f"answer_pattern {pattern!r} is not a valid regular expression ({exc})") from None


def extract_answer(generation: str, pattern: str | re.Pattern[str]) -> str | None:
    """The raw answer the pattern finds in ``generation`` (group 1, else the whole match), or ``None``.

    ``None`` means a format failure: no match, or an empty capture. The answer is returned as
    matched (not normalised); see :func:`normalize`. A search that takes longer than
    :data:`PATTERN_TIME_LIMIT_S` raises :class:`AnswerPatternTimeout`: the pattern backtracks
    catastrophically, and scoring that generation as wrong would bias the metric without a word.
    """
    compiled = compile_pattern(pattern)
    try:
        m = _timed(compiled.pattern, compiled.flags).search(generation, timeout=PATTERN_TIME_LIMIT_S)
    except TimeoutError:
        raise AnswerPatternTimeout(
            f"evaluation.answer_pattern {compiled.pattern!r} took more than {PATTERN_TIME_LIMIT_S:g} s on one "
            f"generation of {len(generation)} characters (starting {generation[:40]!r}): it backtracks "
            "catastrophically, trying exponentially many ways to split the text between nested or overlapping "
            "repetitions such as (a+)+, (a|aa)+ or (\\w+\\s?)*. Rewrite it so that each character can be "
            "matched one way only, e.g. a+ for (a|aa)+, and check it on a long generation"
        ) from None
    if m is None:
        return None
    answer = m.group(1) if compiled.groups >= 1 else m.group(0)
    if answer is None or not answer.strip():
        return None
    return answer


def tagged_answer(text: str) -> str | None:
    """The content of ``text``'s ``<answer>...</answer>`` tags, stripped; ``None`` when there are none.

    With several pairs the first is taken; with nested tags, the innermost first complete pair.
    An empty or blank content is ``None`` (a format failure, as for :func:`extract_answer`).
    """
    m = _ANSWER_TAGGED.search(text)
    if m is None or not m.group(1).strip():
        return None
    return m.group(1).strip()


def tagged_format_ok(outputs: Outputs) -> bool:
    """The tutorial's format check: ``<reasoning>...</reasoning>`` then ``<answer>...</answer>``.

    Each of the four tags exactly once, in that order, reasoning and answer not blank, nothing but
    whitespace before ``<reasoning>`` or after ``</answer>`` (anything may stand between
    ``</reasoning>`` and ``<answer>``, as in the tutorial's check).
    """
    text = outputs.generation
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    m = _TAGGED_LAYOUT.fullmatch(text)
    return m is not None and bool(m.group(1).strip()) and bool(m.group(2).strip())


def last_number(text: str | None) -> Decimal | None:
    """The last number in ``text`` as a :class:`~decimal.Decimal`, or ``None`` when it holds none.

    Signs (``-``, ``+``, the Unicode minus), thousands commas (``1,000``), decimals (``3.50``,
    ``.5``) and anything after it (a unit, a period: ``"12 apples."``) are understood; a sign glued
    to a preceding word or digit is not one (``"10-3"`` ends in 3), nor are exponents.
    """
    if not text:
        return None
    found = _NUMBER.findall(text)
    if not found:
        return None
    sign, digits = found[-1]
    try:
        value = Decimal(digits.replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the pattern admits only valid digits
        return None
    return -value if sign in ("-", "\u2212") else value


@dataclass(frozen=True)
class Outputs:
    """What a scorer sees of one example: the generation, its reference, the extracted answer and
    the settings a scorer needs (the reference's own answer when tagged, the numeric tolerance)."""

    generation: str
    reference: str
    answer: str | None  # as extracted (not normalised); None: none found (a format failure)
    reference_answer: str | None  # the reference's <answer> content (tagged format); None: the reference
    relative_tolerance: float

    @property
    def expected(self) -> str:
        """What the answer is compared to: the reference, or its ``<answer>`` content when tagged."""
        return self.reference if self.reference_answer is None else self.reference_answer

    @classmethod
    def of(
        cls,
        generation: str,
        reference: str,
        pattern: str | re.Pattern[str],
        answer_format: str,
        relative_tolerance: float,
    ) -> Outputs:
        """Extract the answer (``answer_format``: ``"pattern"`` or ``"tagged"``) and keep the settings."""
        if answer_format == "pattern":
            return cls(generation, reference, extract_answer(generation, pattern), None, relative_tolerance)
        if answer_format == "tagged":
            return cls(generation, reference, tagged_answer(generation), tagged_answer(reference), relative_tolerance)
        raise ValueError(f"unknown answer_format {answer_format!r}; use one of: {', '.join(ANSWER_FORMATS)}")


def answer_found(outputs: Outputs) -> bool:
    """The format check: an answer was found and it does not normalise to nothing."""
    return outputs.answer is not None and bool(normalize(outputs.answer))


def exact_match(outputs: Outputs) -> bool:
    """The answer equals the reference once both are normalised; a format failure is wrong."""
    return answer_found(outputs) and normalize(str(outputs.answer)) == normalize(outputs.expected)


def numeric_match(outputs: Outputs) -> bool:
    """The answer's last number equals the reference's (``1,000`` = ``1000.0``); no number is wrong."""
    got, want = last_number(outputs.answer), last_number(outputs.expected)
    return got is not None and want is not None and got == want


def numeric_close(outputs: Outputs) -> bool:
    """The answer's last number is within ``relative_tolerance`` of the reference's.

    ``|answer - reference| <= relative_tolerance * |reference|``: a reference of 0 needs exactly 0, a
    tolerance of 0 is :func:`numeric_match`. No number on either side is wrong.
    """
    got, want = last_number(outputs.answer), last_number(outputs.expected)
    if got is None or want is None:
        return False
    return abs(got - want) <= Decimal(str(outputs.relative_tolerance)) * abs(want)
