"""The eval set as examples, and their prompts as the model sees them: shared by the evaluate step
(vLLM, the serving environment) and lora_sft (the quantized model's own answers under QLoRA, the
trainer environment), so both answer exactly the same token ids.

An eval row is ``{"messages": [...]}`` (the last assistant turn, or ``reference``, is the reference
answer) or ``{"prompt", "completion"|"reference"}``; an optional ``id`` names it. Prompts render
through the checkpoint tokenizer's chat template with the generation prompt added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError

EVAL_FILE = "eval.jsonl"


@dataclass(frozen=True)
class Example:
    id: str
    messages: list[dict[str, str]]
    reference: str


def find_eval_file(root: Path) -> Path:
    """``eval.jsonl`` inside the eval_set input (or the input itself when it is a file)."""
    if root.is_file():
        return root
    if (root / EVAL_FILE).is_file():
        return root / EVAL_FILE
    found = sorted(root.rglob(EVAL_FILE)) or sorted(root.rglob("*.jsonl"))
    if len(found) != 1:
        raise LoraflowError(
            f"evaluate: eval_set input {root} must hold one {EVAL_FILE}; found {[str(p) for p in found]}"
        )
    return found[0]


def load_examples(path: Path, max_examples: int | None = None) -> list[Example]:
    """Rows of an eval JSONL as :class:`Example`; the first ``max_examples`` when given."""
    examples: list[Example] = []
    seen: set[str] = set()
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if max_examples is not None and len(examples) >= max_examples:
                break
            where = f"{path.name}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise LoraflowError(f"evaluate: {where} is not JSON ({exc})") from None
            if "messages" in row:
                messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
                reference = row.get("reference")
                if reference is None and messages and messages[-1]["role"] == "assistant":
                    reference = messages.pop()["content"]
            elif "prompt" in row:
                messages = [{"role": "user", "content": row["prompt"]}]
                reference = row.get("reference", row.get("completion"))
            else:
                raise LoraflowError(f"evaluate: {where} has neither 'messages' nor 'prompt'")
            if reference is None:
                raise LoraflowError(f"evaluate: {where} has no reference answer")
            if not messages or messages[-1]["role"] != "user":
                raise LoraflowError(f"evaluate: {where}: the conversation must end with a user turn")
            ex_id = str(row.get("id", len(examples)))
            if ex_id in seen:
                raise LoraflowError(f"evaluate: {where}: id {ex_id!r} appears twice")
            seen.add(ex_id)
            examples.append(Example(ex_id, messages, str(reference)))
    if not examples:
        raise LoraflowError(f"evaluate: {path} holds no examples")
    return examples


def render_prompts(tokenizer: Any, examples: list[Example]) -> tuple[list[str], list[list[int]]]:
    """Chat-template text and token ids of each example's prompt (``add_generation_prompt=True``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise LoraflowError(
            "evaluate: the checkpoint's tokenizer has no chat_template; training and evaluation render through it"
        )
    texts = [tokenizer.apply_chat_template(ex.messages, tokenize=False, add_generation_prompt=True) for ex in examples]
    # The template already holds the BOS: no second one from the tokenizer.
    ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return texts, ids
