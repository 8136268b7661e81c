"""The regression guard's set and its scoring rule: did fine-tuning break what the base model could do?

Besides the task's eval set, both evaluations score a small general multiple-choice set (``gate.guard``)
and the gate requires the tuned model not to fall more than ``gate.guard.max_drop`` below the base on it
(:func:`loraflow.evaluation.gate_rule.guard_check`, the same paired bootstrap as the promotion rule).

A guard set is JSONL, one question a line::

    {"id": "general-mc-000", "question": "Which planet is closest to the Sun?",
     "choices": ["Venus", "Mars", "Mercury", "Jupiter"], "answer": 2}

``choices``: 2 to 10 different, non-blank options; ``answer``: the index of the right one; ``id``
optional (the line's number), unique. loraflow ships :data:`SHIPPED` sets (written by
:mod:`loraflow.evaluation.guard_data`, never downloaded); a spec may name its own file instead.

How a question is scored (log-likelihood, the way lm-evaluation-harness scores multiple choice; no
generation, so no answer format for a base model to miss):

* the question is the user turn, rendered with the eval set's chat template and its generation
  prompt exactly as evaluate renders the task's prompts (:func:`loraflow.evaluation.examples.render_prompts`);
* each option is the assistant's answer: its continuation is what the template writes for an
  assistant turn with that content, up to the end of the content (the end-of-turn tokens after it are
  not scored: they would measure how the model stops, not what it knows), tokenised alone, as
  training tokenises an answer piece, and appended to the prompt's ids: the boundary between
  question and answer falls where training puts it. Where the content ends is found from the
  template's structure, never by searching for the option's text (Qwen3 writes ``<think>\n\n</think>\n\n``
  before every answer, so the option "thin" occurs inside the template's own text): the same turn is
  rendered with :data:`ANSWER_MARK` as its content, and what the template writes around the mark is
  what it writes around every answer (:func:`continuation`);
* the option's score is the sum of the log-probabilities vLLM gives its tokens (``prompt_logprobs``)
  divided by its length in UTF-8 bytes (lm-evaluation-harness's ``acc_norm``: a sum alone favours
  short options); the model's choice is the highest score, ties going to the first option listed
  (the shipped sets put the right answer in each place equally often, so ties favour no answer);
* the question counts as correct when the choice is the reference ``answer``.

Standard library only: the spec schema imports the shipped names.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.storage import json_objects

SETS_DIR = Path(__file__).resolve().parent / "guard_sets"
#: The sets loraflow ships, by name -> what each holds.
SHIPPED: dict[str, str] = {
    "general-mc-v1": "100 general questions (common facts, everyday reasoning, word meanings), 4 options each",
    "arithmetic-mc-v1": "120 one- and two-step arithmetic word problems from templates, 4 numeric options each",
}
MIN_CHOICES, MAX_CHOICES = 2, 10
#: The largest guard set file read (the shipped ones are 14-20 KB): a set is small by design, and a
#: bucket writer's huge file must not exhaust the evaluation's memory.
MAX_SET_BYTES = 16 << 20
#: The per-question file the evaluate step writes beside predictions.jsonl.
PREDICTIONS_FILE = "guard_predictions.jsonl"


class GuardSetError(LoraflowError):
    """A guard set that cannot be read or is not in the guard format."""


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    choices: tuple[str, ...]
    answer: int


def check_setting(value: str) -> str:
    """A ``gate.guard.set`` value: a shipped name or a gs:// URI (the URI itself is checked by the schema)."""
    if value in SHIPPED or value.startswith("gs://"):
        return value
    raise ValueError(
        f"{value!r} is neither a shipped guard set ({', '.join(SHIPPED)}) nor a gs:// URI of a JSONL file "
        "of {id, question, choices, answer} rows; name one of those"
    )


def shipped_path(name: str) -> Path:
    if name not in SHIPPED:
        raise GuardSetError(f"no shipped guard set {name!r}; shipped: {', '.join(SHIPPED)}")
    return SETS_DIR / f"{name}.jsonl"


def find_set_file(root: Path) -> Path:
    """The JSONL of a guard-set input: the input itself when a file, else the one ``*.jsonl`` in it."""
    if root.is_file():
        return root
    found = sorted(root.rglob("*.jsonl"))
    if len(found) != 1:
        raise GuardSetError(f"the guard set input {root} must be one JSONL file; found {[str(p) for p in found]}")
    return found[0]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_questions(path: Path) -> list[Question]:
    """Every row of a guard set, checked; GuardSetError naming the line and the fix otherwise."""
    size = path.stat().st_size
    if size > MAX_SET_BYTES:
        raise GuardSetError(
            f"guard set {path.name} is {size} bytes, more than the {MAX_SET_BYTES >> 20} MiB a guard set may be; "
            "a guard set is a few hundred questions: name a smaller file"
        )
    out: list[Question] = []
    seen: set[str] = set()
    problems: list[str] = []
    for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path.name}:{line_no}"
        try:  # a row is read as every JSON object from storage is: UTF-8, depth-bounded, an object
            question = _question(json_objects.parse_object(line), len(out))
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if question.id in seen:
            problems.append(f"{where}: id {question.id!r} appears twice; give every question its own id")
        seen.add(question.id)
        out.append(question)
    if not out and not problems:
        problems.append(f"{path.name} holds no questions")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise GuardSetError(
            f'guard set {path.name}: {shown}. A row is {{"id", "question", "choices": [2-10 options], '
            '"answer": index of the right option}'
        )
    return out


