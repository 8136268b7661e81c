"""Child of eval_bench.py and eval_scale_bench.py (serving env).

argv: vllm|hf MODEL_DIR EVAL_JSONL OUT_DIR (eval_bench: the tiny model). Two workloads on one loaded
model: "spec" = the tiny spec's evaluation settings (400 prompts, batch 100, greedy, max_new_tokens
4, stops at EOS) and "long" = 32 new tokens per prompt, EOS ignored (decode throughput). vllm runs
loraflow.steps.evaluate.evaluate() itself for "spec".

argv: vllm-scale|hf-scale MODEL_DIR EVAL_JSONL OUT_DIR DTYPE (eval_scale_bench: a larger generated
model, served in DTYPE: float32 or bfloat16). One workload: the first SCALE_PROMPTS prompts in one batch,
SCALE_TOKENS new tokens each, EOS ignored; vLLM through loraflow's build_engine with the evaluate stage's
defaults for everything the workload does not set (its CPU KV cache among them).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit  # noqa: E402

SPEC_EVAL = {
    "max_new_tokens": 4,
    "batch_size": 100,
    "answer_pattern": r"^\s*([A-Za-z]+)",
    "max_model_len": 128,
    "dtype": "float32",  # the tiny spec trains (and so serves) in float32
}
LONG = 32
SCALE_PROMPTS = 128
SCALE_TOKENS = 32
# One batch of every prompt, as HF gets them.
SCALE_EVAL = {**SPEC_EVAL, "batch_size": SCALE_PROMPTS}


def run_vllm(model: Path, eval_file: Path, out: Path) -> dict:
    from loraflow.steps import evaluate as ev
    from loraflow.steps._harness import StepContext

    cfg = ev.resolve_config(SPEC_EVAL)
    engine = ev.build_engine(model, cfg, progress=lambda m: None)
    ctx = StepContext(
        stage="evaluate_base",
        output_uri="gs://unused/x",
        inputs={"model": model, "eval_set": eval_file.parent},
        input_manifests={},
        out=out,
        work=out,
        config=SPEC_EVAL,
    )
    import json

    summary = ev.evaluate(ctx, engine)
    metrics = json.loads((out / ev.METRICS_JSON).read_text())
    _, ids = ev.render_prompts(engine.tokenizer, ev.load_examples(eval_file))
    long_s, ntok = _vllm_forced(engine, ids, LONG, 100)
    engine.leave_to_exit()  # as the evaluate stage's program does: the process ends next
    import vllm

    return {
        "startup_s": metrics["timing"]["startup_s"],
        "spec_generate_s": metrics["timing"]["generate_s"],
        "spec_tokens": metrics["timing"]["generated_tokens"],
        "accuracy": summary["accuracy"],
        "long_generate_s": long_s,
        "long_tokens": ntok,
        "version": vllm.__version__,
    }


def _vllm_forced(engine, ids: list[list[int]], new_tokens: int, batch: int) -> tuple[float, int]:
    """(seconds, tokens) of generating exactly ``new_tokens`` for every prompt, ``batch`` prompts per call."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    ntok = 0
    for b in range(0, len(ids), batch):
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in ids[b : b + batch]], sp, use_tqdm=False)
        ntok += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - t, ntok


def run_vllm_scale(model: Path, eval_file: Path, out: Path, dtype: str) -> dict:
    from loraflow.steps import evaluate as ev

    # build_engine imports vLLM itself: its start-up then includes the import, as in the evaluate stage
    engine = ev.build_engine(model, ev.resolve_config({**SCALE_EVAL, "dtype": dtype}), progress=lambda m: None)
    _, ids = ev.render_prompts(engine.tokenizer, ev.load_examples(eval_file, SCALE_PROMPTS))
    seconds, ntok = _vllm_forced(engine, ids, SCALE_TOKENS, SCALE_PROMPTS)
    engine.leave_to_exit()  # as the evaluate stage's program does: the process ends next
    return {
        "startup_s": engine.startup_s,
        "import_s": engine.import_s,
        "generate_s": seconds,
        "tokens": ntok,
        "version": engine.vllm_version,
        "kv_cache_bytes": engine.kwargs["kv_cache_memory_bytes"],
        # the workload, and what the KV cache was sized for (batch_size sequences of max_model_len tokens)
        "prompts": SCALE_PROMPTS,
        "new_tokens": SCALE_TOKENS,
        "kv_sequences": SCALE_EVAL["batch_size"],
        "kv_tokens": SCALE_EVAL["max_model_len"],
    }


