"""8. QLoRA memory: the lora_sft stage on a generated ~100 M parameter Llama-architecture model with
LoRA, int8 and nf4 base weights, side by side in one run: the training state's device bytes (model,
adapter, optimizer), the compiled train step's argument and temporary bytes (XLA's memory analysis) and
the loss after the same steps. Fresh trainer-env process each, interleaved.
Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, WORK, median, run_timed, save, say

CHILD = str(Path(__file__).resolve().parent / "_qlora_child.py")
VARIANTS = ("none", "int8", "nf4")
STEPS = 3 if QUICK else 10


def main() -> None:
    root = WORK / "qlora"
    shutil.rmtree(root, ignore_errors=True)
    prep = run_timed([PY["trainer"], CHILD, "prepare", str(root)], timeout=1800)
    assert prep["rc"] == 0, prep.get("stderr_tail")
    say(f"qlora: {prep['parameters'] / 1e6:.1f} M parameter model converted in {prep['wall_s']:.0f}s")
    # One run each: the state's bytes and the losses are deterministic; the seconds are a side figure.
    reps = 1
    raw: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for variant in VARIANTS:
        r = run_timed([PY["trainer"], CHILD, "train", str(root), str(STEPS), variant], timeout=3600)
        if r["rc"] != 0:
            raise SystemExit(f"qlora {variant} failed: {r.get('stderr_tail')}")
        raw[variant].append(r)
        say(
            f"qlora {variant}: training state {r['train_state_bytes'] / 2**20:.0f} MiB (model "
            f"{r['model_bytes'] / 2**20:.0f} MiB), loss {r['first_loss']:.3f} -> {r['final_loss']:.3f} in "
            f"{r['train_s']:.0f}s, peak RSS {r.get('peak_rss_mib', 0):.0f} MiB"
        )
    keys = ("train_state_bytes", "model_bytes", "adapter_bytes", "optimizer_bytes", "step_argument_bytes",
            "step_temp_bytes", "first_loss", "final_loss", "train_s", "setup_s", "peak_rss_mib")  # fmt: skip
    summary = {v: {k: median([r.get(k, float("nan")) for r in rs]) for k in keys} for v, rs in raw.items()}
    save("qlora", {"reps": reps, "steps": STEPS, "parameters": prep["parameters"], "dims": prep["dims"],
                   "summary": summary})  # fmt: skip


if __name__ == "__main__":
    main()
