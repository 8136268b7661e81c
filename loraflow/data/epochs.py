"""The order a training run sees its examples in: every epoch a fresh permutation, fixed by the seed.

lora_sft writes this order into the file MaxText reads and turns MaxText's own shuffling off. MaxText
shuffles with the Hugging Face ``datasets`` library after splitting the stream between hosts, so the
examples of a step depended on how many hosts read it; a file that is already in training order
gives every host count the same global batches (each host reads every N-th row of the same file).

Pure and deterministic: ``random.Random(seed + epoch)`` permutes the rows, the same on every host,
Python version and CPU.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path


def epoch_order(n_rows: int, epochs: int, seed: int, shuffle: bool = True) -> Iterator[int]:
    """Row indices in training order: ``epochs`` passes over ``range(n_rows)``, each a permutation of
    its own (``seed + epoch``) when ``shuffle``, else in file order."""
    for epoch in range(epochs):
        rows = list(range(n_rows))
        if shuffle:
            random.Random(seed + epoch).shuffle(rows)
        yield from rows


def write_epochs(source: Path, dest: Path, epochs: int, seed: int, shuffle: bool = True) -> int:
    """Write the non-empty lines of ``source`` to ``dest`` in training order; the number of lines written."""
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    written = 0
    with dest.open("w", encoding="utf-8") as out:
        for index in epoch_order(len(lines), epochs, seed, shuffle):
            out.write(lines[index] + "\n")
            written += 1
    return written
