"""Step program for the report stage: one self-contained HTML page about the run.

Inputs, all given with ``--ref NAME=gs://.../STAGE/_MANIFEST.json`` (verified, not downloaded:
only the few small files the report needs are fetched, never a checkpoint): ``validate_data``
(``data_report.json``), ``convert_checkpoint``, ``evaluate_base`` and ``evaluate_tuned``
(``metrics.json``, ``predictions.jsonl``), ``lora_sft`` (``loss.csv``), ``merge_adapter`` and
``gate`` (``decision.json``). Any of them may be absent. The publish outcome is read from this
run's own ``publish/`` prefix beside the output (publish is never cached, so its manifest lies in
the run when it ran; absent when the gate did not promote).

A run where a stage failed gets a report too (the report task runs whatever happened before it):
stages without a committed output are listed as such, and when validate_data rejected the
dataset its evidence (``validate_data/_rejected/data_report.json`` and the GX data docs beside
it, never an artifact: no manifest, so nothing downstream could use it) says which rules failed
and how to fix them.

Durations and cache hits come from the manifests themselves: each records the seconds its step
program took, and a stage whose manifest lies under another run's prefix was a cache hit in this
run (it is reported as reused from that run). Nothing from Airflow is needed.

Config (``loraflow.spec.step_configs.ReportConfig``)::

    pipeline    the pipeline's name (for the title)
    stages      the stages in pipeline order (the table's rows; default every stage before the report)
    vertex_tracking   the spec's ``tracking.vertex``: once the page is written, the run is logged to
                that Vertex AI experiment (``loraflow.steps._tracking``): lora_sft's config as its
                parameters, the scores and the verdict as its metrics, and the ``tensorboard/`` scalars
                of lora_sft and the evaluations as its time series in the experiment's TensorBoard;
                the summary names the experiment run (``vertex_experiment_run``, ``vertex_experiment_url``)

Writes ``report.html`` (inline CSS, inline SVG plots: opens offline) and ``loss.svg``.
"""

from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path
from typing import Any

from loraflow.errors import ArtifactError, LoraflowError
from loraflow.evaluation import merge_cost
from loraflow.evaluation.metrics import METRICS, Scoring
from loraflow.reporting import report, urls
from loraflow.spec.stages import (
    DATA_REPORT,
    DECISION,
    LOSS_CSV,
    METRICS_JSON,
    PREDICTIONS_JSONL,
    QUANTIZED_ANSWERS,
    REGISTRY_ENTRY,
    REPORT_HTML,
)
from loraflow.spec.step_configs import ReportConfig, parse
from loraflow.steps import _tracking
from loraflow.steps._harness import StepContext, run_and_exit
from loraflow.storage import artifacts, gcs, json_objects
from loraflow.storage.summaries import GateSummary

STAGE = "report"
WANTED = {
    "validate_data": [DATA_REPORT],
    "evaluate_base": [METRICS_JSON, PREDICTIONS_JSONL],
    "evaluate_tuned": [METRICS_JSON, PREDICTIONS_JSONL],
    "lora_sft": [LOSS_CSV, QUANTIZED_ANSWERS],
    "gate": [DECISION],
}
# Per-example lists (the predictions show those) and the settings.
_BULKY_METRICS = {"ids", "config", *(m.column for m in METRICS.values())}


def _read_json(path: Path) -> dict[str, Any] | None:
    return json_objects.read_file_object(path, fix="re-run the stage that wrote it") if path.exists() else None


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_loss(path: Path) -> list[tuple[float, float, float | None]]:
    if not path.exists():
        return []
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            try:
                tps = r.get("tokens_per_s")
                rows.append((float(r["step"]), float(r["loss"]), float(tps) if tps else None))
            except (KeyError, ValueError):
                continue
    return rows


def _small(metrics: dict[str, Any] | None) -> dict[str, Any]:
    small = {k: v for k, v in (metrics or {}).items() if k not in _BULKY_METRICS}
    if isinstance(small.get("guard"), dict):  # the regression guard's per-question lists stay behind too
        small["guard"] = {k: v for k, v in small["guard"].items() if k not in ("ids", "correct")}
    if isinstance(small.get("suites"), dict):  # ... and so do the suites' per-document ones
        small["suites"] = {
            name: {k: v for k, v in entry.items() if k not in ("ids", "values")}
            for name, entry in small["suites"].items()
            if isinstance(entry, dict)
        }
    return small


