"""The arithmetic word problems loraflow makes for itself: a second shipped task, in the tagged format.

MaxText's LoRA/QLoRA tutorial evaluates on GSM8K-style problems answered as
``<reasoning>...</reasoning><answer>...</answer>``. Nothing can be downloaded where loraflow runs its
demo and tests, so this module writes a small task of that shape that a tiny model can learn on a
laptop in a minute: a one-step addition or subtraction of small numbers, a one-line reasoning, the
answer.

    python -m loraflow.dev.arithmetic [--out pipelines/data/arithmetic] [--seed 0] [--train 2000] [--eval 400]

Rows are ``{"prompt", "completion"}`` JSON lines, as ``pipelines/data/parity`` (validate_data turns
them into chat rows; an eval row's completion becomes its reference), e.g.::

    {"prompt": "Mia has 7 pens. She gives away 3. How many pens does Mia have now?",
     "completion": "<reasoning>7 - 3 = 4</reasoning><answer>4</answer>"}

What a model must learn: read the two numbers and the operation out of the wording (six people, six
kinds of thing, two verbs), write them in the reasoning, and know the sums and differences of the
116 pairs the problems use (2-9 plus or minus 1-9, never below 0). Every eval problem is worded
differently from every training problem (no eval prompt is in the training set, no example
repeats: the data contract's leakage and duplicates rules), but the pairs are shared: a tiny model
tuned on it learns to read and to recall, not to generalise arithmetic. The order is a sha256 of
the seed and the prompt, so the files are the same bytes for a seed on any machine and Python
version. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "pipelines" / "data" / "arithmetic"
TRAIN_ROWS = 2000
EVAL_ROWS = 400

NAMES = (("Tom", "He"), ("Ann", "She"), ("Sam", "He"), ("Mia", "She"), ("Ben", "He"), ("Eva", "She"))
OBJECTS = ("apples", "pens", "cards", "coins", "books", "shells")
START = range(2, 10)  # what the person has at first
STEP = range(1, 10)  # what the step adds or takes away


@dataclass(frozen=True)
class Problem:
    prompt: str
    reasoning: str
    answer: int

    @property
    def completion(self) -> str:
        return f"<reasoning>{self.reasoning}</reasoning><answer>{self.answer}</answer>"

    def row(self) -> dict[str, str]:
        return {"prompt": self.prompt, "completion": self.completion}


def problems() -> Iterator[Problem]:
    """Every problem: each person, thing, start, operation and amount whose result is not below 0."""
    for name, pronoun in NAMES:
        for obj in OBJECTS:
            for start in START:
                for op in ("+", "-"):
                    for x in STEP:
                        total = start + x if op == "+" else start - x
                        if total < 0:
                            continue
                        phrase = f"gets {x} more" if op == "+" else f"gives away {x}"
                        prompt = f"{name} has {start} {obj}. {pronoun} {phrase}. How many {obj} does {name} have now?"
                        yield Problem(prompt, f"{start} {op} {x} = {total}", total)


def _order(seed: int, problem: Problem) -> str:
    return hashlib.sha256(f"{seed}\0{problem.prompt}".encode()).hexdigest()


def make(seed: int = 0, train: int = TRAIN_ROWS, eval_: int = EVAL_ROWS) -> tuple[list[Problem], list[Problem]]:
    """The (train, eval) problems for ``seed``: disjoint, each in the seed's order."""
    pool = sorted(problems(), key=lambda p: _order(seed, p))
    if train + eval_ > len(pool):
        raise ValueError(f"only {len(pool)} problems exist; ask for at most that many rows in all")
    return pool[eval_ : eval_ + train], pool[:eval_]


def write(out: Path = DEFAULT_OUT, seed: int = 0, train: int = TRAIN_ROWS, eval_: int = EVAL_ROWS) -> list[Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, split in zip(("train.jsonl", "eval.jsonl"), make(seed, train, eval_), strict=True):
        path = out / name
        path.write_text("".join(json.dumps(p.row()) + "\n" for p in split))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loraflow.dev.arithmetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory to write train.jsonl and eval.jsonl into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=TRAIN_ROWS, help="training rows")
    p.add_argument("--eval", type=int, default=EVAL_ROWS, help="evaluation rows")
    args = p.parse_args(argv)
    for path in write(args.out, args.seed, args.train, args.eval):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
