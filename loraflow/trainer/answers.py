"""The trained model answers the eval prompts inside lora_sft, before anything is merged.

Under QLoRA the model that trained is the *quantized* base plus the adapter; what loraflow merges,
evaluates and publishes is the adapter on the *full-precision* base. The report puts the two side
by side (docs/qlora.md, "What merging costs"): these are the first model's answers, the
evaluate_tuned stage's are the second's, and the report scores both with the spec's scorers.

Greedy decoding on the MaxText model itself (the Tunix trainer's ``nnx`` module, its LoRA and
quantized kernels as they trained), with the prompts rendered exactly as the evaluate stage renders
them (``loraflow.evaluation.examples``). No KV cache: each new token is one forward pass over a
fixed ``[batch, prompt + max_new_tokens]`` window (compiled once; padding is its own segment, so
no real token attends to it). That is quadratic in the answer's length, so the number of examples
is a spec setting (``lora.quantized_eval_examples``), not the whole eval set. Every process of a
multi-host job runs the same computation on the same (replicated) prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.evaluation.examples import EVAL_FILE, eval_template, load_examples, render_prompts
from loraflow.spec.stages import QUANTIZED_ANSWERS
from loraflow.spec.step_configs import LoraSftConfig


@dataclass(frozen=True)
class Answers:
    """The eval examples' ids and the model's answers, in eval-set order."""

    ids: list[str]
    texts: list[str]
    seconds: float

    def rows(self) -> list[dict[str, str]]:
        return [{"id": i, "output": t} for i, t in zip(self.ids, self.texts, strict=True)]

    def summary(self) -> dict[str, Any]:
        return {"quantized_eval_examples": len(self.ids), "quantized_eval_seconds": round(self.seconds, 1)}

    def write(self, out_dir: Path) -> None:
        """``quantized_answers.jsonl``: a ``{"id", "output"}`` line an answer."""
        (out_dir / QUANTIZED_ANSWERS).write_text(
            "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in self.rows())
        )


def wanted(cfg: LoraSftConfig) -> bool:
    """Whether lora_sft answers eval prompts: QLoRA, with ``quantized_eval_examples`` to answer."""
    return cfg.quantization != "none" and cfg.quantized_eval_examples > 0


def eval_file(dataset_dir: Path) -> Path:
    """The dataset's eval set (validate_data writes it beside train.jsonl); checked before training starts."""
    path = dataset_dir / EVAL_FILE
    if not path.is_file():
        raise LoraflowError(
            f"lora_sft: lora.quantized_eval_examples asks for the trained model's answers to the eval set, but the "
            f"dataset input {dataset_dir} has no {EVAL_FILE}; give it one (validate_data's output has it) or set "
            "lora.quantized_eval_examples: 0"
        )
    return path


def answer_eval_prompts(
    model: Any,
    mesh: Any,
    logical_axis_rules: Any,
    dataset_dir: Path,
    tokenizer_dir: Path,
    examples: int,
    max_new_tokens: int,
    batch_size: int,
    progress: Callable[[str], None],
) -> Answers:
    """Greedy answers of ``model`` to the first ``examples`` prompts of the dataset's eval set."""
    from transformers import AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    path = eval_file(dataset_dir)
    chosen = load_examples(path, examples)
    _, prompts = render_prompts(tokenizer, chosen, eval_template(path, tokenizer_dir, progress))
    progress(
        f"answering {len(chosen)} eval prompt(s) with the quantized base + adapter "
        f"(greedy, up to {max_new_tokens} tokens, batches of {batch_size})"
    )
    out = greedy(
        model,
        mesh,
        logical_axis_rules,
        prompts,
        max_new_tokens,
        stop_ids(tokenizer_dir, tokenizer.eos_token_id),
        tokenizer.pad_token_id or 0,
        batch_size,
    )
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out]
    seconds = time.monotonic() - started
    progress(f"answered {len(texts)} eval prompt(s) in {seconds:.1f}s")
    return Answers([ex.id for ex in chosen], texts, seconds)


def greedy(
    model: Any,
    mesh: Any,
    logical_axis_rules: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop: frozenset[int],
    pad_id: int,
    batch_size: int,
) -> list[list[int]]:
    """The greedy continuation (without the prompt, up to and without the first ``stop`` token) of every prompt."""
    import numpy as np

    window = max(len(p) for p in prompts) + max_new_tokens
    step = _next_token_fn(mesh, logical_axis_rules)
    answers: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        # A short last batch is padded with copies of its first prompt: one shape, one compilation.
        rows = chunk + [chunk[0]] * (batch_size - len(chunk))
        tokens = np.full((batch_size, window), pad_id, np.int32)
        for i, p in enumerate(rows):
            tokens[i, : len(p)] = p
        lengths = np.array([len(p) for p in rows], np.int32)
        answers.extend(_decode(model, step, tokens, lengths, max_new_tokens, stop)[: len(chunk)])
    return answers


def stop_ids(tokenizer_dir: Path, eos_id: int | None) -> frozenset[int]:
    """Where an answer ends, as vLLM ends it: the tokenizer's EOS and every ``eos_token_id`` the checkpoint's
    ``generation_config.json`` lists (an instruct model's end of turn, Gemma's ``<end_of_turn>``)."""
    path = tokenizer_dir / "generation_config.json"
    listed = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    ids = listed if isinstance(listed, list) else [listed]
    return frozenset(int(i) for i in [eos_id, *ids] if i is not None)


def _decode(
    model: Any, step: Any, tokens: Any, lengths: Any, max_new_tokens: int, stop: frozenset[int]
) -> list[list[int]]:
    import numpy as np

    new: list[list[int]] = [[] for _ in range(len(lengths))]
    done = np.zeros(len(lengths), bool)
    for _ in range(max_new_tokens):
        nxt = np.asarray(step(model, tokens, lengths))
        for i in np.flatnonzero(~done):
            if int(nxt[i]) in stop:
                done[i] = True
                continue
            tokens[i, lengths[i]] = nxt[i]
            lengths[i] += 1
            new[i].append(int(nxt[i]))
        if done.all():
            break
    return new


def _next_token_fn(mesh: Any, logical_axis_rules: Any) -> Callable[[Any, Any, Any], Any]:
    """``step(model, tokens, lengths)``: each row's greedy next token after its first ``lengths`` tokens."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from flax.core.spmd import logical_axis_rules as axis_rules
    from jax.sharding import NamedSharding, PartitionSpec

    replicated = NamedSharding(mesh, PartitionSpec())

    @nnx.jit
    def next_token(model: Any, tokens: Any, lengths: Any) -> Any:
        batch, window = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(window, dtype=jnp.int32), (batch, window))
        # Real tokens are segment 1, padding segment 0: attention never crosses segments.
        segments = (positions < lengths[:, None]).astype(jnp.int32)
        logits = model(
            decoder_input_tokens=tokens,
            decoder_positions=positions,
            decoder_segment_ids=segments,
            enable_dropout=False,
        )
        nnx.pop(model, nnx.Intermediate)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0, :]
        return jax.lax.with_sharding_constraint(jnp.argmax(last, axis=-1).astype(jnp.int32), replicated)

    def step(model: Any, tokens: Any, lengths: Any) -> Any:
        with jax.set_mesh(mesh), axis_rules(logical_axis_rules):
            return next_token(model, jax.device_put(tokens, replicated), jax.device_put(lengths, replicated))

    return step
