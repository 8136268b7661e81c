"""Model families: conversion peak RSS and merge throughput per family at Qwen3-0.6B's dimensions.

Each family's real HF architecture (loraflow.dev.tinymodel: Llama untied, Qwen3 with q/k norms and
tied embeddings, Gemma 3 with four norms a layer, q/k norms, tied embeddings and its tiny model's
16-token window) generated as a bf16 checkpoint at the same dimensions (DIMS: 28 layers, hidden 1024,
MLP 3072, 16 query / 8 KV heads of 128, vocabulary 151,936), so the families differ only in what
their architecture holds. Per repetition, family after family (interleaved): the convert stage's
function (fresh trainer-env process, peak RSS by /usr/bin/time -v), then loraflow's merge of a rank-16
adapter on every projection (fresh process; throughput = checkpoint bytes / merge seconds).
Driver: any Python (stdlib only). Writes bench/results/families.json.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, WORK, machine, median, run, run_timed, save, say

FAMILIES = ("llama", "qwen3", "gemma3")
DIMS = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
}
QUICK_DIMS = {**DIMS, "num_hidden_layers": 2, "vocab_size": 32000}
CHILD = str(Path(__file__).resolve().parent / "_family_child.py")
MERGE_CHILD = str(Path(__file__).resolve().parent / "_merge_children.py")


def generated(family: str, dims: dict[str, int]) -> tuple[Path, dict]:
    root = WORK / "families" / family
    facts = root / "facts.json"
    if not facts.exists():
        shutil.rmtree(root, ignore_errors=True)
        say(f"generating the {family} checkpoint {dims}")
        r = run([PY["trainer"], CHILD, "gen", family, str(root), json.dumps(dims)], timeout=3600)
        if r["rc"] != 0:
            raise SystemExit(f"generating {family} failed: {r.get('stderr_tail', '')[-1500:]}")
        facts.write_text(json.dumps({k: v for k, v in r.items() if k not in ("wall_s", "rc", "stdout_tail")}))
    return root, json.loads(facts.read_text())


def main() -> None:
    dims = QUICK_DIMS if QUICK else DIMS
    reps = 1 if QUICK else 2  # a conversion at this size takes minutes
    models = {family: generated(family, dims) for family in FAMILIES}
    raw: dict[str, dict[str, list[dict]]] = {f: {"convert": [], "merge": []} for f in FAMILIES}
    for rep in range(reps):
        for family in FAMILIES:
            root, _ = models[family]
            out = WORK / "families" / "out"
            shutil.rmtree(out, ignore_errors=True)
            c = run_timed([PY["trainer"], CHILD, "convert", family, str(root / "base"), str(out)], timeout=3600)
            shutil.rmtree(out, ignore_errors=True)
            m = run_timed([PY["trainer"], MERGE_CHILD, "loraflow", str(root / "base"), str(root / "adapter"), str(out)])
            shutil.rmtree(out, ignore_errors=True)
            for kind, r in (("convert", c), ("merge", m)):
                r.pop("stdout_tail", None)
                raw[family][kind].append(r)
            say(
                f"rep {rep + 1}/{reps} {family}: convert {c['wall_s']:.1f}s peak {c.get('peak_rss_mib', 0):.0f} MiB "
                f"ok={c.get('ok')}; merge {m.get('inner_s', 0):.1f}s peak {m.get('peak_rss_mib', 0):.0f} MiB"
            )
    summary = {}
    for family, kinds in raw.items():
        facts = models[family][1]
        conv = [r for r in kinds["convert"] if r.get("ok")]
        merges = [r for r in kinds["merge"] if "inner_s" in r]
        summary[family] = {
            **facts,
            "convert_ok_runs": len(conv),
            "median_convert_s": median([r["convert_s"] for r in conv]),
            "median_convert_peak_rss_mib": median([r["peak_rss_mib"] for r in conv]),
            "median_merge_s": median([r["inner_s"] for r in merges]),
            "median_merge_gb_per_s": median([facts["bytes"] / r["inner_s"] / 1e9 for r in merges]),
            "median_merge_peak_rss_mib": median([r["peak_rss_mib"] for r in merges]),
        }
    save("families", {"reps": reps, "dims": dims, "summary": summary, "machine": machine(), "raw": raw})
    shutil.rmtree(WORK / "families", ignore_errors=True)


if __name__ == "__main__":
    main()
