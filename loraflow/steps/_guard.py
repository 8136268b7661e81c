"""The regression guard inside the evaluate step: the guard set scored by the engine that scored the eval set.

Which set: the config's ``guard_set`` (the spec's ``gate.guard.set``): a shipped name, read from the
package, or a gs:// URI, which the planner hands the step as its ``guard_set`` input. How each
question is scored (log-likelihood of each option through vLLM's ``prompt_logprobs``, per byte, the
highest wins) is :mod:`loraflow.evaluation.guard`'s. Writes ``guard_predictions.jsonl``; the step
puts the summary in ``metrics.json`` under ``guard``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.data import chat_template
from loraflow.data.chat_template import ChatTemplate
from loraflow.errors import LoraflowError
from loraflow.evaluation import guard
from loraflow.evaluation.examples import Example, render_prompts
from loraflow.spec.step_configs import EvaluateConfig

INPUT = "guard_set"


@dataclass(frozen=True)
class GuardSet:
    """The guard set a config names, read and checked (before any engine is loaded)."""

    name: str
    path: Path
    questions: list[guard.Question]


def load(cfg: EvaluateConfig, inputs: dict[str, Path]) -> GuardSet | None:
    """The config's guard set (None: no guard): the shipped one it names, or the step's ``guard_set`` input."""
    if cfg.guard_set is None:
        return None
    name = cfg.guard_set
    if name in guard.SHIPPED:
        path = guard.shipped_path(name)
    elif INPUT in inputs:
        path = guard.find_set_file(inputs[INPUT])
    else:
        raise LoraflowError(
            f"evaluate: guard_set {name!r} is not a shipped set, so it must come as --input {INPUT}=gs://...; "
            f"the planner sends it for a gs:// gate.guard.set (shipped: {', '.join(guard.SHIPPED)})"
        )
    return GuardSet(name, path, guard.load_questions(path))


def sequences(
    engine: Any, cfg: EvaluateConfig, template: ChatTemplate, guard_set: GuardSet
) -> list[tuple[list[int], int]]:
    """Every question's options as token ids (prompt + option) and where each option begins; an error, before
    anything is generated, when the longest does not fit ``max_model_len``."""
    tokenizer = engine.tokenizer

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    questions = guard_set.questions
    examples = [Example(q.id, [{"role": "user", "content": q.question}], q.choices[q.answer]) for q in questions]
    _, prompt_ids = render_prompts(tokenizer, examples, template)
    out = guard.token_sequences(questions, prompt_ids, lambda q: continuations(template, q), encode)
    longest = max(len(ids) for ids, _ in out)
    if longest > cfg.max_model_len:
        raise LoraflowError(
            f"evaluate: the guard set {guard_set.path.name} has a question and option of {longest} tokens, more than "
            f"evaluation.max_model_len={cfg.max_model_len}: raise max_model_len, or name a guard set of shorter questions"
        )
    return out


def score(
    engine: Any, cfg: EvaluateConfig, guard_set: GuardSet, seqs: list[tuple[list[int], int]], out: Path, progress: Any
) -> dict[str, Any]:
    """Score the guard set's option sequences (:func:`sequences`) with the loaded engine; write its
    predictions; return metrics.json's ``guard``."""
    from vllm import SamplingParams

    started = time.monotonic()
    questions = guard_set.questions
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False, seed=cfg.seed)
    outputs = engine.llm.generate([{"prompt_token_ids": ids} for ids, _ in seqs], params, use_tqdm=False)
    logprobs = [_option_logprobs(o.prompt_logprobs, ids, start) for o, (ids, start) in zip(outputs, seqs, strict=True)]
    scores, at = [], 0
    for q in questions:
        options = [
            guard.option_score(lp, c) for lp, c in zip(logprobs[at : at + len(q.choices)], q.choices, strict=True)
        ]
        scores.append(options)
        at += len(q.choices)
    scored = guard.result(guard_set.name, guard.sha256_of(guard_set.path), questions, scores)
    with (out / guard.PREDICTIONS_FILE).open("w") as f:
        for row in scored.rows(questions):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    seconds = time.monotonic() - started
    progress(
        f"guard {scored.name} (sha256 {scored.sha256[:12]}): accuracy {scored.accuracy:.4f} over n={len(questions)} "
        f"questions, {len(seqs)} options scored in {seconds:.2f}s"
    )
    return {**scored.summary(), "options_scored": len(seqs), "seconds": round(seconds, 3)}


def continuations(template: ChatTemplate, q: guard.Question) -> list[str]:
    """Each option as the template writes it for the assistant's answer, up to the end of its text: where
    that text ends is where the template writes the answer (:func:`guard.continuation`)."""

    def answer_piece(answer: str) -> str:
        messages = [{"role": "user", "content": q.question}, {"role": "assistant", "content": answer}]
        return chat_template.pieces(template, messages)[-1][0]

    marked = answer_piece(guard.ANSWER_MARK)
    return [guard.continuation(answer_piece(option), marked, option) for option in q.choices]


def _option_logprobs(prompt_logprobs: Any, ids: list[int], start: int) -> list[float]:
    """The log-probability vLLM gave each option token (positions ``start`` onwards) of its own id."""
    if prompt_logprobs is None or len(prompt_logprobs) != len(ids):
        raise LoraflowError("evaluate: vLLM returned no prompt log-probabilities for a guard question")
    return [float(prompt_logprobs[k][ids[k]].logprob) for k in range(start, len(ids))]
