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


# Dataset strings that run script where a page writes them raw: each sets window.__pwned (and the
# first two the page's title), so a browser can tell whether any of them ran (issue 29, item 2).
SCRIPT_PAYLOADS = (
    '<script>window.__pwned = 1; document.title = "pwned"</script>',
    "<img src=x onerror=\"window.__pwned = 2; document.title = 'pwned'\">",
    '</div></td><svg onload="window.__pwned = 3">',
)


def script_payload_rows() -> tuple[list[dict], list[dict]]:
    """Parity train and eval rows carrying SCRIPT_PAYLOADS where the data contract reports them.

    Train: each payload is the id of two rows (unique_ids fails and lists the ids), a prompt and a
    completion; eval: two rows share the first payload as id, and one repeats train's payload prompt
    (leakage lists the prompt). Roles cannot carry one: the loader refuses any role but system, user,
    assistant before Great Expectations runs.
    """
    train = [json.loads(line) for line in (PARITY / "train.jsonl").read_text().splitlines()]
    eval_ = [json.loads(line) for line in (PARITY / "eval.jsonl").read_text().splitlines()]
    train = [dict(r, id=f"t{i}") for i, r in enumerate(train)]
    eval_ = [dict(r, id=f"e{i}") for i, r in enumerate(eval_)]
    for i, payload in enumerate(SCRIPT_PAYLOADS):
        train[2 * i]["id"] = train[2 * i + 1]["id"] = payload
        train[10 + i]["prompt"] = f"{payload} Is {i} even or odd?"
        train[20 + i]["completion"] = payload
    eval_[0]["id"] = eval_[1]["id"] = SCRIPT_PAYLOADS[0]
    eval_[2]["prompt"] = train[11]["prompt"]
    return train, eval_


def script_payload_dataset(folder: Path) -> Path:
    """script_payload_rows() as train.jsonl and eval.jsonl in ``folder``."""
    folder.mkdir()
    for name, rows in zip(("train", "eval"), script_payload_rows(), strict=True):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder
