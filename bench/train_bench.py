"""7. Training: the lora_sft stage function against MaxText's own SFT entry points run directly with
the same MaxText arguments, with the tiny spec's training config, at two model sizes: the tiny model and
a ~50 M parameter one of the same family (the same tokenizer and data). Fresh trainer-env process each,
interleaved A B A B; tokens per second of MaxText's train_model, set-up and process wall.
Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PY,
    QUICK,
    WORK,
    interleaved,
    machine,
    medians,
    run_or_stop,
    save,
    say,
    tinymodel_checkpoint,
)

CHILD = str(Path(__file__).resolve().parent / "_train_child.py")
MODES = {"loraflow lora_sft stage": "loraflow", "MaxText train_sft direct": "direct"}
# size -> (the model's dims: None for the tiny model; training steps)
SIZES = {
    "tiny": (None, 20 if QUICK else 50),
    "50 M": (
        {
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 2 if QUICK else 8,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "vocab_size": 512,
        },
        5 if QUICK else 20,
    ),
}


def main() -> None:
    root = WORK / "train"
    shutil.rmtree(root, ignore_errors=True)
    parameters = {}
    for size, (dims, _) in SIZES.items():
        parameters[size] = tinymodel_checkpoint(root / size.replace(" ", "") / "model", dims)[1]
        run_or_stop(
            f"preparing {size}", [PY["trainer"], CHILD, "prepare", str(root / size.replace(" ", ""))], timeout=900
        )
    reps = 1 if QUICK else 2
    raw: dict[str, dict[str, list[dict]]] = {size: {k: [] for k in MODES} for size in SIZES}
    for rep, size, label, mode in interleaved(reps, SIZES, MODES):
        where = root / size.replace(" ", "")
        shutil.rmtree(where / f"out-{mode}", ignore_errors=True)
        r = run_or_stop(label, [PY["trainer"], CHILD, mode, str(where), str(SIZES[size][1])], timeout=1800)
        raw[size][label].append(r)
        say(
            f"train rep {rep + 1}/{reps} {size} {label}: {r['tokens_per_s']:.0f} tokens/s "
            f"(train {r['train_s']:.1f}s, setup {r['setup_s']:.1f}s, process {r['wall_s']:.1f}s, "
            f"peak RSS {r.get('peak_rss_mib', 0):.0f} MiB)"
        )
    summary = {
        size: {
            label: medians(rs, "tokens_per_s", "train_s", "setup_s", "wall_s", "peak_rss_mib")
            for label, rs in by_label.items()
        }
        for size, by_label in raw.items()
    }
    save(
        "train",
        {
            "reps": reps,
            "machine": machine(),
            "sizes": {size: {"parameters": parameters[size], "steps": steps} for size, (_, steps) in SIZES.items()},
            "summary": summary,
            "raw": {
                size: {k: [{kk: vv for kk, vv in r.items() if kk != "stdout_tail"} for r in v] for k, v in by.items()}
                for size, by in raw.items()
            },
        },
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
