"""From a spec to a plan: the stages, their order, environments, inputs, configs and argv.

Pure: no I/O. ``loraflow plan SPEC`` prints it; the operators run it one stage at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraflow.launchers import registry
from loraflow.launchers.environments import Environment, environment_for
from loraflow.launchers.identity import JobIdentity
from loraflow.spec.schema import PipelineSpec
from loraflow.spec.stages import REPORTED, STAGE_TABLE, Input, Source, Upstream
from loraflow.spec.step_configs import STEP_CONFIGS
from loraflow.storage import artifacts

__all__ = ["REPORTED", "Input", "Source", "StagePlan", "Upstream", "describe", "output_prefix", "stage_plans"]


@dataclass(frozen=True)
class StagePlan:
    stage: str
    env: Environment
    module: str
    inputs: dict[str, Input]
    config: dict[str, Any]
    cacheable: bool = True
    upstream: tuple[str, ...] = field(default=())

    def argv(
        self,
        python: str,
        output: str,
        inputs: dict[str, str],
        lock_version: str,
        cache_key: str,
        fingerprints: Mapping[str, str] | None = None,
    ) -> list[str]:
        """The step program's command line: the same for every launcher. ``fingerprints`` are the
        inputs' identities the cache key was computed from; the step refuses inputs that differ."""
        argv = [python, "-m", self.module, "--output", output]
        for name, uri in inputs.items():
            ref = self.inputs[name]
            flag = "--ref" if isinstance(ref, Upstream) and not ref.fetch else "--input"
            argv += [flag, f"{name}={uri}"]
        for name, value in sorted((fingerprints or {}).items()):
            argv += ["--fingerprint", f"{name}={value}"]
        argv += ["--config-json", json.dumps(self.config, sort_keys=True)]
        argv += ["--lock-version", lock_version, "--cache-key", cache_key]
        return argv


def stage_plans(spec: PipelineSpec) -> dict[str, StagePlan]:
    """Every stage of the pipeline (``loraflow.spec.stages.STAGE_TABLE``), in an order where each
    stage follows its inputs; a stage runs after the stages its inputs name and those it lists in ``after``."""
    out: dict[str, StagePlan] = {}
    for stage in STAGE_TABLE:
        out[stage.name] = StagePlan(
            stage.name,
            environment_for(stage.env, spec.compute_for(stage.name)),
            stage.module,
            stage.inputs(spec),
            STEP_CONFIGS[stage.name].from_spec(spec).wire(),
            stage.cacheable,
            stage.upstream(spec),
        )
    return out


def output_prefix(spec: PipelineSpec, run_id: str, stage: str) -> str:
    return artifacts.stage_prefix(spec.artifact_root, spec.name, run_id, stage)


def describe(spec: PipelineSpec, run_id: str = "RUN_ID") -> dict[str, Any]:
    """The resolved plan as data: what ``loraflow plan`` prints."""
    described: dict[str, Any] = {
        "pipeline": spec.name,
        "run_id": run_id,
        "artifact_root": spec.artifact_root,
        "stages": [_describe_stage(spec, sp, run_id) for sp in stage_plans(spec).values()],
    }
    if spec.handoff is not None:
        described["handoff"] = _describe_handoff(spec.name, spec.handoff.prefix)
    return described


def _describe_stage(spec: PipelineSpec, sp: StagePlan, run_id: str) -> dict[str, Any]:
    """One stage as it would run: its place, environment, launcher, output, argv and remote request."""
    prefix = output_prefix(spec, run_id, sp.stage)
    inputs = {
        name: ref.uri if isinstance(ref, Source) else artifacts.manifest_uri(output_prefix(spec, run_id, ref.stage))
        for name, ref in sp.inputs.items()
    }
    compute = spec.compute_for(sp.stage)
    launcher = registry.launcher_for(compute, JobIdentity(spec.name, run_id, sp.stage, "CACHE_KEY"), prefix)
    placeholders = {name: "FINGERPRINT" for name in inputs}
    argv = sp.argv(launcher.python(sp.env, installed=False), prefix, inputs, "LOCK", "CACHE_KEY", placeholders)
    return {
        "stage": sp.stage,
        "after": list(sp.upstream),
        "environment": sp.env.name,
        "launcher": compute.model_dump(mode="json", exclude_defaults=True) or {"launcher": launcher.name},
        "output": prefix,
        "cached": sp.cacheable,
        "argv": argv,
        **launcher.describe(argv),
    }


def _describe_handoff(pipeline: str, prefix: str) -> dict[str, Any]:
    """Two control tasks around the stages (operators/handoff.py): not stages, they commit no artifact;
    they claim the data team's dataset version and write the verdict beside it."""
    from loraflow.pipeline import handoff

    base = f"{prefix}/{{version}}"
    return {
        "first": {"task": handoff.PICK_TASK, "takes": f"{base}/ with {handoff.READY}, claims {handoff.CLAIM}"},
        "last": {
            "task": handoff.VERDICT_TASK,
            "writes": f"{base}/{handoff.RESULT}",
            "asset": handoff.verdict_asset_uri(pipeline),
        },
    }
