"""4b. Evaluation at 0.1 B and 0.5 B: vLLM as loraflow's evaluate stage loads it against Hugging Face
generate on generated Llama-architecture models of ~0.1 B and ~0.5 B parameters served in float32, and the
0.5 B one in bfloat16 too (the dtype production models are trained and served in), 128 prompts in one
batch, 32 new tokens each, greedy, EOS ignored: enough decoding that generation, not engine start-up, is
most of the work. Fresh process each, interleaved. Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PY,
    QUICK,
    REPO,
    WORK,
    interleaved,
    machine,
    median,
    medians,
    run_or_stop,
    save,
    say,
    tinymodel_checkpoint,
)

# Width 1536 (12 query heads, 4 KV heads of 128), MLP 4096, 20 layers: ~0.5 B; width 768 (6 / 2 heads
# of 128), MLP 2048, 16 layers: ~0.1 B; the tiny model's 512-token vocabulary (the prompts are the
# parity eval set's). QUICK: 2-layer smoke sizes.
SIZES = {
    "0.1 B": {
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 2 if QUICK else 16,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "vocab_size": 512,
    },
    "0.5 B": {
        "hidden_size": 1536,
        "intermediate_size": 4096,
        "num_hidden_layers": 2 if QUICK else 20,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 512,
    },
}
# What is measured: (model, dtype both engines serve it in).
RUNS = {"0.1 B": ("0.1 B", "float32"), "0.5 B": ("0.5 B", "float32"), "0.5 B bf16": ("0.5 B", "bfloat16")}
TARGET_SIZE = "0.5 B"  # the size issue 18's evaluation targets name
ENGINES = {"vLLM (loraflow evaluate)": "vllm-scale", "HF transformers generate": "hf-scale"}


def main() -> None:
    root = WORK / "eval_scale"
    shutil.rmtree(root, ignore_errors=True)
    parameters = {size: tinymodel_checkpoint(root / size.replace(" ", ""), dims)[1] for size, dims in SIZES.items()}
    say(f"eval_scale: models of {', '.join(f'{p / 1e6:.0f} M' for p in parameters.values())} parameters written")
    eval_file = REPO / "pipelines" / "data" / "parity" / "eval.jsonl"
    reps = 1 if QUICK else 2
    raw: dict[str, dict[str, list[dict]]] = {run: {label: [] for label in ENGINES} for run in RUNS}
    for rep, size, label, mode in interleaved(reps, RUNS, ENGINES):
        model_size, dtype = RUNS[size]
        model = root / model_size.replace(" ", "")
        argv = [PY["serving"], str(Path(__file__).parent / "_eval_child.py"), mode, str(model), str(eval_file)]
        r = run_or_stop(f"eval_scale {label}", [*argv, str(root / f"out-{mode}"), dtype], timeout=3600)
        raw[size][label].append(r)
        say(
            f"eval_scale rep {rep + 1}/{reps} {size} {label}: wall {r['wall_s']:.1f}s, start-up "
            f"{r['startup_s']:.1f}s, {r['tokens']} tokens in {r['generate_s']:.1f}s"
        )
    summary = {
        size: {
            label: {
                **medians(rs, "wall_s", "startup_s", "generate_s", "peak_rss_mib"),
                "tokens": rs[-1]["tokens"],
                "tokens_per_s": median([r["tokens"] / r["generate_s"] for r in rs]),
                "version": rs[-1]["version"],
            }
            for label, rs in by_label.items()
        }
        for size, by_label in raw.items()
    }
    save(
        "eval_scale",
        {
            "reps": reps,
            "target_size": TARGET_SIZE,
            "models": {
                run: {"parameters": parameters[size], "dims": SIZES[size], "dtype": dtype}
                for run, (size, dtype) in RUNS.items()
            },
            "summary": summary,
            "machine": machine(),
            "raw": raw,
        },
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
