"""2. Merge: loraflow.lora.merge.merge_checkpoint against a naive load-everything torch merge, PEFT's
merge_and_unload + save_pretrained, and `cp -r` of the same base, on generated Llama-architecture bf16
checkpoints (sharded safetensors) with a rank-16 adapter on all projections. Every method at the target
size (~1.1 B, TinyLlama's shape), its outputs compared bit for bit with loraflow's; loraflow, PEFT (the
usual way; naive torch where PEFT is not installed) and cp at every size of common.SIZES, for the scaling
plot. Interleaved per repetition; wall time, peak RSS (/usr/bin/time -v), bytes written.
Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, SIZES, TARGET_SIZE, WORK, generated_checkpoint, machine, median, run, run_timed, save, say

CHILD = str(Path(__file__).resolve().parent / "_merge_children.py")
PEFT_LIB = Path("/tmp/bench-peftlib")  # PEFT + accelerate, installed --target here by bench/setup_peft.sh


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def methods(root: Path) -> dict[str, list[str]]:
    base, adapter = str(root / "base"), str(root / "adapter")
    m = {
        "cp -r (same bytes)": ["cp", "-r", "--reflink=never", base, "{out}"],
        "loraflow merge_checkpoint": [PY["trainer"], CHILD, "loraflow", base, adapter, "{out}"],
        "naive load-all (torch)": [PY["serving"], CHILD, "naive", base, adapter, "{out}"],
    }
    if (PEFT_LIB / "peft").is_dir():
        m["PEFT merge_and_unload + save_pretrained"] = [PY["serving"], CHILD, "peft", base, adapter, "{out}"]
    return m


def swept(label: str, labels: list[str]) -> bool:
    """Whether a method runs at every size (not only the target size): loraflow, cp and the usual alternative."""
    usual = "PEFT" if any(k.startswith("PEFT") for k in labels) else "naive"
    return label.startswith(("loraflow", "cp", usual))


def main() -> None:
    shutil.rmtree(WORK / "merge", ignore_errors=True)
    gen = {size: generated_checkpoint(size)[1] for size in SIZES}
    reps = 1 if QUICK else 3
    raw: dict[str, list[dict]] = {}
    compare = {}
    for rep in range(reps):
        last = rep == reps - 1
        for size in SIZES:
            model = generated_checkpoint(size)[0]
            work = WORK / "merge" / size.replace(" ", "")
            work.mkdir(parents=True, exist_ok=True)
            labels = list(methods(model))
            for label, argv in methods(model).items():
                if size != TARGET_SIZE and not swept(label, labels):
                    continue
                out = work / f"out-{label.split()[0]}"
                shutil.rmtree(out, ignore_errors=True)
                argv = [a.replace("{out}", str(out)) for a in argv]
                env = {"PYTHONPATH": f"{Path(__file__).resolve().parents[1]}:{PEFT_LIB}"} if "PEFT" in label else None
                r = run_timed(argv, extra_env=env, timeout=3600)
                if r["rc"] != 0:
                    say(f"merge {label} FAILED: {r.get('stderr_tail', '')[-800:]}")
                r["bytes_written"] = dir_bytes(out) if out.exists() else 0
                raw.setdefault(f"{size}: {label}", []).append(r)
                say(
                    f"merge rep {rep + 1}/{reps} {size} {label}: {r['wall_s']:.1f}s, peak RSS {r.get('peak_rss_mib', 0):.0f} MiB"
                )
                keep = last and size == TARGET_SIZE and not label.startswith("cp")  # compared below
                if not keep:
                    shutil.rmtree(out, ignore_errors=True)
            if last and size == TARGET_SIZE:
                ref = work / "out-loraflow"
                for label in labels:
                    other = work / f"out-{label.split()[0]}"
                    if other != ref and other.exists():
                        compare[f"loraflow vs {label}"] = run([PY["serving"], CHILD, "compare", str(ref), str(other)])
                shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for key, rs in raw.items():
        ok = [r for r in rs if r["rc"] == 0]
        size = key.split(":")[0]
        summary[key] = {
            "ok_runs": len(ok),
            "runs": len(rs),
            "median_wall_s": median([r["wall_s"] for r in ok]),
            "median_inner_s": median([r["inner_s"] for r in ok if "inner_s" in r])
            if any("inner_s" in r for r in ok)
            else None,
            "median_peak_rss_mib": median([r["peak_rss_mib"] for r in ok if "peak_rss_mib" in r]),
            "bytes_written": ok[-1]["bytes_written"] if ok else 0,
            "throughput_mib_s": gen[size]["bytes"] / 2**20 / median([r["wall_s"] for r in ok]) if ok else None,
        }
    save(
        "merge",
        {
            "target_size": TARGET_SIZE,
            "models": {k: {"dims(layers,hidden,inter,vocab)": SIZES[k], **gen[k]} for k in SIZES},
            "reps": reps,
            "summary": summary,
            "compare": compare,
            "machine": machine(),  # agreement with PEFT / torch depends on the CPU their BLAS runs on
            "raw": {
                k: [{kk: vv for kk, vv in r.items() if kk not in ("stdout_tail",)} for r in v] for k, v in raw.items()
            },
        },
    )
    shutil.rmtree(WORK / "merge", ignore_errors=True)


if __name__ == "__main__":
    main()
