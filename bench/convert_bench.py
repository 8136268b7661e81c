"""5. Conversion: loraflow's convert stage function against MaxText's to_maxtext run directly
(eager, and lazy) on the tiny model; fresh trainer-env process each, interleaved; wall and peak RSS.
Driver: any Python (stdlib only)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PY, QUICK, WORK, median, run_timed, save, say
from eval_bench import tiny_model

MODES = {
    "loraflow convert stage": "loraflow",
    "to_maxtext direct, eager": "direct-eager",
    "to_maxtext direct, lazy": "direct-lazy",
}


def main() -> None:
    root = WORK / "convert"
    shutil.rmtree(root, ignore_errors=True)
    model = tiny_model(root / "tiny-llama")
    reps = 1 if QUICK else 2
    raw: dict[str, list[dict]] = {k: [] for k in MODES}
    for rep in range(reps):
        for label, mode in MODES.items():
            if mode == "direct-lazy" and rep > 0 and not any(r.get("ok") for r in raw[label]):
                continue  # it fails the same way every time
            out = root / f"out-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            r = run_timed(
                [PY["trainer"], str(Path(__file__).parent / "_convert_child.py"), mode, str(model), str(out)],
                timeout=900,
            )
            if "ok" not in r:
                r["ok"], r["error"] = False, (r.get("stderr_tail") or "")[-400:]
            raw[label].append(r)
            say(
                f"convert rep {rep + 1}/{reps} {label}: wall {r['wall_s']:.1f}s, peak RSS {r.get('peak_rss_mib', 0):.0f} MiB, "
                f"ok={r['ok']} {r.get('error', '')[:200]}"
            )
            shutil.rmtree(out, ignore_errors=True)
    summary = {}
    for label, rs in raw.items():
        ok = [r for r in rs if r.get("ok")]
        summary[label] = {
            "ok_runs": len(ok),
            "runs": len(rs),
            "error": None if ok else rs[-1].get("error"),
            "median_wall_s": median([r["wall_s"] for r in (ok or rs)]),
            "median_convert_s": median([r["convert_s"] for r in (ok or rs) if "convert_s" in r]),
            "median_peak_rss_mib": median([r.get("peak_rss_mib", 0) for r in (ok or rs)]),
        }
    save(
        "convert",
        {
            "reps": reps,
            "summary": summary,
            "raw": {k: [{kk: vv for kk, vv in r.items() if kk != "stdout_tail"} for r in v] for k, v in raw.items()},
        },
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
