"""Step program for the gate stage: decide, with evidence, whether the tuned model is promoted.

Inputs (local directories from the evaluate stages): ``base_eval`` and ``tuned_eval``, each with
``metrics.json`` (every metric of loraflow/evaluation/metrics.py, and n) and ``predictions.parquet``
(columns id, answer, reference, generation and each metric's per-example column: correct,
format_ok, ...; ``predictions.jsonl`` is read when the Parquet file is absent). The gate reads the
column of the spec's ``gate.metric``.

Config (``loraflow.spec.step_configs.GateConfig``; every key optional, defaults the spec's ``gate``)::

    metric, min_improvement, confidence, bootstrap_samples   the spec's gate section
    registry_uri: gs://.../_registry   with pipeline: where this pipeline's champion is registered
    pipeline: NAME                     (both or neither; publish registers promoted models there)
    artifact_root                      where the champion's model must lie
    seed: 0                            internal: the bootstrap's seed

The rule itself lives in loraflow.evaluation.gate_rule.decide (promote iff the gain >= min_improvement and
the interval's lower bound > 0). When the registry holds a ``champion`` for this pipeline, the
tuned model must also beat the champion's recorded eval metric (and not be the champion itself);
the champion compared against is recorded in the decision. Because the champion moves between runs
with no input changing, the gate is not cached (its plan says ``cacheable=False``).

Writes ``decision.json`` with the evidence. Not promoting is a result, not a failure: the step
succeeds either way. It fails on evaluations that cannot be compared (different ids, missing
files), and, loudly, when the tuned model generated exactly what the base model did on every eval
example: an adapter that did nothing is a broken training run, never a quiet "not promoted".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.evaluation.gate_rule import Decision, GateError, decide
from loraflow.evaluation.metrics import METRICS, Metric
from loraflow.registry import store as registry
from loraflow.spec.step_configs import GateConfig, parse
from loraflow.steps._harness import StepContext, exit_process, run_step

STAGE = "gate"
RULE = (
    "promote iff delta >= min_improvement and the lower bound of the paired bootstrap interval > 0, "
    "and, when a champion is registered, the tuned metric beats the champion's"
)


def resolve_config(raw: dict[str, Any]) -> GateConfig:
    cfg = parse(GateConfig, raw)
    if bool(cfg.registry_uri) != bool(cfg.pipeline):
        raise LoraflowError(
            f"{STAGE}: give registry_uri and pipeline together (to compare with the champion), or neither"
        )
    return cfg


class NoOpAdapterError(LoraflowError):
    """The tuned model behaves exactly like the base model: the adapter did nothing."""


def _input_fingerprint(ctx: StepContext, stage_input: str, name: str) -> str | None:
    """The fingerprint of input ``name`` of the evaluation given as ``stage_input`` (from its manifest)."""
    manifest = ctx.input_manifests.get(stage_input)
    if manifest is None:
        return None
    value = manifest.data.get("inputs", {}).get(name, {}).get("fingerprint")
    return str(value) if value else None


def against_champion(
    decision: Decision, champion: dict[str, Any] | None, model_fingerprint: str | None, eval_fingerprint: str | None
) -> tuple[Decision, dict[str, Any] | None, list[str]]:
    """The decision once the registry's current champion is taken into account.

    Returns (decision, what was compared - recorded in decision.json -, notes). Promotion needs the
    tuned model to beat the champion's recorded metric strictly; the champion itself (same model
    fingerprint) is never promoted again; a champion without a recorded metric blocks promotion.
    """
    if champion is None:
        return decision, None, []
    metric = decision.metric
    value = registry.recorded_metric(champion, metric)
    record: dict[str, Any] = {
        "version": champion.get("version"),
        "version_uri": champion.get("version_uri"),
        "run_id": champion.get("run_id"),
        "model_fingerprint": champion.get("model_fingerprint"),
        "metric": metric,
        "value": value,
    }
    notes = []
    champ_eval = champion.get("eval_set_fingerprint")
    if champ_eval and eval_fingerprint and champ_eval != eval_fingerprint:
        notes.append(
            f"the champion (version {record['version']}) was evaluated on another eval set; its {metric} is "
            "compared as recorded"
        )
    who = f"the champion (version {record['version']}, run {record['run_id']})"
    if model_fingerprint and model_fingerprint == champion.get("model_fingerprint"):
        verdict, beats = f"the tuned model is {who} itself", False
    elif value is None:
        verdict, beats = f"{who} records no {metric}, so it cannot be compared", False
    elif decision.tuned > value if METRICS[metric].higher_is_better else decision.tuned < value:
        verdict, beats = f"{metric} {decision.tuned:.3f} beats {who}: {value:.3f}", True
    else:
        verdict, beats = f"{metric} {decision.tuned:.3f} does not beat {who}: {value:.3f}", False
    record["verdict"] = verdict
    record["beaten"] = beats
    if not decision.promote:
        return dataclasses.replace(decision, reason=f"{decision.reason} ({verdict})"), record, notes
    if beats:
        return dataclasses.replace(decision, reason=f"{decision.reason}; {verdict}"), record, notes
    reason = f"{decision.reason}; but {verdict}: not promoted"
    return dataclasses.replace(decision, promote=False, reason=reason), record, notes


def load_eval(directory: Path, name: str, metric: str) -> tuple[dict[str, bool], dict[str, Any], Any]:
    """(id -> outcome, metrics.json, the predictions frame) of one evaluation: the outcome is ``metric``'s
    per-example column."""
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
    column = METRICS[metric].column
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
    metric = METRICS[cfg.metric]
    for name in ("base_eval", "tuned_eval"):
        if name not in ctx.inputs:
            raise LoraflowError(f"{STAGE}: input {name!r} is missing; give --input {name}=gs://.../_MANIFEST.json")
    base, base_metrics, base_frame = load_eval(ctx.inputs["base_eval"], "base_eval", metric.name)
    tuned, tuned_metrics, tuned_frame = load_eval(ctx.inputs["tuned_eval"], "tuned_eval", metric.name)
    ctx.progress(f"base: {len(base)} predictions, tuned: {len(tuned)} predictions; comparing {metric.name}")
    decision = _decide(cfg, metric, base, tuned)
    notes = reported_differently(decision, base_metrics, tuned_metrics)
    identical = identical_generations(base_frame, tuned_frame)
    decision, compared, champion_notes = _against_registry(ctx, cfg, decision)
    notes += champion_notes
    ctx.progress(
        f"champion: {compared['verdict']}" if compared else "champion: none registered yet; compared with the base only"
    )
    for note in notes:
        ctx.progress(f"note: {note}")
    evidence = {
        **decision.as_dict(),
        "base_metrics": base_metrics,
        "tuned_metrics": tuned_metrics,
        "identical_generations": identical,
        "champion": compared,
        "tuned_model_fingerprint": _input_fingerprint(ctx, "tuned_eval", "model"),
        "eval_set_fingerprint": _input_fingerprint(ctx, "tuned_eval", "eval_set"),
        "notes": notes,
        "rule": RULE,
    }
    (ctx.out / "decision.json").write_text(json.dumps(evidence, indent=2, sort_keys=True))
    ctx.progress(("PROMOTE: " if decision.promote else "do not promote: ") + decision.reason)
    return summary(decision, compared)


def _decide(cfg: GateConfig, metric: Metric, base: dict[str, bool], tuned: dict[str, bool]) -> Decision:
    return decide(
        base,
        tuned,
        metric=metric.name,
        min_improvement=cfg.min_improvement,
        confidence=cfg.confidence,
        bootstrap_samples=cfg.bootstrap_samples,
        seed=cfg.seed,
        higher_is_better=metric.higher_is_better,
    )


def reported_differently(decision: Decision, base_metrics: dict[str, Any], tuned_metrics: dict[str, Any]) -> list[str]:
    """Notes on an evaluation whose metrics.json disagrees with its predictions (which the gate uses)."""
    notes = []
    metric = decision.metric
    for name, metrics, value in (("base", base_metrics, decision.base), ("tuned", tuned_metrics, decision.tuned)):
        reported = metrics.get(metric)
        if reported is not None and abs(float(reported) - value) > 1e-9:
            notes.append(
                f"{name} metrics.json says {metric}={reported}, its predictions give {value:.6f}; the predictions are used"
            )
    return notes


def identical_generations(base_frame: Any, tuned_frame: Any) -> int | None:
    """How many examples the two models answered with the same generation (None: no generations);
    NoOpAdapterError when that is every one."""
    if "generation" not in base_frame.columns or "generation" not in tuned_frame.columns:
        return None
    joined = (
        base_frame[["id", "generation"]]
        .astype({"id": str})
        .merge(tuned_frame[["id", "generation"]].astype({"id": str}), on="id", suffixes=("_base", "_tuned"))
    )
    identical = int((joined["generation_base"] == joined["generation_tuned"]).sum())
    if len(joined) and identical == len(joined):
        raise NoOpAdapterError(
            f"the adapter did nothing: the tuned model generated exactly what the base model did on all "
            f"{identical} eval examples, so it is not promoted and this run fails rather than passing quietly. "
            "Check lora_sft: its loss curve (loss.csv) and lora_b_norm, the learning rate "
            "(training.learning_rate), the number of steps (training.steps), the LoRA targets "
            "(lora.target_modules) and rank/alpha; and merge_adapter's summary (how many tensors changed)"
        )
    return identical


def _against_registry(
    ctx: StepContext, cfg: GateConfig, decision: Decision
) -> tuple[Decision, dict[str, Any] | None, list[str]]:
    """``against_champion`` with the registry's champion of this pipeline, if any."""
    champion = None
    if cfg.registry_uri:
        champion = registry.champion(cfg.registry_uri, str(cfg.pipeline), cfg.artifact_root)
    model_fp = _input_fingerprint(ctx, "tuned_eval", "model")
    eval_fp = _input_fingerprint(ctx, "tuned_eval", "eval_set")
    return against_champion(decision, champion, model_fp, eval_fp)


def summary(decision: Decision, compared: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest's summary (and the XCom the publish task reads)."""
    return {
        "promote": decision.promote,
        "metric": decision.metric,  # what base, tuned and delta measure
        "base": round(decision.base, 6),
        "tuned": round(decision.tuned, 6),
        "delta": round(decision.delta, 6),
        "ci": [round(x, 6) for x in decision.ci],
        "reason": decision.reason,
        "champion_version": compared["version"] if compared else None,
    }


if __name__ == "__main__":
    exit_process(run_step(STAGE, run))
