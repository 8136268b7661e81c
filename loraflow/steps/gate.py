"""Step program for the gate stage: decide, with evidence, whether the tuned model is promoted.

Inputs (local directories from the evaluate stages): ``base_eval`` and ``tuned_eval``, each with
``metrics.json`` (every metric of loraflow/evaluation/metrics.py, and n) and ``predictions.parquet``
(columns id, answer, reference, generation and each metric's per-example column: correct,
format_ok, ...; ``predictions.jsonl`` is read when the Parquet file is absent). The gate reads the
column of the spec's ``gate.metric``.

Config (``loraflow.spec.step_configs.GateConfig``; every key optional, defaults the spec's ``gate``)::

    metric, min_improvement, confidence, bootstrap_samples, guard   the spec's gate section
    registry_uri: gs://.../_registry   with pipeline: where this pipeline's champion is registered
    pipeline: NAME                     (both or neither; publish registers promoted models there)
    artifact_root                      where the champion's model and evaluation must lie (required
                                       with registry_uri)
    seed: 0                            internal: the bootstrap's seed

The whole rule lives in the pure loraflow.evaluation.gate_rule (``gate_rule.RULE``); this program reads
what it decides on and hands it over. ``decide``: promote iff the gain >= min_improvement and the
interval's lower bound > 0. With ``guard`` (the spec's ``gate.guard``), both evaluations' guard sets
(``guard_predictions.jsonl``, the same set by name and sha256) go through ``guard_check``, or with
``guard.suite`` both evaluations' scores of that suite (metrics.json ``suites``) through
``suite_guard_check``, and then ``with_guard``: a failed guard refuses promotion, its reason saying by how much. When the registry holds a
``champion`` for this pipeline, ``against_champion``: the tuned model must also beat the champion's metric
(and not be the champion itself). The champion is verified by ``loraflow.registry.store.champion`` (its
model a committed merge_adapter of this pipeline, its committed evaluate_tuned of that model) and its
metric is measured here from that evaluation's predictions, each file checked against the manifest, then
handed to the rule as a ``gate_rule.Champion``: what its registry version records is only noted, never
compared (a bucket writer's -1 would let any model replace it). A champion that cannot be verified fails
the step, naming it and the repair. The champion compared against is recorded in the decision. Because
the champion moves between runs with no input changing, the gate is not cached (its plan says
``cacheable=False``).

Writes ``decision.json`` with the evidence. Not promoting is a result, not a failure: the step
succeeds either way. It fails on evaluations that cannot be compared (different ids, missing
files), and, loudly, when the tuned model generated exactly what the base model did on every eval
example: an adapter that did nothing is a broken training run, never a quiet "not promoted".
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.evaluation import gate_rule
from loraflow.evaluation import guard as guard_sets
from loraflow.evaluation.gate_rule import Champion, ChampionComparison, Decision, GateError, GuardCheck
from loraflow.evaluation.metrics import METRICS, Metric
from loraflow.registry import store as registry
from loraflow.spec.stages import DECISION, METRICS_JSON, PREDICTIONS_JSONL, PREDICTIONS_PARQUET
from loraflow.spec.step_configs import GateConfig, parse
from loraflow.steps._harness import StepContext, run_and_exit
from loraflow.storage import json_objects

STAGE = "gate"


def resolve_config(raw: dict[str, Any]) -> GateConfig:
    cfg = parse(GateConfig, raw)
    if bool(cfg.registry_uri) != bool(cfg.pipeline):
        raise LoraflowError(
            f"{STAGE}: give registry_uri and pipeline together (to compare with the champion), or neither"
        )
    if cfg.registry_uri and not cfg.artifact_root:
        raise LoraflowError(
            f"{STAGE}: give artifact_root with registry_uri: the champion's model and evaluation are trusted "
            "only as commits under it (the planner passes the spec's artifact_root)"
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


def champion_figure(champion: dict[str, Any], metric: str, work: Path) -> float | None:
    """``metric`` of the champion measured from its committed evaluation: the mean of the metric's
    per-example column in its predictions, fetched and checked against the evaluation's manifest (as the
    gate measures the tuned model). None when the evaluation has no such column."""
    from loraflow.storage import artifacts

    def refused(problem: str) -> LoraflowError:
        return registry.refused(champion["alias_uri"], problem, champion.get("version"), champion.get("version_uri"))

    uri = str(champion["evaluation_manifest"])
    try:
        manifest = artifacts.read_manifest(uri)
        names = [n for n in (PREDICTIONS_PARQUET, PREDICTIONS_JSONL) if n in manifest.files][:1]
        if not names:
            raise GateError(f"{uri} lists no {PREDICTIONS_PARQUET} or {PREDICTIONS_JSONL}")
        dest = work / "champion_eval"
        shutil.rmtree(dest, ignore_errors=True)
        artifacts.fetch(manifest, dest, only=names)
        frame = _predictions(dest, "the champion's evaluation")
        if METRICS[metric].column not in frame.columns:
            return None
        outcomes = _outcomes(frame, "the champion's evaluation", metric)
    except (LoraflowError, ValueError) as exc:
        raise refused(f"its evaluation cannot be measured: {exc}") from None
    return sum(outcomes.values()) / len(outcomes) if outcomes else None


def load_eval(directory: Path, name: str, metric: str) -> tuple[dict[str, bool], dict[str, Any], Any]:
    """(id -> outcome, metrics.json, the predictions frame) of one evaluation: the outcome is ``metric``'s
    per-example column."""
    metrics_path = directory / METRICS_JSON
    if not metrics_path.exists():
        raise GateError(f"{name}: {METRICS_JSON} is missing from the evaluation artifact; re-run its evaluate stage")
    metrics = json_objects.read_file_object(metrics_path, fix=f"{name}: re-run its evaluate stage")
    frame = _predictions(directory, name)
    return _outcomes(frame, name, metric), metrics, frame


def _predictions(directory: Path, name: str) -> Any:
    """An evaluation's predictions frame (Parquet, else JSONL)."""
    import pandas as pd

    if (directory / PREDICTIONS_PARQUET).exists():
        return pd.read_parquet(directory / PREDICTIONS_PARQUET)
    if (directory / PREDICTIONS_JSONL).exists():  # evaluate writes only JSONL where pyarrow is absent
        return pd.read_json(directory / PREDICTIONS_JSONL, lines=True, dtype={"id": str})
    raise GateError(f"{name}: {PREDICTIONS_PARQUET} is missing from the evaluation artifact; re-run its evaluate stage")


