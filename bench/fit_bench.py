"""Will it fit? `loraflow plan --fit`'s prediction against the peaks a TPU v5e chip measured.

Predicts, on this CPU (no chip), each configuration bench/tpu measured on one v5e chip: the 1.5 B model
with LoRA, nf4 and int8, the 3.6 B with LoRA and nf4 and the 8B with nf4: the same model shapes, 8 rows of
1,024 tokens, rank 16, tile 64, bf16. The chip's memory in use is its arrays (``peak_bytes_in_use``) plus
what it reserves for the loaded programs' temporaries (``peak_bytes_reserved``), and that sum is what is
compared: recorded with the train step donating the model (loraflow.trainer.donation) in
``bench/results/tpu-memory.json`` (the 1.5 B cases: bench/tpu's ``memory`` phase), ``tpu-memory-3b.json``
and ``tpu-memory-8b.json`` (the loraflow cases of its ``3b`` and ``8b-qlora`` phases, run the same day on
the same machine, renamed). Recorded measurements, not re-measured here; the chip ran the trainer env's own
JAX and libtpu, carried to it by bench/tpu/carry_env.sh, the versions this prediction runs in (each record
names them). Beside
it, the same rule applied to the compiled step's memory analysis the chip itself recorded (the stage's
"compiled train step" line, the chip's own compiler).

Run: ``.venvs/trainer/bin/python bench/fit_bench.py [CASE ...]`` (cases 1b-none 1b-nf4 1b-int8 3b-none
3b-nf4 8b-nf4; about 3-9 minutes each on 2 busy cores); writes bench/results/fit.json. After the chip has
measured again: ``bench/fit_bench.py --recorded`` compares fit.json's predictions with the new records without
compiling (seconds), refused when the installed JAX, libtpu, MaxText or Tunix differ from the predictions' or the
chip ran another config.
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
    """Compiles the case's step from shapes here (minutes) and compares the prediction with the chip."""
    size, quantization = name.split("-")
    measured, _ = _measured(size, quantization)
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
    predicted = {
        "peak_bytes": p.peak_bytes,
        "queued_bytes": p.queued_bytes,
        "setup_bytes": p.setup_bytes,
        "state_bytes": p.state_bytes,
        "step": vars(p.step),
    }
    return {
        **compare(name, predicted),
        "fits_predicted": rule.fits(p.peak_bytes, target.generation.hbm_bytes),
        "seconds": round(seconds, 1),
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def compare(name: str, predicted: dict[str, Any]) -> dict[str, Any]:
    """The prediction against the chip's measured peak (arrays + reserved) for the case ``name``."""
    size, quantization = name.split("-")
    measured, source = _measured(size, quantization)
    arrays, reserved = int(measured["peak_bytes_in_use"]), int(measured["peak_bytes_reserved"])
    peak = arrays + reserved
    s = measured["summary"]
    # the chip's own compile of the same step (the stage's "compiled train step" line): same rule
    chip_rule = (
        s["step_argument_bytes"] + s["step_output_bytes"] - predicted["step"]["alias_bytes"] + s["step_temp_bytes"]
    )
    return {
        "case": name,
        "config": measured["config"],
        "measured_peak_bytes": peak,
        "measured": {
            "arrays_peak_bytes": arrays,
            "reserved_peak_bytes": reserved,
            "steps_queued": measured["case"].get("inflight", "Tunix's default (2)"),
            "recorded_in": source,
            "saved_at": json.loads((RESULTS / source).read_text())["saved_at"],
            "on": measured["device"],
        },
        "predicted": predicted,
        "error": predicted["peak_bytes"] / peak - 1,
        "chip_compiled_step": {
            "argument_bytes": s["step_argument_bytes"],
            "output_bytes": s["step_output_bytes"],
            "temp_bytes": s["step_temp_bytes"],
            "peak_bytes_by_the_rule": chip_rule,
            "error": chip_rule / peak - 1,
        },
    }


def recompare(kept: dict[str, Any], predicted_with: dict[str, str]) -> None:
    """``--recorded``: the predictions already in fit.json against the chip's records as they are now, with no
    compile. Refused unless fit.json's predictions came from the versions installed here and the same config."""
    if kept.get("predicted_with") != predicted_with:
        raise SystemExit(
            f"--recorded: fit.json's predictions were made with {kept.get('predicted_with')}, this environment "
            f"has {predicted_with}: run without --recorded to predict again"
        )
    for name, old in kept["results"].items():
        new = compare(name, old["predicted"])
        if new["config"] != old["config"]:
            raise SystemExit(f"--recorded: the chip measured {name} with another config: run without --recorded")
        old.update(new)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return "unknown"


def main() -> None:
    for key, value in fit.LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    args = sys.argv[1:]
    recorded = "--recorded" in args
    names = [a for a in args if a != "--recorded"] or CASES
    out = RESULTS / "fit.json"
    previous = json.loads(out.read_text()) if out.exists() else {"results": []}
    kept = {r["case"]: r for r in previous["results"]}
    versions = {p: metadata.version(p) for p in ("jax", "jaxlib", "libtpu", "maxtext", "google-tunix")}
    if recorded:
        recompare({"predicted_with": previous.get("predicted_with"), "results": kept}, versions)
    sizes = _sizes()
    for name in [] if recorded else names:
        kept[name] = predict_case(name, sizes)
        print(json.dumps(kept[name]), flush=True)
        _write(out, kept, versions)
    if recorded:
        _write(out, kept, versions, saved_at=previous["saved_at"], cpu=previous["cpu"])
        for r in kept.values():
            print(
                f"{r['case']}: predicted {r['predicted']['peak_bytes'] / 2**30:.2f} GiB, chip "
                f"{r['measured_peak_bytes'] / 2**30:.2f} GiB, error {r['error']:+.1%}"
            )


def _write(out: Path, kept: dict[str, Any], versions: dict[str, str], saved_at: str = "", cpu: str = "") -> None:
    record = {
        "what": "loraflow plan --fit's prediction (this CPU, no chip) against the peaks one v5e chip measured "
        "(its arrays plus its reserved temporaries, the train step donating the model; recorded in "
        "bench/results/tpu-memory*.json, not re-measured)",
        "predicted_with": versions,
        "cpu": cpu or _cpu(),
        "saved_at": saved_at or time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "compared_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "results": [kept[c] for c in CASES if c in kept],
    }
    out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
