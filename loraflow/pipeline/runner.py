"""Run one stage of a pipeline: resolve inputs, consult the cache, launch, verify the commit.

Airflow-free: the operators call ``run_stage``; so can a test or a script.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraflow.errors import LoraflowError
from loraflow.launchers import credentials, registry
from loraflow.launchers.base import Launcher, WorkloadSink, ignore_workload
from loraflow.launchers.identity import JobIdentity
from loraflow.launchers.local import KillSwitch, LineSink
from loraflow.pipeline.plan import StagePlan, output_prefix, stage_plans
from loraflow.spec.compute import AnyCompute
from loraflow.spec.schema import PipelineSpec
from loraflow.spec.stages import Source
from loraflow.storage import artifacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageResult:
    stage: str
    manifest: str
    cached: bool
    summary: dict[str, Any]

    def to_xcom(self) -> dict[str, Any]:
        """Small by construction: a URI and the step's few summary numbers."""
        return {"stage": self.stage, "manifest": self.manifest, "cached": self.cached, "summary": self.summary}


def resolve_inputs(plan: StagePlan, upstream: dict[str, str]) -> dict[str, str]:
    resolved = {}
    for name, ref in plan.inputs.items():
        if isinstance(ref, Source):
            resolved[name] = ref.uri
        else:
            if ref.stage not in upstream:
                if ref.optional:
                    continue
                raise LoraflowError(f"{plan.stage} needs the output of {ref.stage}, which did not run")
            resolved[name] = artifacts.manifest_uri(upstream[ref.stage])
    return resolved


def commit_prefix(prefix: str, key: str) -> str:
    """Where a computation with cache key ``key`` commits: the stage's prefix in the run, unless that
    already holds a commit with another key (the task was cleared and re-run on changed inputs, e.g.
    the report after a failed stage was retried): then beside it, named by the key. A commit is never
    overwritten, and the same key always lands in the same place, so a retry still finds its own. A
    manifest there that is no JSON object (a bucket writer's) is another commit: the new one goes beside it."""
    try:
        existing = artifacts.read_json(artifacts.manifest_uri(prefix))
    except artifacts.JsonObjectError:
        existing = {}
    if existing is None or existing.get("cache_key") == key:
        return prefix
    return f"{prefix}-{key[:12]}"


def input_fingerprints(inputs: dict[str, str]) -> dict[str, str]:
    """Each input's identity, as the cache key hashes it and the step program checks it again
    (``--fingerprint``): a source's files' fingerprint, an upstream stage's own cache key."""
    out = {}
    for name, uri in inputs.items():
        if uri.endswith("/" + artifacts.MANIFEST):
            # An upstream stage stands for what it was computed from (its cache key), not for its
            # bytes: two runs that computed the same stage at the same time (validate_data's GX data
            # docs carry timestamps) still share every downstream cache entry.
            out[name] = artifacts.input_identity(artifacts.read_manifest(uri))
        else:
            out[name] = artifacts.fingerprint(artifacts.source_files(uri))
    return out


@dataclass(frozen=True)
class PreparedStage:
    """A stage that has to run (the cache missed): everything a launcher needs, decided once."""

    stage: str
    plan: StagePlan
    compute: AnyCompute
    inputs: dict[str, str]
    cache_key: str
    lock_version: str
    prefix: str
    fingerprints: dict[str, str]  # what the cache key was computed from; the step checks its inputs against them

    def argv(self, python: str) -> list[str]:
        return self.plan.argv(python, self.prefix, self.inputs, self.lock_version, self.cache_key, self.fingerprints)


