"""The regression guard's shipped sets, written here and nowhere else: ``python -m loraflow.evaluation.guard_data``
rewrites ``loraflow/evaluation/guard_sets/*.jsonl`` from this module (a test holds the files to it).

Nothing is copied from a public benchmark and nothing is downloaded: the general questions below were
written for loraflow (common facts, everyday reasoning, word meanings), and the arithmetic word problems
are made from templates, GSM8K-style in spirit (a short story, one or two steps) but not in text. Each
row is ``{"id", "question", "choices": [4 options], "answer": index of the right one}``
(:mod:`loraflow.evaluation.guard` reads them). Where the right option stands is a sha256 of the set's
name and the row's block of four (each block puts it once in each place), so the files are the same bytes
on any machine and Python version and always choosing one place scores exactly 25%. Standard library only.

A set is never changed under its name: a new version is a new name (``-v2``), since the gate
compares a base and a tuned model on one set and the registry keeps the name and sha256 it used.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

SETS_DIR = Path(__file__).resolve().parent / "guard_sets"

# (question, right answer, three wrong ones): written for loraflow.
GENERAL: tuple[tuple[str, str, str, str, str], ...] = (
    ("Which planet is closest to the Sun?", "Mercury", "Venus", "Mars", "Jupiter"),
    ("What do bees make?", "honey", "milk", "silk", "wool"),
    ("How many days are in a week?", "seven", "five", "six", "ten"),
    ("What colour is a clear daytime sky?", "blue", "green", "red", "brown"),
    ("Water freezes at how many degrees Celsius?", "0", "10", "50", "100"),
    ("Which animal is known for its long neck?", "giraffe", "pig", "rabbit", "mouse"),
    ("What is the opposite of hot?", "cold", "warm", "loud", "tall"),
    ("Which month comes after March?", "April", "May", "February", "June"),
    ("How many legs does a spider have?", "eight", "six", "four", "ten"),
    ("What gas do people breathe in to live?", "oxygen", "helium", "neon", "argon"),
    ("Which is the largest ocean on Earth?", "Pacific", "Atlantic", "Indian", "Arctic"),
    ("What do you use to cut paper?", "scissors", "a spoon", "a pillow", "a cup"),
    ("Which season is usually the coldest?", "winter", "summer", "spring", "autumn"),
    ("How many hours are in a day?", "24", "12", "30", "60"),
    ("What is the opposite of up?", "down", "left", "over", "near"),
    ("Which shape has three sides?", "triangle", "square", "circle", "hexagon"),
    ("What is frozen water called?", "ice", "steam", "sand", "glass"),
    ("Which animal says moo?", "cow", "cat", "duck", "horse"),
    ("What colour do you get by mixing blue and yellow?", "green", "purple", "orange", "pink"),
    ("How many minutes are in an hour?", "60", "100", "30", "24"),
    ("Which organ pumps blood through the body?", "heart", "lung", "liver", "skin"),
    ("What is the opposite of empty?", "full", "light", "thin", "open"),
    ("Which of these is a fruit?", "apple", "carrot", "potato", "onion"),
    ("What do plants need from the Sun to grow?", "light", "sound", "salt", "smoke"),
    ("Which animal lives in water and has gills?", "fish", "dog", "eagle", "lion"),
    ("How many sides does a square have?", "four", "three", "five", "six"),
    ("What is the capital of France?", "Paris", "Rome", "Madrid", "Berlin"),
    ("Which is the biggest: a mouse, a dog or an elephant?", "an elephant", "a mouse", "a dog", "an ant"),
    ("What do you call a baby cat?", "kitten", "puppy", "calf", "chick"),
    ("Which day comes after Monday?", "Tuesday", "Sunday", "Friday", "Thursday"),
    ("What is the opposite of fast?", "slow", "quick", "loud", "high"),
    ("Which star is at the centre of our solar system?", "the Sun", "the Moon", "Mars", "Polaris"),
    ("How many wheels does a bicycle have?", "two", "three", "four", "one"),
    ("What falls from clouds when it rains?", "water", "sand", "leaves", "coins"),
    ("Which tool is used to hit nails?", "hammer", "brush", "ladder", "rope"),
    ("What is the main language of Brazil?", "Portuguese", "Spanish", "French", "English"),
    ("What is the opposite of night?", "day", "dark", "moon", "sleep"),
    ("Which metal is attracted to a magnet?", "iron", "gold", "copper", "silver"),
    ("How many months are in a year?", "twelve", "ten", "eleven", "fourteen"),
    ("Which of these is used to write?", "a pen", "a fork", "a shoe", "a plate"),
    ("What do caterpillars turn into?", "butterflies", "spiders", "bees", "snails"),
    ("Which continent is Egypt in?", "Africa", "Asia", "Europe", "Australia"),
    ("What is the opposite of old?", "new", "big", "soft", "late"),
    ("What do cows mostly eat?", "grass", "meat", "fish", "bread"),
    ("Which is a musical instrument?", "piano", "table", "bucket", "towel"),
    ("How many letters are in the English alphabet?", "26", "24", "20", "30"),
    ("What is the largest planet in our solar system?", "Jupiter", "Earth", "Mars", "Mercury"),
    ("Where do fish live?", "in water", "in trees", "in sand", "in clouds"),
    ("Which sense do ears give us?", "hearing", "sight", "taste", "smell"),
    ("What is the opposite of wet?", "dry", "cold", "hard", "soft"),
    ("What does a thermometer measure?", "temperature", "weight", "length", "time"),
    ("Which animal is the king of the jungle in stories?", "lion", "goat", "frog", "owl"),
    ("What is the capital of Japan?", "Tokyo", "Beijing", "Seoul", "Bangkok"),
    ("How many years are in a century?", "100", "10", "50", "1000"),
    ("Which bird is a symbol of peace?", "dove", "crow", "vulture", "hawk"),
    ("What do you wear on your feet?", "shoes", "gloves", "hats", "scarves"),
    ("What is the opposite of inside?", "outside", "under", "behind", "above"),
    ("Which planet is called the red planet?", "Mars", "Venus", "Saturn", "Neptune"),
    ("Which meal is eaten in the morning?", "breakfast", "dinner", "supper", "lunch"),
    ("What is the boiling point of water in Celsius?", "100", "50", "0", "212"),
    ("How many legs does a dog have?", "four", "two", "six", "eight"),
    ("Which body part do we use to see?", "eyes", "ears", "nose", "hands"),
    ("What is the opposite of happy?", "sad", "angry", "tired", "busy"),
    ("Which of these can fly?", "a bird", "a fish", "a worm", "a snail"),
    ("What is used to unlock a door?", "a key", "a spoon", "a sock", "a coin"),
    ("Which fruit is yellow and curved?", "banana", "grape", "cherry", "plum"),
    ("What is the capital of Italy?", "Rome", "Milan", "Paris", "Vienna"),
    ("What do we call a house made of snow?", "igloo", "tent", "barn", "cabin"),
    ("How many seconds are in a minute?", "60", "100", "30", "10"),
    ("What is the opposite of win?", "lose", "play", "run", "try"),
    ("Which animal carries its house on its back?", "snail", "horse", "cat", "bee"),
    ("Which gas do plants take in from the air?", "carbon dioxide", "oxygen", "helium", "hydrogen"),
    ("In which direction does the Sun rise?", "east", "west", "north", "south"),
    ("What is the plural of mouse?", "mice", "mouses", "meese", "mousen"),
    ("Which of these is a vegetable?", "carrot", "apple", "grape", "peach"),
    ("What is the opposite of early?", "late", "soon", "first", "fast"),
    ("What does a clock show?", "the time", "the weather", "the date of birth", "the price"),
    ("How many toes are on one human foot?", "five", "four", "six", "ten"),
    ("Which animal is black and white and eats bamboo?", "panda", "zebra", "penguin", "skunk"),
    ("What is the capital of Spain?", "Madrid", "Lisbon", "Barcelona", "Paris"),
    ("Which material is a window usually made of?", "glass", "paper", "wool", "clay"),
    ("What is the opposite of strong?", "weak", "big", "brave", "kind"),
    ("Which number is even?", "8", "3", "7", "11"),
    ("What do you call the person who flies a plane?", "pilot", "sailor", "farmer", "baker"),
    ("Which of these is a liquid at room temperature?", "water", "iron", "wood", "stone"),
    ("How many players are on a football team on the field?", "eleven", "five", "seven", "nine"),
    ("What is the past tense of go?", "went", "goed", "gone", "going"),
    ("Which animal is the largest on Earth?", "blue whale", "elephant", "giraffe", "shark"),
    ("Where does a doctor usually work?", "hospital", "bakery", "farm", "garage"),
    ("What is the opposite of open?", "closed", "wide", "clear", "free"),
    ("Which of these is the smallest?", "an ant", "a cat", "a horse", "a bear"),
    ("What do you call frozen rain that falls as white flakes?", "snow", "hail", "fog", "dew"),
    ("What is the capital of Germany?", "Berlin", "Munich", "Vienna", "Zurich"),
    ("Which part of a plant grows under the ground?", "root", "leaf", "flower", "fruit"),
    ("What is the opposite of heavy?", "light", "hard", "full", "thick"),
    ("How many days are in a leap year?", "366", "365", "364", "360"),
    ("Which tool shows which way is north?", "compass", "ruler", "scale", "clock"),
    ("What is the plural of child?", "children", "childs", "childes", "childer"),
    ("Which of these is a mammal?", "dolphin", "shark", "trout", "octopus"),
    ("What colour are ripe strawberries?", "red", "blue", "black", "white"),
)

NAMES = ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jin", "Kim", "Leo")
THINGS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "shells", "stamps", "cards", "coins")


def _digest(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "big")


def _arithmetic_problem(i: int) -> tuple[str, int, list[int]]:
    """Problem ``i``: its wording, its answer and the wrong answers a slip would give (first ones first)."""
    name, thing = NAMES[_digest("name", i) % len(NAMES)], THINGS[_digest("thing", i) % len(THINGS)]
    a, b, c = 3 + _digest("a", i) % 17, 2 + _digest("b", i) % 8, 1 + _digest("c", i) % 5
    kind = i % 6
    if kind == 0:
        return (
            f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?",
            a + b,
            [a - b, a * b, a + b + 1, a + b - 1],
        )
    if kind == 1:
        a += b  # never below zero
        return (
            f"{name} had {a} {thing} and gave away {b}. How many {thing} are left?",
            a - b,
            [a + b, a - b + 1, a - b - 1, b],
        )
    if kind == 2:
        return (
            f"{name} buys {b} boxes with {a} {thing} in each. How many {thing} is that?",
            a * b,
            [a + b, a * b + a, a * b - b, a * (b + 1)],
        )
    if kind == 3:
        return (
            f"{name} shares {a * b} {thing} equally among {b} friends. How many does each get?",
            a,
            [a * b - b, a + 1, b, a - 1],
        )
    if kind == 4:
        a += c
        return (
            f"{name} has {a} {thing}, gets {b} more, then loses {c}. How many {thing} does {name} have?",
            a + b - c,
            [a + b + c, a + b, a - c, a - b - c],
        )
    return (
        f"One of {name}'s {thing} costs {a} dollars. How many dollars do {b} of them cost?",
        a * b,
        [a + b, a * b + a, a * (b - 1), a * b + 10],
    )


_ORDERS = tuple(itertools.permutations(range(4)))


def _row(set_name: str, i: int, question: str, right: str, wrong: list[str]) -> dict[str, object]:
    row_id = f"{set_name.rsplit('-', 1)[0]}-{i:03d}"
    at = _ORDERS[_digest(set_name, i // 4) % len(_ORDERS)][i % 4]
    choices = [*wrong[:at], right, *wrong[at:]]
    return {"id": row_id, "question": question, "choices": choices, "answer": at}


def general_rows() -> Iterator[dict[str, object]]:
    for i, (question, right, *wrong) in enumerate(GENERAL):
        yield _row("general-mc-v1", i, question, right, wrong)


def arithmetic_rows(n: int = 120) -> Iterator[dict[str, object]]:
    for i in range(n):
        question, answer, slips = _arithmetic_problem(i)
        wrong = [str(x) for x in dict.fromkeys(s for s in slips if s >= 0 and s != answer)][:3]
        k = 2
        while len(wrong) < 3:  # a slip equal to the answer or to another slip: the nearest unused numbers
            wrong += [str(x) for x in (answer + k, answer - k) if x >= 0 and str(x) not in wrong][: 3 - len(wrong)]
            k += 1
        yield _row("arithmetic-mc-v1", i, question, str(answer), wrong)


#: Each shipped set: its rows, written by :func:`write`.
SETS = {"general-mc-v1": general_rows, "arithmetic-mc-v1": arithmetic_rows}


def text_of(name: str) -> str:
    """A set's file content: one JSON object per line."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in SETS[name]())


def write(out: Path = SETS_DIR) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in SETS:
        path = out / f"{name}.jsonl"
        path.write_text(text_of(name))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=SETS_DIR)
    for path in write(parser.parse_args(argv).out):
        print(path)


if __name__ == "__main__":
    main()