def _outcomes(frame: Any, name: str, metric: str) -> dict[str, bool]:
    """id -> ``metric``'s per-example outcome, one row per id."""
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
    return dict(zip(ids, frame[column].astype(bool), strict=True))


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
    guard = _guard_check(cfg, ctx.inputs, base_metrics, tuned_metrics)
    decision = gate_rule.with_guard(decision, guard)
    notes = reported_differently(decision, base_metrics, tuned_metrics)
    identical = identical_generations(base_frame, tuned_frame)
    judged = _against_registry(ctx, cfg, decision)
    decision, compared = judged.decision, judged.record
    notes += judged.notes
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
        "guard": guard.as_dict() if guard else None,
        "champion": compared,
        "tuned_model_fingerprint": _input_fingerprint(ctx, "tuned_eval", "model"),
        "eval_set_fingerprint": _input_fingerprint(ctx, "tuned_eval", "eval_set"),
        "notes": notes,
        "rule": gate_rule.RULE,
    }
    (ctx.out / DECISION).write_text(json.dumps(evidence, indent=2, sort_keys=True))
    ctx.progress(("PROMOTE: " if decision.promote else "do not promote: ") + decision.reason)
    return summary(decision, compared, guard)


def _decide(cfg: GateConfig, metric: Metric, base: dict[str, bool], tuned: dict[str, bool]) -> Decision:
    return gate_rule.decide(
        base,
        tuned,
        metric=metric.name,
        min_improvement=cfg.min_improvement,
        confidence=cfg.confidence,
        bootstrap_samples=cfg.bootstrap_samples,
        seed=cfg.seed,
        higher_is_better=metric.higher_is_better,
    )


def load_guard(directory: Path, name: str, evaluation: dict[str, Any]) -> tuple[dict[str, bool], dict[str, Any]]:
    """(question id -> correct, metrics.json's ``guard``) of one evaluation's guard set, from its per-question
    file (as the task metric is read from the predictions, not from the summary)."""
    recorded = evaluation.get("guard")
    path = directory / guard_sets.PREDICTIONS_FILE
    if not recorded or not isinstance(recorded, dict) or not path.exists():
        raise GateError(
            f"{name}: the evaluation scored no guard set (no {guard_sets.PREDICTIONS_FILE}), but gate.guard asks "
            "for one; re-run its evaluate stage with this spec (gate.guard.set is part of its cache key)"
        )
    outcomes: dict[str, bool] = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            question, correct = _guard_row(line, f"{name}: {guard_sets.PREDICTIONS_FILE} line {line_no}")
            if question in outcomes:
                raise GateError(f"{name}: {guard_sets.PREDICTIONS_FILE} lists question {question!r} twice")
            outcomes[question] = correct
    return outcomes, recorded


def _guard_row(line: bytes, where: str) -> tuple[str, bool]:
    """(id, correct) of one line of an evaluation's guard predictions: a string id and a JSON boolean."""
    try:
        row = json_objects.parse_object(line)
    except json_objects.NotAnObject as exc:
        raise GateError(f"{where} {exc}; re-run its evaluate stage") from None
    if not (isinstance(row.get("id"), str) and isinstance(row.get("correct"), bool)):
        raise GateError(
            f'{where} is not a guard prediction: it needs "id" (a string) and "correct" (true or false); '
            "re-run its evaluate stage"
        )
    return row["id"], row["correct"]


