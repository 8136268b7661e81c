"""The report task's Vertex AI Experiments run (the spec's ``tracking.vertex``): what it logs, gathered
from the run's committed artifacts; :mod:`loraflow.reporting.vertex_tracking` logs it."""

from __future__ import annotations

from typing import Any

from loraflow.errors import LoraflowError
from loraflow.evaluation.metrics import METRICS
from loraflow.reporting import vertex_tracking
from loraflow.reporting.curves import TENSORBOARD, read_scalars
from loraflow.spec.schema import VertexTrackingSpec
from loraflow.steps._harness import StepContext
from loraflow.storage import artifacts
from loraflow.storage.summaries import GateSummary

CURVE_STAGES = ("lora_sft", "evaluate_base", "evaluate_tuned")
MAX_EVENT_BYTES = 64 << 20  # a stage's event files, at most (200 steps of lora_sft: ~40 KB)


def log_run(ctx: StepContext, settings: VertexTrackingSpec, data: dict[str, Any]) -> dict[str, str]:
    """Log the run (its training parameters, the evaluations' metrics and the gate's verdict, the curves);
    the report's summary fields naming the experiment run."""
    lora = ctx.input_manifests.get("lora_sft")
    params = training_params(lora.data.get("config", {}) if lora is not None else {})
    curves = stage_curves(ctx)
    logged = vertex_tracking.log_run(settings, data["run_id"], params, run_metrics(data), curves)
    ctx.progress(f"logged to Vertex AI experiment {settings.experiment} as run {logged.name}: {logged.url}")
    return {"vertex_experiment_run": logged.name, "vertex_experiment_url": logged.url}


def training_params(config: dict[str, Any]) -> dict[str, float | int | str]:
    """lora_sft's resolved config as Experiments parameters: numbers and text as they are, other values as text."""
    return {
        key: value if isinstance(value, int | float | str) and not isinstance(value, bool) else str(value)
        for key, value in sorted(config.items())
        if value is not None
    }


def run_metrics(data: dict[str, Any]) -> dict[str, float]:
    """The evaluations' scores (``base_<metric>``, ``tuned_<metric>``, with the guard's accuracy), the
    training's first and final loss and the gate's verdict (``promoted`` 1 or 0)."""
    metrics: dict[str, float] = {}
    for side in ("base", "tuned"):
        scores = data[f"{side}_metrics"]
        for name in [*METRICS, "n"]:
            if isinstance(scores.get(name), int | float):
                metrics[f"{side}_{name}"] = float(scores[name])
        if isinstance(scores.get("guard"), dict):
            metrics[f"{side}_guard_accuracy"] = float(scores["guard"]["accuracy"])
    for key in ("first_loss", "final_loss"):
        if isinstance(data["training_summary"].get(key), int | float):
            metrics[key] = float(data["training_summary"][key])
    if data["decision"]:  # decision.json, as the report read it (already refused if loraflow did not write it)
        verdict = GateSummary.from_object(data["decision"], "the gate's decision.json")
        metrics["promoted"] = 1.0 if verdict.promote else 0.0
    return metrics


def stage_curves(ctx: StepContext) -> dict[str, dict[int, float]]:
    """Every scalar of lora_sft's and the evaluations' committed ``tensorboard/`` (tags do not overlap
    between them; the evaluations write theirs at different steps)."""
    curves: dict[str, dict[int, float]] = {}
    for stage in CURVE_STAGES:
        manifest = ctx.input_manifests.get(stage)
        if manifest is None:
            continue
        events = [n for n in manifest.files if n.startswith(TENSORBOARD + "/")]
        size = sum(manifest.files[n]["size"] for n in events)
        if size > MAX_EVENT_BYTES:
            raise LoraflowError(
                f"{stage}'s {TENSORBOARD}/ holds {size} bytes, over the {MAX_EVENT_BYTES} the report reads for "
                "Vertex AI Experiments; point TensorBoard at it instead (docs/operations.md)"
            )
        local = artifacts.fetch(manifest, ctx.work / f"curves-{stage}", only=events)
        for tag, points in read_scalars(local / TENSORBOARD).items():
            curves.setdefault(tag, {}).update(points)
    return curves
