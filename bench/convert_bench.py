"""5. Conversion against model size: loraflow's convert stage function against MaxText's to_maxtext run
directly (eager: the usual way) on generated bf16 Llama checkpoints of every size in common.SIZES; fresh
trainer-env process each, interleaved, wall and peak RSS. to_maxtext's own lazy mode is tried once on
the smallest size (it fails: Orbax v1 cannot save its leaves). A method whose peak memory, extrapolated
from the largest size it ran at, would exceed 85 % of this machine's RAM is not started at a size.
Driver: any Python (stdlib only)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    PY,
    QUICK,
    SIZES,
    TARGET_SIZE,
    WORK,
    generated_checkpoint,
    interleaved,
    machine,
    median,
    memory_bytes,
    run_timed,
    save,
    say,
)

MODES = {"loraflow convert stage": "loraflow", "to_maxtext direct, eager": "direct-eager"}
LAZY = ("to_maxtext direct, lazy", "direct-lazy")
CHILD = str(Path(__file__).resolve().parent / "_convert_child.py")


def convert_once(mode: str, base: Path) -> dict:
    out = WORK / "convert" / f"out-{mode}"
    shutil.rmtree(out, ignore_errors=True)
    r = run_timed([PY["trainer"], CHILD, mode, str(base), str(out)], timeout=3600)
    if "ok" not in r:
        r["ok"], r["error"] = False, (r.get("stderr_tail") or "")[-400:]
    shutil.rmtree(out, ignore_errors=True)
    return r


def too_big(runs: dict[str, list[dict]], facts: dict[str, dict], size: str) -> str | None:
    """Why a method should not start at ``size``: its peak RSS at the largest size it ran at, scaled by
    the parameter count, over 85 % of RAM; None when it fits (or has not run yet)."""
    done = [(s, r) for s, rs in runs.items() for r in rs if r.get("ok") and s != size]
    if not done:
        return None
    s, r = max(done, key=lambda sr: facts[sr[0]]["parameters"])
    need = r["peak_rss_mib"] * 2**20 * facts[size]["parameters"] / facts[s]["parameters"]
    if need <= 0.85 * memory_bytes():
        return None
    return (
        f"not run: would need ~{need / 2**30:.0f} GiB (its {r['peak_rss_mib'] / 1024:.1f} GiB at {s}, scaled by "
        f"parameters) of this machine's {memory_bytes() / 2**30:.0f} GiB"
    )


def main() -> None:
    shutil.rmtree(WORK / "convert", ignore_errors=True)
    facts = {size: generated_checkpoint(size)[1] for size in SIZES}
    reps = 1 if QUICK else 2
    raw: dict[str, dict[str, list[dict]]] = {label: {size: [] for size in SIZES} for label in MODES}
    skipped: dict[str, dict[str, str]] = {label: {} for label in MODES}
    for rep, size, label, mode in interleaved(reps, SIZES, MODES):
        why = skipped[label].get(size) or too_big(raw[label], facts, size)
        if why:
            skipped[label][size] = why
            say(f"convert {size} {label}: {why}")
            continue
        r = convert_once(mode, generated_checkpoint(size)[0] / "base")
        raw[label][size].append(r)
        say(
            f"convert rep {rep + 1}/{reps} {size} {label}: wall {r['wall_s']:.1f}s, peak RSS "
            f"{r.get('peak_rss_mib', 0):.0f} MiB, ok={r['ok']} {r.get('error', '')[:200]}"
        )
    smallest = next(iter(SIZES))
    lazy = convert_once(LAZY[1], generated_checkpoint(smallest)[0] / "base")
    say(f"convert {smallest} {LAZY[0]}: ok={lazy['ok']} {lazy.get('error', '')[:200]}")

    summary: dict[str, dict[str, dict]] = {}
    for label, by_size in raw.items():
        for size, rs in by_size.items():
            ok = [r for r in rs if r.get("ok")]
            summary.setdefault(size, {})[label] = {
                "ok_runs": len(ok),
                "runs": len(rs),
                "error": skipped[label].get(size) or (None if ok or not rs else rs[-1].get("error")),
                "median_wall_s": median([r["wall_s"] for r in ok]) if ok else None,
                "median_convert_s": median([r["convert_s"] for r in ok if "convert_s" in r]) if ok else None,
                "median_peak_rss_mib": median([r.get("peak_rss_mib", 0) for r in ok]) if ok else None,
            }
    save(
        "convert",
        {
            "reps": reps,
            "target_size": TARGET_SIZE,
            "models": {size: {"dims(layers,hidden,inter,vocab)": SIZES[size], **facts[size]} for size in SIZES},
            "summary": summary,
            "lazy": {"size": smallest, "ok": lazy["ok"], "error": lazy.get("error")},
            "machine": machine(),
            "raw": {
                k: {s: [{kk: vv for kk, vv in r.items() if kk != "stdout_tail"} for r in rs] for s, rs in v.items()}
                for k, v in raw.items()
            },
        },
    )
    shutil.rmtree(WORK / "convert", ignore_errors=True)


if __name__ == "__main__":
    main()
