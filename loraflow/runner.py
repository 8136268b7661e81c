"""Run one stage of a pipeline: resolve inputs, consult the cache, launch, verify the commit.

Airflow-free: the operators call ``run_stage``; so can a test or a script.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from loraflow import artifacts
from loraflow.errors import LoraflowError
from loraflow.launch import KillSwitch, LineSink, LocalLauncher
from loraflow.plan import Source, StagePlan, output_prefix, stage_plans
from loraflow.spec import PipelineSpec

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
                raise LoraflowError(f"{plan.stage} needs the output of {ref.stage}, which did not run")
            resolved[name] = artifacts.manifest_uri(upstream[ref.stage])
    return resolved


def input_fingerprints(inputs: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, uri in inputs.items():
        if uri.endswith("/" + artifacts.MANIFEST):
            out[name] = artifacts.read_manifest(uri).fingerprint
        else:
            out[name] = artifacts.fingerprint(artifacts.source_files(uri))
    return out


def run_stage(
    spec: PipelineSpec,
    stage: str,
    run_id: str,
    upstream: dict[str, str],
    sink: LineSink,
    kill_switch: KillSwitch | None = None,
    dag_id: str | None = None,
) -> StageResult:
    """Run ``stage`` unless the cache holds it. A vertex stage runs as a Vertex AI CustomJob named after
    ``dag_id`` (default: the spec's name, as the DAG factory names DAGs), ``run_id``, stage and cache key;
    ``kill_switch.kill()`` stops the step program (or cancels that job)."""
    plan = stage_plans(spec)[stage]
    compute = spec.compute_for(stage)
    if compute.launcher not in ("local", "vertex"):
        raise LoraflowError(
            f"stage {stage} asks for the {compute.launcher!r} launcher, which this loraflow version cannot "
            f"start yet; set compute.{stage}.launcher to local or vertex"
        )
    inputs = resolve_inputs(plan, upstream)
    lock = plan.env.lock_version()
    key = artifacts.cache_key(input_fingerprints(inputs), plan.config, lock)
    if plan.cacheable:
        hit = artifacts.cache_lookup(spec.artifact_root, stage, key)
        if hit is not None:
            sink(f"cache hit for {stage} (key {key}): reusing {hit.uri}; nothing recomputed")
            return StageResult(stage, hit.uri, True, hit.summary)
        sink(f"cache miss for {stage} (key {key}): running it")
    prefix = output_prefix(spec, run_id, stage)
    if compute.launcher == "vertex":
        from loraflow.launch_vertex import VertexLauncher
        from loraflow.vertex import JobIdentity

        remote = VertexLauncher(compute, JobIdentity(dag_id or spec.name, run_id, stage, key), prefix)
        if kill_switch is not None:
            kill_switch.arm(remote)
        argv = plan.argv("python", prefix, inputs, lock, key)
        sink(f"launching {plan.module} on Vertex AI ({compute.machine_type} x {compute.hosts}), output {prefix}")
        remote.run(argv, sink, compute.env)
    else:
        argv = plan.argv(str(plan.env.local_python()), prefix, inputs, lock, key)
        sink(f"launching {plan.module} in the {plan.env.name} environment, output {prefix}")
        local = LocalLauncher()
        if kill_switch is not None:
            kill_switch.arm(local)
        local.run(argv, sink, compute.env)
    manifest = artifacts.read_manifest(prefix)
    if plan.cacheable:
        artifacts.cache_store(spec.artifact_root, stage, key, manifest)
    return StageResult(stage, manifest.uri, False, manifest.summary)