def _question(row: Any, index: int) -> Question:
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    unknown = sorted(set(row) - {"id", "question", "choices", "answer"})
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}")
    question, choices, answer = row.get("question"), row.get("choices"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-blank string")
    if not (isinstance(choices, list) and all(isinstance(c, str) and c.strip() for c in choices)):
        raise ValueError("'choices' must be a list of non-blank strings")
    if not MIN_CHOICES <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"{len(choices)} choices; give {MIN_CHOICES} to {MAX_CHOICES}")
    if len(set(choices)) != len(choices):
        raise ValueError("two choices are the same text; the model could not tell them apart")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise ValueError(f"'answer' must be the index of the right choice, 0 to {len(choices) - 1} (got {answer!r})")
    return Question(str(row.get("id", index)), question, tuple(choices), answer)


#: The content of the assistant's turn that shows where a chat template writes the answer (see
#: :func:`continuation`): plain ASCII with no spaces, so no template trims, escapes or splits it.
ANSWER_MARK = "LORAFLOW-GUARD-ANSWER-7c1f"


def continuation(option_piece: str, marked_piece: str, option: str) -> str:
    """What is scored of an option: the template's answer piece up to the end of the option's text.

    ``option_piece`` and ``marked_piece`` are what the chat template writes for the same assistant turn
    with the content ``option`` and :data:`ANSWER_MARK` (:func:`loraflow.data.chat_template.pieces`). The
    text the template writes before and after the mark (a turn header, an empty think block; the
    end-of-turn tokens) must stand before and after the option too; the continuation is the option's
    piece without the text after. GuardSetError when the template writes the mark other than once, or
    the option other than between that same text.
    """
    before, mark, after = marked_piece.partition(ANSWER_MARK)
    if not mark or ANSWER_MARK in after:
        raise GuardSetError(
            f"the chat template does not write the assistant's answer once, as given (for the answer {ANSWER_MARK!r} "
            f"it writes {_shown(marked_piece)}); a guard set is scored through the template as the eval set is: "
            "use a template that writes the assistant's content as it is given"
        )
    end = len(option_piece) - len(after)
    if not (option_piece.startswith(before) and option_piece.endswith(after) and end > len(before)):
        raise GuardSetError(
            f"the chat template writes the answer {option!r} as {_shown(option_piece)}, not between "
            f"{_shown(before)} and {_shown(after)} as it writes other answers, so its text cannot be told from the "
            "template's: reword the option, or use a template that writes every answer the same way"
        )
    return option_piece[:end]


def _shown(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def option_score(token_logprobs: Sequence[float], option: str) -> float:
    """The option's log-likelihood per UTF-8 byte of its text (see the module's scoring)."""
    return math.fsum(token_logprobs) / max(1, len(option.encode("utf-8")))


def choose(scores: Sequence[float]) -> int:
    """The index of the highest score, the first one on a tie."""
    best = 0
    for i, score in enumerate(scores):
        if score > scores[best]:
            best = i
    return best


@dataclass(frozen=True)
class GuardResult:
    """A guard set scored: the set's identity and, per question in set order, the choice and whether it is right."""

    name: str
    sha256: str
    ids: list[str]
    chosen: list[int]
    correct: list[bool]
    scores: list[list[float]]

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    def summary(self) -> dict[str, Any]:
        """metrics.json's ``guard``: the set, its sha256, n, accuracy and the per-question lists."""
        return {
            "set": self.name,
            "sha256": self.sha256,
            "n": len(self.ids),
            "accuracy": self.accuracy,
            "n_correct": sum(self.correct),
            "ids": self.ids,
            "correct": self.correct,
        }

    def rows(self, questions: Sequence[Question]) -> list[dict[str, Any]]:
        """The per-question rows of :data:`PREDICTIONS_FILE`."""
        return [
            {"id": q.id, "question": q.question, "choices": list(q.choices), "answer": q.answer,
             "chosen": c, "correct": ok, "scores": s}
            for q, c, ok, s in zip(questions, self.chosen, self.correct, self.scores, strict=True)
        ]  # fmt: skip


def result(name: str, sha256: str, questions: Sequence[Question], scores: Sequence[Sequence[float]]) -> GuardResult:
    """The guard result of per-option scores (one list per question, one score per choice)."""
    chosen = [choose(s) for s in scores]
    return GuardResult(
        name,
        sha256,
        [q.id for q in questions],
        chosen,
        [c == q.answer for q, c in zip(questions, chosen, strict=True)],
        [[round(float(x), 6) for x in s] for s in scores],
    )


def token_sequences(
    questions: Sequence[Question],
    prompt_ids: Sequence[Sequence[int]],
    continuations: Callable[[Question], Sequence[str]],
    encode: Callable[[str], Sequence[int]],
) -> list[tuple[list[int], int]]:
    """Per question and choice (flattened, question-major): the full token ids and where the option begins."""
    out = []
    for q, prompt in zip(questions, prompt_ids, strict=True):
        for text in continuations(q):
            option_ids = [int(t) for t in encode(text)]
            if not option_ids:
                raise GuardSetError(f"guard question {q.id!r}: an option tokenises to nothing")
            out.append(([*map(int, prompt), *option_ids], len(prompt)))
    return out
