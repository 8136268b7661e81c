"""The arithmetic word problems loraflow makes for itself: a second shipped task, in the tagged format.

MaxText's LoRA/QLoRA tutorial evaluates on GSM8K-style problems answered as
``<reasoning>...</reasoning><answer>...</answer>``. Nothing can be downloaded where loraflow runs its
demo and tests, so this module writes a small task of that shape that a tiny model can learn on a
laptop: one- or two-step addition and subtraction of small numbers, a one-line reasoning, the answer.

    python -m loraflow.dev.arithmetic [--out pipelines/data/arithmetic] [--seed 0] [--train 2000] [--eval 400]

Rows are ``{"prompt", "completion"}`` JSON lines, as ``pipelines/data/parity`` (validate_data turns
them into chat rows; an eval row's completion becomes its reference), e.g.::

    {"prompt": "Mia has 12 pens. She gets 5 more, then gives away 3. How many pens does Mia have now?",
     "completion": "<reasoning>12 + 5 = 17, 17 - 3 = 14</reasoning><answer>14</answer>"}

Half the rows of each file are one-step problems, half two-step. Every problem appears once: no
eval prompt is in the training set and no example repeats (the data contract's leakage and
duplicates rules). The order is a sha256 of the seed and the prompt, so the files are the same bytes
for a seed on any machine and Python version. Standard library only.
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

NAMES = (("Tom", "He"), ("Ann", "She"), ("Sam", "He"), ("Mia", "She"))
OBJECTS = ("apples", "pens", "cards", "coins")
START = range(2, 21)  # what the person has at first
STEP = range(1, 10)  # what one step adds or takes away


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


def _step(total: int, op: str, x: int) -> tuple[str, str, int]:
    """(phrase, reasoning, new total) of adding (``+``) or giving away (``-``) ``x``."""
    new = total + x if op == "+" else total - x
    phrase = f"gets {x} more" if op == "+" else f"gives away {x}"
    return phrase, f"{total} {op} {x} = {new}", new


def _problems(steps: int) -> Iterator[Problem]:
    """Every problem of ``steps`` (1 or 2) steps whose running total never falls below 0."""
    for name, pronoun in NAMES:
        for obj in OBJECTS:
            for start in START:
                head = f"{name} has {start} {obj}. {pronoun}"
                question = f"How many {obj} does {name} have now?"
                for ops in ("+", "-") if steps == 1 else ("++", "+-", "-+", "--"):
                    xs_list = [(x,) for x in STEP] if steps == 1 else [(x, y) for x in STEP for y in STEP]
                    for xs in xs_list:
                        total, phrases, lines = start, [], []
                        for op, x in zip(ops, xs, strict=True):
                            phrase, line, total = _step(total, op, x)
                            phrases.append(phrase)
                            lines.append(line)
                        if min(int(line.rsplit(" ", 1)[1]) for line in lines) < 0:
                            continue
                        prompt = f"{head} {', then '.join(phrases)}. {question}"
                        yield Problem(prompt, ", ".join(lines), total)


def _order(seed: int, problem: Problem) -> str:
    return hashlib.sha256(f"{seed}\0{problem.prompt}".encode()).hexdigest()


def make(seed: int = 0, train: int = TRAIN_ROWS, eval_: int = EVAL_ROWS) -> tuple[list[Problem], list[Problem]]:
    """The (train, eval) problems for ``seed``: disjoint, half one-step and half two-step each."""
    splits: tuple[list[Problem], list[Problem]] = ([], [])
    for steps in (1, 2):
        pool = sorted(_problems(steps), key=lambda p: _order(seed, p))
        n_eval = eval_ // 2 if steps == 1 else eval_ - eval_ // 2
        n_train = train // 2 if steps == 1 else train - train // 2
        if n_eval + n_train > len(pool):
            raise ValueError(f"only {len(pool)} {steps}-step problems exist; ask for fewer rows")
        splits[1].extend(pool[:n_eval])
        splits[0].extend(pool[n_eval : n_eval + n_train])
    train_rows, eval_rows = (sorted(split, key=lambda p: _order(seed, p)) for split in splits)
    return train_rows, eval_rows


def write(out: Path = DEFAULT_OUT, seed: int = 0, train: int = TRAIN_ROWS, eval_: int = EVAL_ROWS) -> list[Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` into ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, problems in zip(("train.jsonl", "eval.jsonl"), make(seed, train, eval_), strict=True):
        path = out / name
        path.write_text("".join(json.dumps(p.row()) + "\n" for p in problems))
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
