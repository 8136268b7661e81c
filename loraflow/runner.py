"""Run one stage of a pipeline: resolve inputs, consult the cache, launch, verify the commit.

Airflow-free: the operators call ``run_stage``; so can a test or a script.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from loraflow import artifacts
from loraflow.errors import LoraflowError
from loraflow.launch import LineSink, LocalLauncher
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
    launcher: LocalLauncher | None = None,
) -> StageResult:
    plan = stage_plans(spec)[stage]
    compute = spec.compute_for(stage)
    if compute.launcher != "local":
        raise LoraflowError(
            f"stage {stage} asks for the {compute.launcher!r} launcher, which this loraflow version cannot "
            "start yet; set compute.{stage}.launcher: local to run it on this machine"
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
    argv = plan.argv(str(plan.env.local_python()), prefix, inputs, lock, key)
    sink(f"launching {plan.module} in the {plan.env.name} environment, output {prefix}")
    (launcher or LocalLauncher()).run(argv, sink, compute.env)
    manifest = artifacts.read_manifest(prefix)
    if plan.cacheable:
        artifacts.cache_store(spec.artifact_root, stage, key, manifest)
    return StageResult(stage, manifest.uri, False, manifest.summary)
