"""Datasets the tests hand to pipelines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PARITY = Path(__file__).resolve().parents[1] / "pipelines" / "data" / "parity"


def broken_dataset(folder: Path) -> Path:
    """Parity data with an empty answer and a duplicated row: the data contract refuses it."""
    rows = [json.loads(line) for line in (PARITY / "train.jsonl").read_text().splitlines()]
    rows[3]["completion"] = ""
    rows[10] = rows[11]
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(PARITY / "eval.jsonl", folder / "eval.jsonl")
    return folder