def _hf_load(model: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok, AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()


def _hf_generate(tok, lm, ids: list[list[int]], max_new: int, force: bool, batch: int) -> tuple[float, int, list[str]]:
    """(seconds, tokens, texts) of HF generate, greedy, ``batch`` prompts per call; ``force``: exactly ``max_new``."""
    import torch

    texts, n = [], 0
    t = time.perf_counter()
    for b in range(0, len(ids), batch):
        padded = tok.pad({"input_ids": ids[b : b + batch]}, return_tensors="pt")
        kw = {"min_new_tokens": max_new} if force else {}
        with torch.no_grad():
            o = lm.generate(**padded, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id, **kw)
        for row in o[:, padded["input_ids"].shape[1] :].tolist():
            if not force and tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id) + 1]
            n += len(row)
            texts.append(tok.decode(row, skip_special_tokens=True))
    return time.perf_counter() - t, n, texts


def run_hf_scale(model: Path, eval_file: Path, out: Path, dtype: str) -> dict:
    from loraflow.steps import evaluate as ev

    t = time.perf_counter()  # start-up includes importing torch and transformers, as vLLM's includes vLLM
    import transformers

    tok, lm = _hf_load(model, dtype)
    startup = time.perf_counter() - t + (t - T0)
    _, ids = ev.render_prompts(tok, ev.load_examples(eval_file, SCALE_PROMPTS))
    seconds, ntok, _ = _hf_generate(tok, lm, ids, SCALE_TOKENS, True, SCALE_PROMPTS)
    return {"startup_s": startup, "generate_s": seconds, "tokens": ntok, "version": transformers.__version__}


def run_hf(model: Path, eval_file: Path, out: Path) -> dict:
    import torch
    import transformers

    from loraflow.evaluation import metrics
    from loraflow.steps import evaluate as ev

    t = time.perf_counter()
    tok, lm = _hf_load(model)
    startup = time.perf_counter() - t + (t - T0)
    examples = ev.load_examples(eval_file)
    _, ids = ev.render_prompts(tok, examples)

    spec_s, spec_n, texts = _hf_generate(tok, lm, ids, SPEC_EVAL["max_new_tokens"], False, 100)
    settings = metrics.Scoring.of(ev.resolve_config(SPEC_EVAL))  # as the evaluate step scores
    scored = metrics.score_all(texts, [e.reference for e in examples], settings)
    acc = metrics.aggregate(scored, settings.metrics)["accuracy"]
    long_s, long_n, _ = _hf_generate(tok, lm, ids, LONG, True, 100)
    return {
        "startup_s": startup,
        "spec_generate_s": spec_s,
        "spec_tokens": spec_n,
        "accuracy": acc,
        "long_generate_s": long_s,
        "long_tokens": long_n,
        "version": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mode, model, eval_file, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    out.mkdir(parents=True, exist_ok=True)
    modes = {"vllm": run_vllm, "hf": run_hf, "vllm-scale": run_vllm_scale, "hf-scale": run_hf_scale}
    res = modes[mode](model, eval_file, out, *sys.argv[5:])
    res["process_s_before_exit"] = time.perf_counter() - T0
    emit(res)
    from loraflow.steps._harness import exit_process

    exit_process(0)  # as the evaluate stage's program ends (no interpreter teardown), for both engines
