"""2. Merge: loraflow.lora.merge.merge_checkpoint against a naive load-everything torch merge, PEFT's
merge_and_unload + save_pretrained, and `cp -r` of the same base, on a generated ~1.1B-parameter
Llama-architecture bf16 checkpoint (sharded safetensors) with a rank-16 adapter on all projections.
Interleaved A B C D per repetition; wall time, peak RSS (/usr/bin/time -v), bytes written; the
outputs are compared bit for bit with loraflow's. Driver: any Python (stdlib only).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, WORK, machine, median, run, run_timed, save, say

CHILD = str(Path(__file__).resolve().parent / "_merge_children.py")
PEFT_LIB = Path("/tmp/bench-peftlib")  # PEFT + accelerate, installed --target here by bench/setup_peft.sh
# (layers, hidden, intermediate, vocab): TinyLlama-1.1B's shape; a 4-layer one with the same largest tensor
BIG = (4, 1024, 2816, 32000) if QUICK else (22, 2048, 5632, 32000)
SMALL = (2, 1024, 2816, 32000) if QUICK else (4, 2048, 5632, 32000)


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


def main() -> None:
    shutil.rmtree(WORK / "merge", ignore_errors=True)
    models = {"big": BIG, "small": SMALL}
    gen = {}
    for name, dims in models.items():
        say(f"merge: generating {name} checkpoint {dims}")
        gen[name] = run([PY["serving"], CHILD, "gen", str(WORK / "merge" / name), *map(str, dims)], timeout=3600)
        assert gen[name]["rc"] == 0, gen[name]
        say(f"merge: {name}: {gen[name]['parameters'] / 1e9:.2f} B parameters, {gen[name]['bytes'] / 2**30:.2f} GiB")
    reps = 1 if QUICK else 3
    raw: dict[str, list[dict]] = {}
    compare = {}
    for rep in range(reps):
        for model in ("big", "small"):
            root = WORK / "merge" / model
            for label, argv in methods(root).items():
                if model == "small" and not label.startswith(("loraflow", "cp")):
                    continue  # the small model only shows whether loraflow's peak memory grows with model size
                out = root / f"out-{label.split()[0]}"
                shutil.rmtree(out, ignore_errors=True)
                argv = [a.replace("{out}", str(out)) for a in argv]
                env = {"PYTHONPATH": f"{Path(__file__).resolve().parents[1]}:{PEFT_LIB}"} if "PEFT" in label else None
                r = run_timed(argv, extra_env=env, timeout=3600)
                if r["rc"] != 0:
                    say(f"merge {label} FAILED: {r.get('stderr_tail', '')[-800:]}")
                r["bytes_written"] = dir_bytes(out) if out.exists() else 0
                raw.setdefault(f"{model}: {label}", []).append(r)
                say(
                    f"merge rep {rep + 1}/{reps} {model} {label}: {r['wall_s']:.1f}s, peak RSS {r.get('peak_rss_mib', 0):.0f} MiB"
                )
                last = rep == reps - 1
                if label.startswith("loraflow") or not last or label.startswith("cp"):
                    if not (label.startswith("loraflow") and last):
                        shutil.rmtree(out, ignore_errors=True)
            if rep == reps - 1:
                ref = root / "out-loraflow"
                for label in methods(root):
                    other = root / f"out-{label.split()[0]}"
                    if other != ref and other.exists() and not label.startswith("cp"):
                        compare[f"{model}: loraflow vs {label}"] = run(
                            [PY["serving"], CHILD, "compare", str(ref), str(other)]
                        )
                        shutil.rmtree(other, ignore_errors=True)
    summary = {}
    for key, rs in raw.items():
        ok = [r for r in rs if r["rc"] == 0]
        model = key.split(":")[0]
        summary[key] = {
            "ok_runs": len(ok),
            "runs": len(rs),
            "median_wall_s": median([r["wall_s"] for r in ok]),
            "median_inner_s": median([r["inner_s"] for r in ok if "inner_s" in r])
            if any("inner_s" in r for r in ok)
            else None,
            "median_peak_rss_mib": median([r["peak_rss_mib"] for r in ok if "peak_rss_mib" in r]),
            "bytes_written": ok[-1]["bytes_written"] if ok else 0,
            "throughput_mib_s": gen[model]["bytes"] / 2**20 / median([r["wall_s"] for r in ok]) if ok else None,
        }
    save(
        "merge",
        {
            "models": {k: {"dims(layers,hidden,inter,vocab)": models[k], **gen[k]} for k in models},
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
