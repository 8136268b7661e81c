"""Conversations and a second chat template shared by the chat-template tests of every environment
(tests/control/test_chat_template.py, tests/trainer/test_chat_template_training.py, tests/serving/test_evaluate.py)."""

from __future__ import annotations

from typing import Any

# ChatML as instruct models ship it, with a default system turn: not the tiny model's own template.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PROMPT_COMPLETION = {"id": "pc", "prompt": "What is 2+3?", "completion": "5"}
CHAT_WITH_SYSTEM = {
    "id": "sys",
    "messages": [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 4+4?"},
        {"role": "assistant", "content": "8"},
    ],
}
MULTI_TURN = {
    "id": "multi",
    "messages": [
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "4"},
    ],
}
RECORDS = [PROMPT_COMPLETION, CHAT_WITH_SYSTEM, MULTI_TURN]


def normalised(record: dict[str, Any]) -> dict[str, Any]:
    """The record as validate_data normalises it, ``{"id", "messages"}`` (prompt/completion becomes a
    user and an assistant turn); one record per file, as each format is its own file."""
    from loraflow.data import dataset

    return dataset.normalise([(1, record)], "rows.jsonl").rows[0]


def eval_rows() -> list[dict[str, Any]]:
    """The records as validate_data writes eval.jsonl: the prompt turns and the last answer as reference."""
    from loraflow.data import dataset

    rows = []
    for record in RECORDS:
        row = normalised(record)
        prompt, reference = dataset.prompt_and_reference(row["messages"])
        rows.append({"id": row["id"], "messages": prompt, "reference": reference})
    return rows
