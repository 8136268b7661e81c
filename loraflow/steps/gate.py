"""Step program for the gate stage: decide, with evidence, whether the tuned model is promoted.

Inputs (local directories from the evaluate stages): ``base_eval`` and ``tuned_eval``, each with
``metrics.json`` ({"accuracy", "format_rate", "n"}) and ``predictions.parquet`` (columns id,
correct, format_ok, answer, reference, generation; ``predictions.jsonl`` is read when the
Parquet file is absent).

Config (every key optional)::

    metric: accuracy            accuracy (column correct) or format_rate (column format_ok)
    min_improvement: 0.3        smallest absolute gain worth promoting
    confidence: 0.95            level of the paired bootstrap interval of the gain
    bootstrap_samples: 2000
    seed: 0

The rule itself lives in loraflow.gate_rule.decide (promote iff the gain >= min_improvement and
the interval's lower bound > 0). Writes ``decision.json`` with the evidence. Not promoting is a
result, not a failure: the step succeeds either way; only evaluations that cannot be compared
(different ids, missing files) fail it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.gate_rule import GateError, decide
from loraflow.steps._harness import StepContext, run_step

STAGE = "gate"
DEFAULTS: dict[str, Any] = {
    "metric": "accuracy",
    "min_improvement": 0.3,
    "confidence": 0.95,
    "bootstrap_samples": 2000,
    "seed": 0,
}
METRIC_COLUMNS = {"accuracy": "correct", "format_rate": "format_ok"}


def resolve_config(raw: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise LoraflowError(f"{STAGE}: unknown config key(s) {', '.join(unknown)}; known: {', '.join(DEFAULTS)}")
    cfg = {**DEFAULTS, **raw}
    if cfg["metric"] not in METRIC_COLUMNS:
        raise LoraflowError(f"{STAGE}: metric {cfg['metric']!r} is not one of {', '.join(METRIC_COLUMNS)}")
    return cfg


def load_eval(directory: Path, name: str, metric: str) -> tuple[dict[str, bool], dict[str, Any], Any]:
    """(id -> outcome, metrics.json, the predictions frame) of one evaluation."""
    import pandas as pd

    metrics_path = directory / "metrics.json"
    if not metrics_path.exists():
        raise GateError(f"{name}: metrics.json is missing from the evaluation artifact; re-run its evaluate stage")
    metrics = json.loads(metrics_path.read_text())
    if (directory / "predictions.parquet").exists():
        frame = pd.read_parquet(directory / "predictions.parquet")
    elif (directory / "predictions.jsonl").exists():  # evaluate writes only JSONL where pyarrow is absent
        frame = pd.read_json(directory / "predictions.jsonl", lines=True, dtype={"id": str})
    else:
        raise GateError(
            f"{name}: predictions.parquet is missing from the evaluation artifact; re-run its evaluate stage"
        )
    column = METRIC_COLUMNS[metric]
    missing = [c for c in ("id", column) if c not in frame.columns]
    if missing:
        raise GateError(
            f"{name}: predictions.parquet lacks column(s) {', '.join(missing)} (has {', '.join(frame.columns)})"
        )
    ids = frame["id"].astype(str)
    dupes = sorted(set(ids[ids.duplicated()]))
    if dupes:
        raise GateError(
            f"{name}: predictions.parquet lists {len(dupes)} id(s) twice (e.g. {dupes[:3]}); one row per example"
        )
    if frame[column].isna().any():
        raise GateError(f"{name}: {int(frame[column].isna().sum())} rows have no value in {column!r}")
    return dict(zip(ids, frame[column].astype(bool), strict=True)), metrics, frame


def run(ctx: StepContext) -> dict[str, Any]:
    cfg = resolve_config(dict(ctx.config))
    metric = cfg["metric"]
    for name in ("base_eval", "tuned_eval"):
        if name not in ctx.inputs:
            raise LoraflowError(f"{STAGE}: input {name!r} is missing; give --input {name}=gs://.../_MANIFEST.json")
    base, base_metrics, base_frame = load_eval(ctx.inputs["base_eval"], "base_eval", metric)
    tuned, tuned_metrics, tuned_frame = load_eval(ctx.inputs["tuned_eval"], "tuned_eval", metric)
    ctx.progress(f"base: {len(base)} predictions, tuned: {len(tuned)} predictions; comparing {metric}")

    decision = decide(
        base,
        tuned,
        metric=metric,
        min_improvement=float(cfg["min_improvement"]),
        confidence=float(cfg["confidence"]),
        bootstrap_samples=int(cfg["bootstrap_samples"]),
        seed=int(cfg["seed"]),
    )

    notes = []
    for name, metrics, value in (("base", base_metrics, decision.base), ("tuned", tuned_metrics, decision.tuned)):
        reported = metrics.get(metric)
        if reported is not None and abs(float(reported) - value) > 1e-9:
            notes.append(
                f"{name} metrics.json says {metric}={reported}, its predictions give {value:.6f}; the predictions are used"
            )
    identical = None
    if "generation" in base_frame.columns and "generation" in tuned_frame.columns:
        joined = (
            base_frame[["id", "generation"]]
            .astype({"id": str})
            .merge(tuned_frame[["id", "generation"]].astype({"id": str}), on="id", suffixes=("_base", "_tuned"))
        )
        identical = int((joined["generation_base"] == joined["generation_tuned"]).sum())
        if identical == len(joined):
            notes.append(
                "the tuned model generated exactly what the base model did on every example: the adapter changed nothing"
            )
    for note in notes:
        ctx.progress(f"note: {note}")

    evidence = {
        **decision.as_dict(),
        "base_metrics": base_metrics,
        "tuned_metrics": tuned_metrics,
        "identical_generations": identical,
        "notes": notes,
        "rule": "promote iff delta >= min_improvement and the lower bound of the paired bootstrap interval > 0",
    }
    (ctx.out / "decision.json").write_text(json.dumps(evidence, indent=2, sort_keys=True))
    ctx.progress(("PROMOTE: " if decision.promote else "do not promote: ") + decision.reason)
    return {
        "promote": decision.promote,
        "base": round(decision.base, 6),
        "tuned": round(decision.tuned, 6),
        "delta": round(decision.delta, 6),
        "ci": [round(x, 6) for x in decision.ci],
        "reason": decision.reason,
    }


if __name__ == "__main__":
    raise SystemExit(run_step(STAGE, run))
