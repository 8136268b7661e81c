"""Child of eval_bench.py (serving env). argv: vllm|hf MODEL_DIR EVAL_JSONL OUT_DIR

Two workloads on one loaded model: "spec" = the tiny spec's evaluation settings (400 prompts,
batch 100, greedy, max_new_tokens 4, stops at EOS) and "long" = 32 new tokens per prompt, EOS
ignored (decode throughput). vllm runs loraflow.steps.evaluate.evaluate() itself for "spec".
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
    from vllm import SamplingParams

    _, ids = ev.render_prompts(engine.tokenizer, ev.load_examples(eval_file))
    sp = SamplingParams(temperature=0.0, max_tokens=LONG, min_tokens=LONG, ignore_eos=True)
    t = time.perf_counter()
    ntok = 0
    for b in range(0, len(ids), 100):
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in ids[b : b + 100]], sp, use_tqdm=False)
        ntok += sum(len(o.outputs[0].token_ids) for o in outs)
    long_s = time.perf_counter() - t
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


def run_hf(model: Path, eval_file: Path, out: Path) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraflow.evaluation import metrics, scoring
    from loraflow.steps import evaluate as ev

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    lm = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    startup = time.perf_counter() - t + (t - T0)
    examples = ev.load_examples(eval_file)
    _, ids = ev.render_prompts(tok, examples)

    def gen(max_new: int, force: bool) -> tuple[float, int, list[str]]:
        texts, n = [], 0
        t = time.perf_counter()
        for b in range(0, len(ids), 100):
            batch = tok.pad({"input_ids": ids[b : b + 100]}, return_tensors="pt")
            kw = {"min_new_tokens": max_new} if force else {}
            with torch.no_grad():
                o = lm.generate(**batch, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id, **kw)
            new = o[:, batch["input_ids"].shape[1] :]
            for row in new.tolist():
                if not force and tok.eos_token_id in row:
                    row = row[: row.index(tok.eos_token_id) + 1]
                n += len(row)
                texts.append(tok.decode(row, skip_special_tokens=True))
        return time.perf_counter() - t, n, texts

    spec_s, spec_n, texts = gen(SPEC_EVAL["max_new_tokens"], False)
    scored = metrics.score_all(
        texts, [e.reference for e in examples], scoring.compile_pattern(SPEC_EVAL["answer_pattern"])
    )
    acc = metrics.aggregate(scored)["accuracy"]
    long_s, long_n, _ = gen(LONG, True)
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
    res = (run_vllm if mode == "vllm" else run_hf)(model, eval_file, out)
    res["process_s_before_exit"] = time.perf_counter() - T0
    emit(res)
