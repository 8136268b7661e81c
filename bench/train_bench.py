"""7. Training: the lora_sft stage function against MaxText's own SFT entry points run directly with
the same MaxText arguments, on the tiny model with the tiny spec's training config; fresh trainer-env
process each, interleaved A B A B; tokens per second of MaxText's train_model, set-up and process wall.
Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, WORK, median, run_timed, save, say
from eval_bench import tiny_model

CHILD = str(Path(__file__).resolve().parent / "_train_child.py")
MODES = {"loraflow lora_sft stage": "loraflow", "MaxText train_sft direct": "direct"}
STEPS = 20 if QUICK else 50


def main() -> None:
    root = WORK / "train"
    shutil.rmtree(root, ignore_errors=True)
    tiny_model(root / "tiny-llama")
    prep = run_timed([PY["trainer"], CHILD, "prepare", str(root)], timeout=900)
    assert prep["rc"] == 0, prep.get("stderr_tail")
    reps = 1 if QUICK else 2
    raw: dict[str, list[dict]] = {k: [] for k in MODES}
    for rep in range(reps):
        for label, mode in MODES.items():
            shutil.rmtree(root / f"out-{mode}", ignore_errors=True)
            r = run_timed([PY["trainer"], CHILD, mode, str(root), str(STEPS)], timeout=1800)
            if r["rc"] != 0:
                raise SystemExit(f"{label} failed: {r.get('stderr_tail')}")
            raw[label].append(r)
            say(
                f"train rep {rep + 1}/{reps} {label}: {r['tokens_per_s']:.0f} tokens/s "
                f"(train {r['train_s']:.1f}s, setup {r['setup_s']:.1f}s, process {r['wall_s']:.1f}s, "
                f"peak RSS {r.get('peak_rss_mib', 0):.0f} MiB)"
            )
    summary = {
        label: {
            "median_tokens_per_s": median([r["tokens_per_s"] for r in rs]),
            "median_train_s": median([r["train_s"] for r in rs]),
            "median_setup_s": median([r["setup_s"] for r in rs]),
            "median_wall_s": median([r["wall_s"] for r in rs]),
            "median_peak_rss_mib": median([r.get("peak_rss_mib", 0) for r in rs]),
        }
        for label, rs in raw.items()
    }
    save(
        "train",
        {
            "reps": reps,
            "steps": STEPS,
            "summary": summary,
            "raw": {k: [{kk: vv for kk, vv in r.items() if kk != "stdout_tail"} for r in v] for k, v in raw.items()},
        },
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
