"""Step program for the publish stage: register a promoted model in a registry kept in GCS.

Inputs: ``decision`` (directory with the gate's decision.json) and, optionally, ``model``: the
merged checkpoint's manifest, best given with ``--ref model=gs://.../merge_adapter/_MANIFEST.json``
(verified, not downloaded: publishing needs the model's identity, not its bytes). Without it the
manifest named by ``config["model_manifest"]`` is read and verified instead.

Config (``loraflow.spec.step_configs.PublishConfig``)::

    registry_uri     gs://BUCKET/.../_registry   (required)
    pipeline         the pipeline's name          (required)
    run_id           the run being published      (default: the run of the output prefix)
    model_manifest   gs://.../merge_adapter/_MANIFEST.json  (required unless the model input is given)
    vertex_model_registry   the spec's publish.vertex_model_registry (optional): also register the
                     promoted model in Vertex AI Model Registry (loraflow.registry.vertex), its
                     ``champion`` alias mirroring the GCS registry's

The registry of a pipeline lives under ``{registry_uri}/{pipeline}/``::

    versions/0001.json      one per promoted model, never overwritten; records the model, the
                            gate commit that promoted it (``gate_manifest``: the next gates find
                            the evaluation it judged there and measure the champion's figure from
                            it) and its eval ``metrics``
    aliases/champion.json   points at the current champion version

Registry objects are read with a byte cap (``artifacts.read_json_object``): a version file that is not
a JSON object is no version of this run (publish takes the next number); an alias that is not one is
refused, naming it and the repair.

A version number is taken by creating ``versions/{N:04d}.json`` with the precondition
``if_generation_match=0`` (create only if absent), so two publishers never take the same number:
the loser sees 412 and tries the next one. A retried publish of the same run and model finds its
own version and reuses it. The alias moves with a generation precondition too, and only forward:
a publisher never points champion back at an older version than the one it holds, nor at a version
an operator rolled back (``loraflow.registry.operations``). Each move is recorded in the registry's
audit trail (``audit/NNNNNN.json``, ``loraflow.registry.audit``) as made by the gate of the run.

Writes ``registry_entry.json`` either way (with the Vertex AI model version when there is one);
when the gate did not promote, registers nothing.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from loraflow.errors import ArtifactError, LoraflowError
from loraflow.registry import alias, audit
from loraflow.registry import store as registry
from loraflow.registry import vertex as vertex_registry
from loraflow.spec.stages import DECISION, REGISTRY_ENTRY
from loraflow.spec.step_configs import PublishConfig, parse
from loraflow.steps._harness import StepContext, run_and_exit
from loraflow.storage import artifacts, gcs, json_objects
from loraflow.storage.summaries import GateSummary

log = logging.getLogger(__name__)

STAGE = "publish"
VERSION_FORMAT = "loraflow.registry.store.version/1"
ALIAS_FORMAT = alias.FORMAT
ALIAS = "champion"
MAX_ATTEMPTS = 50


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def resolve_config(raw: dict[str, Any], has_model_input: bool, output_uri: str | None = None) -> PublishConfig:
    cfg = parse(PublishConfig, raw)
    if output_uri and not cfg.run_id:
        # {artifact_root}/{pipeline}/{run_id}/publish: the run is the prefix's parent.
        cfg = cfg.model_copy(update={"run_id": output_uri.rstrip("/").split("/")[-2]})
    required = ["registry_uri", "pipeline", "run_id"] + ([] if has_model_input else ["model_manifest"])
    problems = [f"{k} is required" for k in required if not getattr(cfg, k)]
    if problems:
        raise LoraflowError(f"{STAGE}: invalid config: " + "; ".join(problems))
    gcs.split_uri(cfg.registry_uri)
    if not re.fullmatch(r"[A-Za-z0-9._-]+", cfg.pipeline):
        raise LoraflowError(f"{STAGE}: pipeline {cfg.pipeline!r} must be letters, digits, '.', '_' or '-'")
    return cfg


class Registry:
    """A pipeline's model registry under ``{registry_uri}/{pipeline}/`` (google-cloud-storage)."""

    def __init__(self, registry_uri: str, pipeline: str):
        self.registry_uri, self.pipeline = registry_uri, pipeline
        self.uri = gcs.join(registry_uri, pipeline)
        bucket_name, self.base = gcs.split_uri(self.uri)
        self.bucket = gcs.client().bucket(bucket_name)

    def _object(self, *parts: str) -> str:
        return "/".join(p for p in (self.base, *parts) if p)

    def version_uri(self, number: int) -> str:
        return registry.version_uri(self.registry_uri, self.pipeline, number)

    @property
    def alias_uri(self) -> str:
        return gcs.join(self.uri, "aliases", f"{ALIAS}.json")

    def versions(self) -> dict[int, Any]:
        """Version number -> blob, for every version present."""
        return registry.versions(self.registry_uri, self.pipeline)

    def find(self, run_id: str, model_manifest: str) -> tuple[int, dict[str, Any]] | None:
        """The version this run already registered for this model (a retried publish), if any; a version
        file that is not a JSON object (capped: ``registry.VERSION_MAX_BYTES``) is none, and is logged."""
        for number, blob in sorted(self.versions().items(), reverse=True):
            uri = self.version_uri(number)
            try:
                entry = artifacts.read_json_object(uri, max_bytes=registry.VERSION_MAX_BYTES, blob=blob)
            except artifacts.JsonObjectError as exc:
                log.warning("registry version %s is not this run's: %s; left as it is", uri, exc.problem)
                continue
            if entry is not None and entry.get("run_id") == run_id and entry.get("model_manifest") == model_manifest:
                return number, entry
        return None

    def register(self, entry: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Create the next free version with ``entry``; never overwrites one."""
        from google.api_core.exceptions import PreconditionFailed

        number = max(self.versions(), default=0) + 1
        for _ in range(MAX_ATTEMPTS):
            data = {**entry, "version": number}
            blob = self.bucket.blob(self._object("versions", f"{number:04d}.json"))
            try:
                blob.upload_from_string(
                    json.dumps(data, indent=2, sort_keys=True), content_type="application/json", if_generation_match=0
                )
                return number, data
            except PreconditionFailed:
                # Someone took this number between our listing and our write: take the next one.
                number = max(max(self.versions(), default=0), number) + 1
        raise ArtifactError(f"could not take a version number in {self.uri} after {MAX_ATTEMPTS} attempts")

    def move_alias(self, number: int, entry: dict[str, Any], reason: str = "") -> bool:
        """Point the alias at version ``number`` unless it already points at a newer one, or a rollback
        withdrew ``number`` (loraflow.registry.audit); the move is recorded in the audit trail."""
        from google.api_core.exceptions import PreconditionFailed

        for _ in range(MAX_ATTEMPTS):
            current = alias.read(self.registry_uri, self.pipeline)
            held = current.version or 0
            if held >= number:
                return held == number
            if number in audit.withdrawn(audit.read_trail(self.registry_uri, self.pipeline, current.data)):
                log.warning("version %s was rolled back; publish leaves the champion at version %s", number, held)
                return False
            try:
                alias.move(
                    self.registry_uri,
                    self.pipeline,
                    current,
                    number,
                    entry,
                    action="publish",
                    actor=f"gate of run {entry['run_id']}",
                    reason=reason,
                    via="publish",
                )
                return True
            except PreconditionFailed:
                continue  # the alias moved under us: read it again
        raise ArtifactError(f"could not move {self.alias_uri} after {MAX_ATTEMPTS} attempts")


def eval_metrics(decision: dict[str, Any]) -> dict[str, Any]:
    """The tuned model's eval metrics, as the next runs' gates compare with them (scalars only)."""
    tuned = decision.get("tuned_metrics") or {}
    out = {k: v for k, v in tuned.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    if decision.get("metric") and decision.get("tuned") is not None:
        out[str(decision["metric"])] = decision["tuned"]  # what the gate measured from the predictions
    return out


def _model_manifest(ctx: StepContext, cfg: PublishConfig) -> artifacts.Manifest:
    given = ctx.input_manifests.get("model")
    wanted = cfg.model_manifest
    if given is not None:
        if wanted and artifacts.manifest_uri(wanted) != given.uri:
            raise LoraflowError(
                f"{STAGE}: the model input is {given.uri} but config model_manifest is {wanted}; give one of them"
            )
        return given
    return artifacts.read_manifest(str(wanted))


def run(ctx: StepContext) -> dict[str, Any]:
    cfg = resolve_config(
        dict(ctx.config), has_model_input=ctx.input_manifests.get("model") is not None, output_uri=ctx.output_uri
    )
    decision = _read_decision(ctx)
    verdict = GateSummary.from_object(decision, str(ctx.inputs["decision"] / DECISION))
    models = Registry(cfg.registry_uri, cfg.pipeline)
    if not verdict.promote:
        return _not_promoted(ctx, cfg, models, verdict)

    manifest = _model_manifest(ctx, cfg)
    ctx.progress(f"model {manifest.uri} verified (fingerprint {manifest.fingerprint[:12]})")
    vertex_target = None
    if cfg.vertex_model_registry:  # checked before anything is registered
        vertex_target = vertex_registry.Target.from_config(cfg.vertex_model_registry.model_dump(), cfg.pipeline)
    number, entry = _register_version(ctx, cfg, models, manifest, decision)
    moved = _move_alias(ctx, models, number, entry)
    record = _promoted_record(cfg, models, manifest, decision, number, moved)
    summary: dict[str, Any] = {"promoted": True, "version": number, "model_manifest": manifest.uri}
    if vertex_target is not None:
        vertex = _publish_to_vertex(ctx, cfg, vertex_target, manifest, number, moved)
        record["vertex_model_registry"] = vertex
        summary["vertex_model"] = f"{vertex['model']}@{vertex['version_id']}"
    _write_record(ctx.out, record)
    return summary


def _publish_to_vertex(
    ctx: StepContext,
    cfg: PublishConfig,
    target: vertex_registry.Target,
    manifest: artifacts.Manifest,
    number: int,
    champion: bool,
) -> dict[str, Any]:
    """Mirror registry version ``number`` (and whether it is the champion) in Vertex AI Model Registry."""
    return vertex_registry.VertexModelRegistry(target, cfg.pipeline).publish(
        version=number,
        champion=champion,
        artifact_uri=manifest.prefix,
        run_id=str(cfg.run_id),
        fingerprint=manifest.fingerprint,
        manifest_uri=manifest.uri,
        progress=ctx.progress,
    )


def _read_decision(ctx: StepContext) -> dict[str, Any]:
    """The gate's decision.json from the ``decision`` input."""
    if "decision" not in ctx.inputs:
        raise LoraflowError(f"{STAGE}: input 'decision' is missing; give --input decision=gs://.../gate/_MANIFEST.json")
    decision_path = ctx.inputs["decision"] / DECISION
    if not decision_path.exists():
        raise LoraflowError(f"{STAGE}: {decision_path.name} is missing from the decision input; re-run the gate")
    return json_objects.read_file_object(decision_path, fix="re-run the gate")


def _write_record(out: Path, record: dict[str, Any]) -> None:
    (out / REGISTRY_ENTRY).write_text(json.dumps(record, indent=2, sort_keys=True))


def _not_promoted(ctx: StepContext, cfg: PublishConfig, models: Registry, verdict: GateSummary) -> dict[str, Any]:
    """Record why nothing was registered; the registry is left as it is."""
    model_uri = artifacts.manifest_uri(cfg.model_manifest) if cfg.model_manifest else None
    record = {
        "promoted": False,
        "version": None,
        "model_manifest": model_uri or getattr(ctx.input_manifests.get("model"), "uri", None),
        "registry": models.uri,
        "reason": verdict.reason or "the gate did not promote this model",
        "run_id": str(cfg.run_id),
    }
    _write_record(ctx.out, record)
    ctx.progress(f"not promoted, nothing registered: {record['reason']}")
    return {"promoted": False, "version": None, "model_manifest": record["model_manifest"]}


def _register_version(
    ctx: StepContext, cfg: PublishConfig, models: Registry, manifest: artifacts.Manifest, decision: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """The version this run registered before (a retried publish), else a new one."""
    run_id = str(cfg.run_id)
    existing = models.find(run_id, manifest.uri)
    if existing is not None:
        ctx.progress(f"this run already registered {models.version_uri(existing[0])}; reusing it")
        return existing
    entry = {
        "format": VERSION_FORMAT,
        "pipeline": cfg.pipeline,
        "model_manifest": manifest.uri,
        "model_fingerprint": manifest.fingerprint,
        "gate_manifest": _gate_manifest(ctx),
        "metrics": eval_metrics(decision),
        "eval_set_fingerprint": decision.get("eval_set_fingerprint"),
        "decision": _without_per_example_lists(decision),
        "run_id": run_id,
        "created_at": _now(),
    }
    number, entry = models.register(entry)
    ctx.progress(f"registered version {number} at {models.version_uri(number)}")
    return number, entry


def _gate_manifest(ctx: StepContext) -> str | None:
    """The gate commit that promoted this model (the ``decision`` input's manifest), where the next gates
    find the evaluation it judged; None when the decision was given without its manifest (a run by hand:
    the gate commit of the run is looked for instead)."""
    gate = ctx.input_manifests.get("decision")
    return gate.uri if gate is not None else None


def _without_per_example_lists(decision: dict[str, Any]) -> dict[str, Any]:
    """The decision as a version records it: the evaluations' metrics keep their scalars (the per-example
    lists stay in the evaluations, which the version names), so a version stays a few kB."""
    slim = dict(decision)
    for key in ("base_metrics", "tuned_metrics"):
        if isinstance(slim.get(key), dict):
            slim[key] = {k: v for k, v in slim[key].items() if not isinstance(v, (list, dict))}
    return slim


def _move_alias(ctx: StepContext, models: Registry, number: int, entry: dict[str, Any]) -> bool:
    moved = models.move_alias(number, entry, str(entry.get("decision", {}).get("reason") or ""))
    ctx.progress(
        f"alias {ALIAS} now points at version {number}"
        if moved
        else f"alias {ALIAS} left as is: it points at a newer version, or a rollback withdrew version {number}"
    )
    return moved


def _promoted_record(
    cfg: PublishConfig,
    models: Registry,
    manifest: artifacts.Manifest,
    decision: dict[str, Any],
    number: int,
    moved: bool,
) -> dict[str, Any]:
    """registry_entry.json of a promoted model (the Vertex AI part is added when there is one)."""
    return {
        "promoted": True,
        "version": number,
        "version_uri": models.version_uri(number),
        "alias": ALIAS if moved else None,
        "alias_uri": models.alias_uri,
        "model_manifest": manifest.uri,
        "model_fingerprint": manifest.fingerprint,
        "registry": models.uri,
        "run_id": str(cfg.run_id),
        "reason": decision.get("reason"),
    }


if __name__ == "__main__":
    run_and_exit(STAGE, run)