def _suite_entry(evaluation: dict[str, Any], name: str, suite: str) -> dict[str, Any]:
    """metrics.json's ``suites.<suite>`` of one evaluation; GateError when it scored no such suite."""
    entry = (evaluation.get("suites") or {}).get(suite)
    if not isinstance(entry, dict):
        raise GateError(
            f"{name}: the evaluation scored no suite {suite!r}, but gate.guard.suite asks for it; re-run its "
            "evaluate stage with this spec (evaluation.suites is part of its cache key)"
        )
    return entry


def _guard_check(
    cfg: GateConfig, inputs: dict[str, Path], base_metrics: dict[str, Any], tuned_metrics: dict[str, Any]
) -> GuardCheck | None:
    """The regression guard over both evaluations' guard sets (None: the spec has no gate.guard)."""
    if cfg.guard is None:
        return None
    if cfg.guard.suite is not None:
        return gate_rule.suite_guard_check(
            _suite_entry(base_metrics, "base_eval", cfg.guard.suite),
            _suite_entry(tuned_metrics, "tuned_eval", cfg.guard.suite),
            suite=cfg.guard.suite,
            max_drop=cfg.guard.max_drop,
            rule=cfg.guard.rule,
            confidence=cfg.confidence,
            bootstrap_samples=cfg.bootstrap_samples,
            seed=cfg.seed,
        )
    base, base_set = load_guard(inputs["base_eval"], "base_eval", base_metrics)
    tuned, tuned_set = load_guard(inputs["tuned_eval"], "tuned_eval", tuned_metrics)
    sets = {(r.get("set"), r.get("sha256")) for r in (base_set, tuned_set)}
    if len(sets) != 1 or base_set.get("set") != cfg.guard.set:
        raise GateError(
            f"the evaluations scored different guard sets (base {base_set.get('set')} sha256 "
            f"{str(base_set.get('sha256'))[:12]}, tuned {tuned_set.get('set')} sha256 {str(tuned_set.get('sha256'))[:12]}; "
            f"gate.guard.set is {cfg.guard.set}); re-run both evaluations with this spec"
        )
    return gate_rule.guard_check(
        base,
        tuned,
        max_drop=cfg.guard.max_drop,
        rule=cfg.guard.rule,
        guard_set=f"{base_set['set']} (sha256 {str(base_set['sha256'])[:12]})",
        confidence=cfg.confidence,
        bootstrap_samples=cfg.bootstrap_samples,
        seed=cfg.seed,
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


def _against_registry(ctx: StepContext, cfg: GateConfig, decision: Decision) -> ChampionComparison:
    """``gate_rule.against_champion`` with the registry's champion of this pipeline, if any."""
    model_fp = _input_fingerprint(ctx, "tuned_eval", "model")
    eval_fp = _input_fingerprint(ctx, "tuned_eval", "eval_set")
    return gate_rule.against_champion(decision, _champion(ctx, cfg, decision.metric), model_fp, eval_fp)


def _champion(ctx: StepContext, cfg: GateConfig, metric: str) -> Champion | None:
    """The registry's champion of this pipeline as ``registry.champion`` verified it, with ``metric`` measured
    from its committed evaluation (None: nothing registered, or no registry configured)."""
    entry = registry.champion(cfg.registry_uri, str(cfg.pipeline), str(cfg.artifact_root)) if cfg.registry_uri else None
    if entry is None:
        return None
    measured = champion_figure(entry, metric, ctx.work)
    ctx.progress(
        f"champion: version {entry['version']}, promoted by {entry['gate_manifest']}, measured from "
        f"{entry['evaluation_manifest']} (model {entry['model_manifest']}; all verified)"
    )
    return Champion(
        version=entry["version"],
        version_uri=entry["version_uri"],
        run_id=entry.get("run_id"),
        model_fingerprint=entry["model_fingerprint"],
        gate_manifest=entry["gate_manifest"],
        evaluation_manifest=entry["evaluation_manifest"],
        eval_set_fingerprint=entry["eval_set_fingerprint"],
        measured=measured,
        recorded=registry.recorded_value(entry, metric),
        recorded_figure=registry.recorded_metric(entry, metric),
    )


def summary(decision: Decision, compared: dict[str, Any] | None, guard: GuardCheck | None) -> dict[str, Any]:
    """The manifest's summary (and the XCom the publish task and the promotion notice read): ``ci`` is the
    ``confidence`` interval of the gain."""
    guarded = {"guard": {"passed": guard.passed, "delta": round(guard.delta, 6)}} if guard else {}
    return {
        "promote": decision.promote,
        "metric": decision.metric,  # what base, tuned and delta measure
        "base": round(decision.base, 6),
        "tuned": round(decision.tuned, 6),
        "delta": round(decision.delta, 6),
        "ci": [round(x, 6) for x in decision.ci],
        "confidence": decision.confidence,
        "reason": decision.reason,
        "champion_version": compared["version"] if compared else None,
        **guarded,
    }


if __name__ == "__main__":
    run_and_exit(STAGE, run)