def collect(ctx: StepContext, cfg: ReportConfig) -> dict[str, Any]:
    """Everything the page shows, as plain data (fetched from the input manifests)."""
    run_prefix = ctx.output_uri.rstrip("/").rsplit("/", 1)[0]
    local = _fetch_wanted(ctx)
    rejected_report = _rejected_report(ctx, run_prefix)
    table = stage_rows(ctx, cfg, run_prefix, rejected_report)
    lora = ctx.input_manifests.get("lora_sft")
    data_report = _read_json(local["validate_data"] / DATA_REPORT) if "validate_data" in local else rejected_report
    docs = _data_docs(ctx, run_prefix, data_report)
    return {
        "pipeline": cfg.pipeline,
        "run_id": run_prefix.rsplit("/", 1)[-1],
        "run_prefix": run_prefix,
        "generated_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "stages": table,
        "loss": _read_loss(local["lora_sft"] / LOSS_CSV) if "lora_sft" in local else [],
        "training_summary": lora.summary if lora is not None else {},
        "base_metrics": _eval_metrics(local, "evaluate_base"),
        "tuned_metrics": _eval_metrics(local, "evaluate_tuned"),
        "decision": _decision(local),
        "data_report": data_report,
        "data_docs": docs,
        "data_docs_url": urls.site_url(docs, os.environ.get("STORAGE_EMULATOR_HOST")) if docs else None,
        "failure": failure(table, rejected_report),
        "samples": report.sample_outputs(
            _predictions(local, "evaluate_base"), _predictions(local, "evaluate_tuned"), column=_gated_column(local)
        ),
        "publish": _publish_entry(ctx, run_prefix),
        "merge_cost": _merge_cost(local),
    }


def _fetch_wanted(ctx: StepContext) -> dict[str, Path]:
    """The few small files the report shows of each stage that committed (WANTED), fetched: stage -> folder."""
    local: dict[str, Path] = {}
    for stage, names in WANTED.items():
        manifest = ctx.input_manifests.get(stage)
        if manifest is None:
            continue
        dest = ctx.work / stage
        artifacts.fetch(manifest, dest, only=[n for n in names if n in manifest.files])
        local[stage] = dest
    return local


def _rejected_report(ctx: StepContext, run_prefix: str) -> dict[str, Any] | None:
    """validate_data's evidence when it rejected the dataset (no committed output, a data report beside it)."""
    if "validate_data" in ctx.input_manifests:
        return None
    return artifacts.read_json(gcs.join(run_prefix, "validate_data", urls.REJECTED, DATA_REPORT))