def prepare_stage(
    spec: PipelineSpec, stage: str, run_id: str, upstream: dict[str, str], sink: LineSink
) -> PreparedStage | StageResult:
    """The first half of ``run_stage``: resolve inputs and the cache key; a ``StageResult`` on a cache hit."""
    plan = stage_plans(spec)[stage]
    compute = spec.compute_for(stage)
    registry.launcher_class(compute.launcher, stage)  # one this version cannot start fails before any work
    inputs = resolve_inputs(plan, upstream)
    lock = plan.env.lock_version()
    fingerprints = input_fingerprints(inputs)
    key = artifacts.cache_key(fingerprints, plan.config, lock)
    if plan.cacheable:
        hit = artifacts.cache_lookup(spec.artifact_root, stage, key)
        if hit is not None:
            sink(f"cache hit for {stage} (key {key}): reusing {hit.uri}; nothing recomputed")
            return StageResult(stage, hit.uri, True, hit.summary)
        sink(f"cache miss for {stage} (key {key}): running it")
    prefix = commit_prefix(output_prefix(spec, run_id, stage), key)
    return PreparedStage(stage, plan, compute, inputs, key, lock, prefix, fingerprints)


def launcher_for(
    spec: PipelineSpec, stage: str, run_id: str, cache_key: str, prefix: str, dag_id: str | None = None
) -> Launcher:
    """The launcher of ``stage`` as the spec's compute section says; a remote job is named after
    dag_id (default: the spec's name, as the DAG factory names DAGs), run_id, stage and cache key."""
    identity = JobIdentity(dag_id or spec.name, run_id, stage, cache_key)
    return registry.launcher_for(spec.compute_for(stage), identity, prefix)


def launch(
    prepared: PreparedStage,
    launcher: Launcher,
    sink: LineSink,
    secrets: Mapping[str, str] = {},
    on_workload: WorkloadSink = ignore_workload,
) -> None:
    """Run a prepared stage's step program with ``launcher`` until it ends; ``on_workload`` hears of a
    remote job as soon as it exists."""
    plan = prepared.plan
    for name, value in sorted(secrets.items()):
        sink(f"secret {name} ({credentials.fingerprint(value)}) passed to the step in its environment")
    launcher.check_secrets(secrets)
    sink(f"launching {plan.module} {launcher.summary(plan.env)}, output {prepared.prefix}")
    argv = prepared.argv(launcher.python(plan.env))
    launcher.run(argv, sink, prepared.compute.env, secrets, on_workload)


def finish_stage(spec: PipelineSpec, stage: str, prefix: str, cache_key: str) -> StageResult:
    """The last half of ``run_stage``, after the step program ended well: verify its commit, fill the cache."""
    plan = stage_plans(spec)[stage]
    manifest = artifacts.read_manifest(prefix)
    committed_key = manifest.data.get("cache_key")
    if committed_key is not None and committed_key != cache_key:
        raise artifacts.ArtifactError(
            f"{manifest.uri} was committed for cache key {committed_key}, not this attempt's {cache_key}: "
            "the stage's inputs or config changed under it; re-run the stage"
        )
    if plan.cacheable:
        artifacts.cache_store(spec.artifact_root, stage, cache_key, manifest)
    return StageResult(stage, manifest.uri, False, manifest.summary)


def run_stage(
    spec: PipelineSpec,
    stage: str,
    run_id: str,
    upstream: dict[str, str],
    sink: LineSink,
    kill_switch: KillSwitch | None = None,
    dag_id: str | None = None,
    secrets: Mapping[str, str] | None = None,
    on_workload: WorkloadSink = ignore_workload,
) -> StageResult:
    """Run ``stage`` unless the cache holds it, with the launcher its compute section names
    (``launcher_for``); ``kill_switch.kill()`` stops the step program (or cancels its remote job).
    ``secrets`` (``{ENV_NAME: value}``, resolved by the caller) reach the step program only through its
    environment; their values are replaced by ``***`` in the step's output lines and error messages."""
    prepared = prepare_stage(spec, stage, run_id, upstream, sink)
    if isinstance(prepared, StageResult):
        return prepared
    launcher = launcher_for(spec, stage, run_id, prepared.cache_key, prepared.prefix, dag_id)
    if kill_switch is not None:
        kill_switch.arm(launcher)
    launch(prepared, launcher, sink, secrets or {}, on_workload)
    return finish_stage(spec, stage, prepared.prefix, prepared.cache_key)
