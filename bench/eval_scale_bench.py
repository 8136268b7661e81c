"""4b. Evaluation at 0.5 B: vLLM as loraflow's evaluate stage loads it against Hugging Face generate on a
generated ~0.5 B parameter Llama-architecture model (float32), 128 prompts in one batch, 32 new tokens
each, greedy, EOS ignored: enough decoding that generation, not engine start-up, is most of the work.
Fresh process each, interleaved. Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, REPO, WORK, median, run, run_timed, save, say

# ~0.5 B parameters: 20 layers of width 1536 (12 query heads, 4 KV heads of 128), MLP 4096, the tiny
# model's 512-token vocabulary (the prompts are the parity eval set's). QUICK: a 2-layer smoke size.
DIMS = {
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 2 if QUICK else 20,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 512,
}
ENGINES = {"vLLM (loraflow evaluate)": "vllm-scale", "HF transformers generate": "hf-scale"}


def make_model(dest: Path) -> int:
    """The generated checkpoint (once); its parameter count."""
    corpus = REPO / "pipelines" / "data" / "parity" / "train.jsonl"
    code = (
        "import sys; from pathlib import Path; from loraflow.dev import tinymodel; "
        f"tinymodel.create(Path(sys.argv[1]), [Path({str(corpus)!r})], dims={DIMS!r})"
    )
    if not (dest / "model.safetensors").exists():
        r = run([PY["serving"], "-c", code, str(dest)], timeout=1800)
        assert r["rc"] == 0, r
    d, f, v, n = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["vocab_size"], DIMS["num_hidden_layers"]
    q, kv = DIMS["num_attention_heads"] * DIMS["head_dim"], DIMS["num_key_value_heads"] * DIMS["head_dim"]
    return n * (2 * d * q + 2 * d * kv + 3 * d * f + 2 * d) + 2 * v * d + d


def main() -> None:
    root = WORK / "eval_scale"
    shutil.rmtree(root, ignore_errors=True)
    parameters = make_model(root / "model")
    say(f"eval_scale: {parameters / 1e6:.0f} M parameter model written")
    eval_file = REPO / "pipelines" / "data" / "parity" / "eval.jsonl"
    reps = 1 if QUICK else 2
    raw: dict[str, list[dict]] = {label: [] for label in ENGINES}
    for rep in range(reps):
        for label, mode in ENGINES.items():
            argv = [PY["serving"], str(Path(__file__).parent / "_eval_child.py"), mode, str(root / "model")]
            r = run_timed([*argv, str(eval_file), str(root / f"out-{mode}")], timeout=3600)
            if r["rc"] != 0:
                raise SystemExit(f"eval_scale {label} failed: {r.get('stderr_tail', '')[-1500:]}")
            raw[label].append(r)
            say(
                f"eval_scale rep {rep + 1}/{reps} {label}: wall {r['wall_s']:.1f}s, start-up {r['startup_s']:.1f}s, "
                f"{r['tokens']} tokens in {r['generate_s']:.1f}s"
            )
    summary = {
        label: {
            "median_wall_s": median([r["wall_s"] for r in rs]),
            "median_startup_s": median([r["startup_s"] for r in rs]),
            "median_generate_s": median([r["generate_s"] for r in rs]),
            "tokens": rs[-1]["tokens"],
            "tokens_per_s": median([r["tokens"] / r["generate_s"] for r in rs]),
            "median_peak_rss_mib": median([r.get("peak_rss_mib", 0) for r in rs]),
            "version": rs[-1]["version"],
        }
        for label, rs in raw.items()
    }
    save("eval_scale", {"reps": reps, "parameters": parameters, "dims": DIMS, "summary": summary, "raw": raw})
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