def stage_rows(
    ctx: StepContext, cfg: ReportConfig, run_prefix: str, rejected_report: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """One row per stage before the report: ran, reused (from which run), rejected, not run or no output."""
    table: list[dict[str, Any]] = []
    for stage in cfg.stages:
        if stage == STAGE:
            continue
        manifest = ctx.input_manifests.get(stage)
        if manifest is None and stage == "publish":
            manifest = _publish_manifest(run_prefix)
        if manifest is None:
            rejected = stage == "validate_data" and rejected_report is not None
            # publish is skipped when the gate does not promote: "not run" is no failure
            status = "rejected" if rejected else "not run" if stage == "publish" else "no output"
            table.append({"stage": stage, "status": status})
            continue
        own = manifest.prefix == gcs.join(run_prefix, stage)
        table.append(
            {
                "stage": stage,
                "status": "ran" if own else "reused",
                "from_run": None if own else manifest.prefix.rsplit("/", 2)[-2],
                "seconds": manifest.summary.get("seconds"),
                "manifest": manifest.uri,
            }
        )
    return table


def _eval_metrics(local: dict[str, Path], stage: str) -> dict[str, Any]:
    return _small(_read_json(local[stage] / METRICS_JSON)) if stage in local else {}


def _predictions(local: dict[str, Path], stage: str) -> list[dict[str, Any]]:
    return _read_jsonl(local[stage] / PREDICTIONS_JSONL) if stage in local else []


def _merge_cost(local: dict[str, Path]) -> dict[str, Any] | None:
    """QLoRA: the trained (quantized base + adapter) model's answers against the merged model's."""
    if "lora_sft" not in local or "evaluate_tuned" not in local:
        return None
    answers = _read_jsonl(local["lora_sft"] / QUANTIZED_ANSWERS)
    metrics = _read_json(local["evaluate_tuned"] / METRICS_JSON) or {}
    if not answers or "config" not in metrics:
        return None
    settings = Scoring.recorded(metrics["config"], "evaluate_tuned's metrics.json")
    return merge_cost.compare(answers, _predictions(local, "evaluate_tuned"), settings)


def _decision(local: dict[str, Path]) -> dict[str, Any] | None:
    """The gate's decision.json without the evaluations' metrics (the report shows those itself); one
    that is not a gate summary loraflow wrote is refused (``SummaryError``), as publish refuses it."""
    path = local["gate"] / DECISION if "gate" in local else None
    decision = _read_json(path) if path else None
    if not decision:
        return decision
    GateSummary.from_object(decision, str(path))
    return {k: v for k, v in decision.items() if k not in ("base_metrics", "tuned_metrics")}


def _gated_column(local: dict[str, Path]) -> str:
    """The per-example column of the metric the gate compared (the samples are fixed or broken by it);
    accuracy's when there is no decision."""
    metric = (_decision(local) or {}).get("metric")
    return METRICS[metric].column if metric in METRICS else METRICS["accuracy"].column


def _data_docs(ctx: StepContext, run_prefix: str, data_report: dict[str, Any] | None) -> str | None:
    """Where GX's data docs lie: beside the committed dataset, or beside the rejected one's evidence."""
    if not (data_report and data_report.get("data_docs")):
        return None
    data_manifest = ctx.input_manifests.get("validate_data")
    if data_manifest is not None:
        return urls.data_docs_uri(data_manifest.prefix)
    return urls.data_docs_uri(gcs.join(run_prefix, "validate_data"), rejected=True)


def _publish_entry(ctx: StepContext, run_prefix: str) -> dict[str, Any] | None:
    """This run's publish outcome (its registry_entry.json), when publish ran."""
    published = _publish_manifest(run_prefix)
    if published is None:
        return None
    artifacts.fetch(published, ctx.work / "publish", only=[REGISTRY_ENTRY])
    result: dict[str, Any] | None = _read_json(ctx.work / "publish" / REGISTRY_ENTRY)
    return result


def failure(table: list[dict[str, Any]], rejected_report: dict[str, Any] | None) -> dict[str, Any] | None:
    """What stopped the run, if something did: the rejected dataset's failed rules, or the stages
    that left no output (failed, or never started because an earlier stage failed)."""
    if rejected_report is not None:
        problems = rejected_report.get("failures") or rejected_report.get("load_problems") or []
        rules = rejected_report.get("failed_rules") or []
        reason = (
            f"the data contract is broken: {len(rules)} rule(s) failed ({', '.join(rules)})"
            if rules
            else "the dataset cannot be read"
        )
        return {"stage": "validate_data", "reason": reason, "rules": rules, "problems": problems}
    missing = [s["stage"] for s in table if s["status"] == "no output"]
    if missing:
        return {
            "stage": missing[0],
            "reason": f"no committed output from {', '.join(missing)}: the first failed, the others could not run "
            "after it (the task logs say why)",
            "rules": [],
            "problems": [],
        }
    return None


def _publish_manifest(run_prefix: str) -> artifacts.Manifest | None:
    prefix = gcs.join(run_prefix, "publish")
    if artifacts.read_json(artifacts.manifest_uri(prefix)) is None:
        return None
    try:
        return artifacts.read_manifest(prefix)
    except ArtifactError as exc:
        raise LoraflowError(f"{STAGE}: the publish artifact of this run is damaged: {exc}") from None


def run(ctx: StepContext) -> dict[str, Any]:
    cfg = parse(ReportConfig, ctx.config)
    data = collect(ctx, cfg)
    (ctx.out / REPORT_HTML).write_text(report.render(data), encoding="utf-8")
    (ctx.out / "loss.svg").write_text(report.loss_svg(data["loss"]), encoding="utf-8")
    # tracking.vertex: the run in Vertex AI Experiments (an error fails the task; its retry resumes the run)
    logged = _tracking.log_run(ctx, cfg.vertex_tracking, data) if cfg.vertex_tracking is not None else {}
    hits = [s["stage"] for s in data["stages"] if s["status"] == "reused"]
    ctx.progress(f"{REPORT_HTML} written ({len(data['stages'])} stages, {len(hits)} cache hit(s))")
    failed = data["failure"]
    if failed:
        ctx.progress(f"the run failed at {failed['stage']}: {failed['reason']}")
    cost = data["merge_cost"]
    if cost:
        ctx.progress(
            f"QLoRA, what merging cost on {cost['n']} examples (trained -> merged): "
            + ", ".join(f"{r['metric']} {r['quantized']:.3f} -> {r['merged']:.3f}" for r in cost["metrics"])
        )
    return {
        "report": gcs.join(ctx.output_uri, REPORT_HTML),
        "promote": data["decision"]["promote"] if data["decision"] else None,  # checked by _decision
        "cache_hits": hits,
        "failed_stage": failed["stage"] if failed else None,
        "merge_cost": cost,
        **logged,
    }


if __name__ == "__main__":
    run_and_exit(STAGE, run)
