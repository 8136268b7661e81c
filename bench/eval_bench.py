"""4. Evaluation: vLLM as loraflow's evaluate stage runs it against Hugging Face generate (batched,
greedy, the same chat-rendered prompts) on the tiny model; fresh process each, interleaved.
Driver: any Python (stdlib only)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, REPO, WORK, median, run_timed, save, say, tinymodel_checkpoint


def main() -> None:
    root = WORK / "eval"
    shutil.rmtree(root, ignore_errors=True)
    model = tinymodel_checkpoint(root / "tiny-llama")[0]
    eval_dir = root / "evalset"
    eval_dir.mkdir(parents=True)
    shutil.copy(REPO / "pipelines" / "data" / "parity" / "eval.jsonl", eval_dir / "eval.jsonl")
    reps = 1 if QUICK else 3
    raw: dict[str, list[dict]] = {"vLLM (loraflow evaluate)": [], "HF transformers generate": []}
    for rep in range(reps):
        for label, mode in (("vLLM (loraflow evaluate)", "vllm"), ("HF transformers generate", "hf")):
            r = run_timed(
                [
                    PY["serving"],
                    str(Path(__file__).parent / "_eval_child.py"),
                    mode,
                    str(model),
                    str(eval_dir / "eval.jsonl"),
                    str(root / f"out-{mode}"),
                ],
                timeout=900,
            )
            if r["rc"] != 0:
                say(f"eval {label} FAILED: {r.get('stderr_tail', '')[-1500:]}")
                continue
            raw[label].append(r)
            say(
                f"eval rep {rep + 1}/{reps} {label}: wall {r['wall_s']:.1f}s, spec gen {r['spec_generate_s']:.2f}s "
                f"({r['spec_tokens']} tok), long gen {r['long_generate_s']:.2f}s ({r['long_tokens']} tok)"
            )
    summary = {}
    for label, rs in raw.items():
        if not rs:
            continue
        summary[label] = {
            "median_wall_s": median([r["wall_s"] for r in rs]),
            "median_startup_s": median([r["startup_s"] for r in rs]),
            "median_spec_generate_s": median([r["spec_generate_s"] for r in rs]),
            "spec_tokens": rs[-1]["spec_tokens"],
            "spec_tokens_per_s": median([r["spec_tokens"] / r["spec_generate_s"] for r in rs]),
            "median_long_generate_s": median([r["long_generate_s"] for r in rs]),
            "long_tokens": rs[-1]["long_tokens"],
            "long_tokens_per_s": median([r["long_tokens"] / r["long_generate_s"] for r in rs]),
            "accuracy": rs[-1]["accuracy"],
            "median_peak_rss_mib": median([r.get("peak_rss_mib", 0) for r in rs]),
            "version": rs[-1]["version"],
        }
    save("eval", {"reps": reps, "prompts": 400, "summary": summary, "raw": raw})
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
