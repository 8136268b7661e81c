"""The eval set as examples, and their prompts as the model sees them: shared by the evaluate step
(vLLM, the serving environment) and lora_sft (the quantized model's own answers under QLoRA, the
trainer environment), so both answer exactly the same token ids.

An eval row is ``{"messages": [...]}`` (the last assistant turn, or ``reference``, is the reference
answer) or ``{"prompt", "completion"|"reference"}``; an optional ``id`` names it. Prompts render
through :mod:`loraflow.data.chat_template` with the template validate_data recorded beside the
eval set (the one training renders with; :func:`eval_template`), the generation prompt added.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.data import chat_template
from loraflow.data.chat_template import ChatTemplate
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


def eval_template(eval_set: Path, tokenizer_dir: Path, progress: Any = None) -> ChatTemplate:
    """The template the eval prompts render with: the one validate_data recorded beside the eval set
    (the one training renders with), else the tokenizer's own (``auto``; an eval set made by hand).

    When the record came from a tokenizer (``auto``/``tokenizer``) and ``tokenizer_dir``'s own
    template differs, the model being evaluated ships another template than the one its training
    data was rendered with: rendering stays with the record (train and eval agree), and a loud
    warning says so, since a user serving the model with its own template gets other prompts.
    """
    root = eval_set if eval_set.is_dir() else eval_set.parent
    recorded = chat_template.read_record(root)
    say = progress or (lambda _msg: None)
    if recorded is None:
        template = chat_template.resolve(chat_template.AUTO, tokenizer_dir)
        say(
            f"WARNING: the eval set carries no {chat_template.RECORD_FILE} (not a validate_data output): prompts "
            f"render with {template.origin}, which need not be what training used"
        )
        return template
    own = chat_template.own_template_digest(tokenizer_dir)
    if recorded.setting in (chat_template.AUTO, chat_template.TOKENIZER) and own != recorded.digest:
        say(
            f"WARNING: the model's tokenizer ({tokenizer_dir.name}) has another chat template than the one "
            f"training rendered with ({recorded.origin}, sha256 {recorded.digest[:12]}); evaluation renders with "
            "training's. Serve the model with that template too, or set data.chat_template explicitly"
        )
    return recorded


def render_prompts(
    tokenizer: Any, examples: list[Example], template: ChatTemplate | None = None
) -> tuple[list[str], list[list[int]]]:
    """Text and token ids of each example's prompt, rendered by :mod:`loraflow.data.chat_template`.

    ``template`` None: the tokenizer's own (``auto``, from its files in ``tokenizer.name_or_path``).
    Each piece is tokenized alone without special tokens (the template writes them), exactly as
    training tokenizes the same pieces, so the ids are those the trained model saw before its answer.
    """
    if template is None:
        template = chat_template.resolve(chat_template.AUTO, Path(tokenizer.name_or_path))
    texts, ids = [], []
    for ex in examples:
        parts = chat_template.prompt_pieces(template, ex.messages)
        texts.append("".join(parts))
        ids.append(chat_template.encode_pieces(lambda t: tokenizer(t, add_special_tokens=False)["input_ids"], parts))
    return texts, ids
