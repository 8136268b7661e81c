"""Will it fit? `loraflow plan --fit`'s prediction against the peaks a TPU v5e chip measured.

Predicts, on this CPU (no chip), each configuration bench/tpu measured on one v5e chip: the 1.5 B model
with LoRA, nf4 and int8, the 3.6 B with LoRA and nf4 and the 8B with nf4: the same model shapes, 8 rows of
1,024 tokens, rank 16, tile 64, bf16. The chip's memory in use is its arrays (``peak_bytes_in_use``) plus
what it reserves for the loaded programs' temporaries (``peak_bytes_reserved``), and that sum is what is
compared: recorded with the train step donating the model (loraflow.trainer.donation) in
``bench/results/tpu-memory.json`` (the 1.5 B cases: bench/tpu's ``memory`` phase), ``tpu-memory-3b.json``
and ``tpu-memory-8b.json`` (the loraflow cases of its ``3b`` and ``8b-qlora`` phases, run the same day on
the same machine, renamed). Recorded measurements, not re-measured here (the chip ran JAX 0.10.2 with
libtpu 0.0.42.1; this prediction runs in the trainer env's JAX and libtpu, which the record names). Beside
it, the same rule applied to the compiled step's memory analysis the chip itself recorded (the stage's
"compiled train step" line, the chip's own compiler).

Run: ``.venvs/trainer/bin/python bench/fit_bench.py [CASE ...]`` (cases 1b-none 1b-nf4 1b-int8 3b-none
3b-nf4 8b-nf4; about 3-6 minutes each on 2 busy cores); writes bench/results/fit.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loraflow.models import llama  # noqa: E402
from loraflow.spec import fit as rule  # noqa: E402
from loraflow.spec.step_configs import LoraSftConfig  # noqa: E402
from loraflow.trainer import fit  # noqa: E402

RESULTS = REPO / "bench" / "results"
#: where each size's measurements are (the chip's arrays and its reserved temporaries: module doc)
MEASURED = {"1b": "tpu-memory.json", "3b": "tpu-memory-3b.json", "8b": "tpu-memory-8b.json"}
CASES = ["1b-none", "1b-nf4", "1b-int8", "3b-none", "3b-nf4", "8b-nf4"]


def _sizes() -> dict[str, dict[str, int]]:
    """bench/tpu's model shapes (Llama-3.2-1B, 3B and Llama-3.1-8B's)."""
    spec = importlib.util.spec_from_file_location("tpu_case", REPO / "bench" / "tpu" / "_case.py")
    assert spec is not None and spec.loader is not None
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    return dict(case.SIZES)


def _measured(size: str, quantization: str) -> tuple[dict[str, Any], str]:
    """The chip's run of the case, with its reserved temporaries, and the file it is recorded in."""
    name = MEASURED[size]
    for r in json.loads((RESULTS / name).read_text())["results"]:
        c = r["case"]
        if (
            c.get("kind") == "train"
            and c.get("mode") == "loraflow"
            and (c["size"], c["quantization"]) == (size, quantization)
            and r.get("peak_bytes_reserved") is not None
        ):
            return dict(r), name
    raise SystemExit(f"no measured {size} {quantization} case with its reserved temporaries in {name}")


def predict_case(name: str, sizes: dict[str, dict[str, int]]) -> dict[str, Any]:
    size, quantization = name.split("-")
    measured, source = _measured(size, quantization)
    c = measured["config"]
    cfg = LoraSftConfig(
        model_name="llama3.1-8b",
        model_overrides=llama.maxtext_overrides(sizes[size]),
        rank=c["rank"],
        alpha=c["alpha"],
        batch_size=c["batch_size"],
        max_length=c["max_length"],
        dtype=c["dtype"],
        quantization=c["quantization"],
        tile_size=c["tile_size"],
        steps=c["steps"],
        learning_rate=c["learning_rate"],
    )
    target = rule.slice_of("ct5lp-hightpu-1t", "1x1")
    t = time.perf_counter()
    p = fit.predict(cfg, target, cfg.batch_size / target.chips)
    seconds = time.perf_counter() - t
    arrays, reserved = int(measured["peak_bytes_in_use"]), int(measured["peak_bytes_reserved"])
    peak = arrays + reserved
    s = measured["summary"]
    # the chip's own compile of the same step (the stage's "compiled train step" line): same rule
    chip_rule = s["step_argument_bytes"] + s["step_output_bytes"] - p.step.alias_bytes + s["step_temp_bytes"]
    return {
        "case": name,
        "config": c,
        "measured_peak_bytes": peak,
        "measured": {
            "arrays_peak_bytes": arrays,
            "reserved_peak_bytes": reserved,
            "steps_queued": measured["case"].get("inflight", "Tunix's default (2)"),
            "recorded_in": source,
            "saved_at": json.loads((RESULTS / source).read_text())["saved_at"],
            "on": measured["device"],
        },
        "predicted": {
            "peak_bytes": p.peak_bytes,
            "queued_bytes": p.queued_bytes,
            "setup_bytes": p.setup_bytes,
            "state_bytes": p.state_bytes,
            "step": vars(p.step),
        },
        "error": p.peak_bytes / peak - 1,
        "chip_compiled_step": {
            "argument_bytes": s["step_argument_bytes"],
            "output_bytes": s["step_output_bytes"],
            "temp_bytes": s["step_temp_bytes"],
            "peak_bytes_by_the_rule": chip_rule,
            "error": chip_rule / peak - 1,
        },
        "fits_predicted": rule.fits(p.peak_bytes, target.generation.hbm_bytes),
        "seconds": round(seconds, 1),
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


def main() -> None:
    for key, value in fit.LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    names = sys.argv[1:] or CASES
    out = RESULTS / "fit.json"
    kept = {r["case"]: r for r in json.loads(out.read_text())["results"]} if out.exists() else {}
    sizes = _sizes()
    for name in names:
        kept[name] = predict_case(name, sizes)
        print(json.dumps(kept[name]), flush=True)
        record = {
            "what": "loraflow plan --fit's prediction (this CPU, no chip) against the peaks one v5e chip measured "
            "(its arrays plus its reserved temporaries, the train step donating the model; recorded in "
            "bench/results/tpu-memory*.json, not re-measured)",
            "predicted_with": {p: metadata.version(p) for p in ("jax", "jaxlib", "libtpu", "maxtext", "google-tunix")},
            "cpu": _cpu(),
            "saved_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "results": [kept[c] for c in CASES if c in kept],
        }
        out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
