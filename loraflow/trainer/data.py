"""The training examples as MaxText reads them: rendered by loraflow, in loraflow's training order.

MaxText's SFT pipeline applies a chat template itself, one round (prompt turns + answer) at a time,
and masks the prompt side out of the loss. loraflow renders every example with the dataset's chat
template (``loraflow.data.chat_template``, the renderer evaluation uses) into prompt and answer
pieces, and hands MaxText the pieces with a template that writes each as it is: MaxText then
tokenizes exactly the text evaluation prompts with, and trains on the answer pieces only. The
examples are written in training order (``loraflow.data.epochs``; MaxText's own shuffle is off,
since it depends on the host count), and each host reads every N-th row of that file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from loraflow.data import chat_template
from loraflow.data.epochs import write_epochs
from loraflow.errors import LoraflowError
from loraflow.spec.step_configs import LoraSftConfig
from loraflow.trainer.sft_run import Progress

TRAIN_JSONL = "train.jsonl"


@dataclass(frozen=True)
class TrainingSet:
    path: Path  # the dataset's train.jsonl: {"messages": [...]} rows
    rows: int  # its examples


@dataclass(frozen=True)
class Rendered:
    path: Path  # train.rendered.jsonl: each example as its prompt and answer pieces
    passthrough: Path  # the template MaxText renders the pieces with: each written as it is
    shortest: int  # tokens of the shortest example


@dataclass(frozen=True)
class PreparedData:
    """What MaxText's data pipeline reads."""

    ordered: Path  # train.ordered.jsonl: the rendered examples, enough epochs, in training order
    passthrough: Path  # Rendered.passthrough


def training_set(dataset_dir: Path) -> TrainingSet:
    """The dataset's ``train.jsonl`` and its number of examples."""
    train_file = dataset_dir / TRAIN_JSONL
    if not train_file.is_file():
        raise LoraflowError(f"dataset input has no {TRAIN_JSONL} ({dataset_dir})")
    return TrainingSet(train_file, sum(1 for line in train_file.open() if line.strip()))


def training_template(
    dataset_dir: Path, tokenizer_dir: Path, progress: Progress | None = None
) -> chat_template.ChatTemplate:
    """The template validate_data recorded beside train.jsonl; a dataset without one (made by hand): the
    tokenizer's own (``auto``), with a warning."""
    recorded = chat_template.read_record(dataset_dir)
    if recorded is not None:
        return recorded
    template = chat_template.resolve(chat_template.AUTO, tokenizer_dir)
    if progress is not None:
        progress(
            f"WARNING: the dataset carries no {chat_template.RECORD_FILE} (not a validate_data output): "
            f"training renders with {template.origin}"
        )
    return template


def prepare(cfg: LoraSftConfig, train: TrainingSet, tokenizer_dir: Path) -> PreparedData:
    """Render every example and write them in training order beside ``train.path``."""
    rendered = render_training_file(train.path, tokenizer_dir, training_template(train.path.parent, tokenizer_dir))
    return PreparedData(write_training_order(cfg, rendered, train.rows), rendered.passthrough)


def render_training_file(train_file: Path, tokenizer_dir: Path, template: chat_template.ChatTemplate) -> Rendered:
    """Every example of ``train_file`` rendered by loraflow (:func:`loraflow.data.chat_template.pieces`),
    as alternating user (prompt piece) and assistant (answer piece) turns.

    MaxText finds a round's answer as the tokens after the longest common prefix of the round and its
    prompt alone: each round is checked to tokenize as its two pieces do, so that split falls where
    loraflow cut; evaluation tokenizes the same prompt pieces (``prompt_pieces``).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids, skip_special_tokens=False))

    rendered = train_file.with_name("train.rendered.jsonl")
    shortest: int | None = None
    with train_file.open(encoding="utf-8") as src, rendered.open("w", encoding="utf-8") as dst:
        for line_no, line in enumerate(src, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            where = f"{train_file.name} line {line_no} (id {row.get('id')!r})"
            try:
                pieces = chat_template.pieces(template, row["messages"])
                n = chat_template.check_round_tokens(encode, decode, pieces)
            except chat_template.ChatTemplateError as exc:
                raise LoraflowError(f"{where}: {exc}") from None
            shortest = n if shortest is None else min(shortest, n)
            turns = [{"role": "user" if is_prompt else "assistant", "content": text} for text, is_prompt in pieces]
            dst.write(json.dumps({"id": row.get("id"), "messages": turns}, ensure_ascii=False) + "\n")
    passthrough = train_file.with_name("chat_template.passthrough.json")
    passthrough.write_text(json.dumps({"chat_template": chat_template.PASSTHROUGH_TEMPLATE}))
    return Rendered(rendered, passthrough, shortest or 1)


def write_training_order(cfg: LoraSftConfig, rendered: Rendered, n_rows: int) -> Path:
    """``train.ordered.jsonl``: enough epochs of the examples for ``steps`` batches, in training order."""
    # Packing puts several short examples in one row, and MaxText stops training when the iterator
    # runs dry: repeat the data enough epochs for `steps` batches of the shortest examples.
    per_row = max(1.0, cfg.max_length / max(1, rendered.shortest)) if cfg.packing else 1.0
    num_epoch = max(1, math.ceil(cfg.steps * cfg.batch_size * per_row / max(n_rows, 1)) + 1)
    # MaxText reads the examples in loraflow's training order (every epoch shuffled by the seed, the
    # same file on every host) and shuffles nothing itself: its own shuffle depends on the host count.
    ordered = rendered.path.with_name("train.ordered.jsonl")
    write_epochs(rendered.path, ordered, num_epoch, cfg.seed, cfg.shuffle)
    return ordered
