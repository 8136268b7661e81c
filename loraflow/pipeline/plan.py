"""From a spec to a plan: the stages, their order, environments, inputs, configs and argv.

Pure: no I/O. ``loraflow plan SPEC`` prints it; the operators run it one stage at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraflow.launchers import registry
from loraflow.launchers.environments import ENVIRONMENTS, Environment
from loraflow.launchers.identity import JobIdentity
from loraflow.pipeline import artifacts
from loraflow.spec.schema import STAGES, PipelineSpec
from loraflow.spec.step_configs import (
    ConvertCheckpointConfig,
    EvaluateConfig,
    GateConfig,
    LoraSftConfig,
    MergeAdapterConfig,
    PublishConfig,
    ReportConfig,
    ValidateDataConfig,
)


@dataclass(frozen=True)
class Source:
    """An input that is not a loraflow artifact: a dataset, a Hugging Face checkpoint."""

    uri: str


@dataclass(frozen=True)
class Upstream:
    """An input that is another stage's committed output (its manifest)."""

    stage: str
    fetch: bool = True  # False: only referenced (fingerprinted, not downloaded)
    optional: bool = False  # True: the stage runs without it when that stage failed or was skipped


Input = Source | Upstream

# The stages the run report reads (by reference: it fetches only the few small files it shows).
REPORTED = tuple(s for s in STAGES if s not in ("publish", "report"))


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
    """Every stage of the pipeline, in an order where each stage follows its inputs."""
    ctl, trn, srv = ENVIRONMENTS["control"], ENVIRONMENTS["trainer"], ENVIRONMENTS["serving"]
    evaluation = EvaluateConfig.from_spec(spec).wire()
    plans = [
        StagePlan(
            "validate_data",
            ctl,
            "loraflow.steps.validate_data",
            {"train": Source(spec.data.train), "eval": Source(spec.data.eval), "tokenizer": Source(spec.tokenizer_uri)},
            ValidateDataConfig.from_spec(spec).wire(),
        ),
        StagePlan(
            "convert_checkpoint",
            trn,
            "loraflow.steps.convert_checkpoint",
            {"hf_checkpoint": Source(spec.base_model.hf_checkpoint)},
            ConvertCheckpointConfig.from_spec(spec).wire(),
        ),
        StagePlan(
            "evaluate_base",
            srv,
            "loraflow.steps.evaluate",
            {"model": Source(spec.base_model.hf_checkpoint), "eval_set": Upstream("validate_data")},
            evaluation,
        ),
        StagePlan(
            "lora_sft",
            trn,
            "loraflow.steps.lora_sft",
            {
                "checkpoint": Upstream("convert_checkpoint"),
                "dataset": Upstream("validate_data"),
                "tokenizer": Source(spec.tokenizer_uri),
            },
            LoraSftConfig.from_spec(spec).wire(),
        ),
        StagePlan(
            "merge_adapter",
            trn,
            "loraflow.steps.merge_adapter",
            {"base": Source(spec.base_model.hf_checkpoint), "adapter": Upstream("lora_sft")},
            MergeAdapterConfig.from_spec(spec).wire(),
        ),
        StagePlan(
            "evaluate_tuned",
            srv,
            "loraflow.steps.evaluate",
            {"model": Upstream("merge_adapter"), "eval_set": Upstream("validate_data")},
            evaluation,
        ),
        StagePlan(
            "gate",
            ctl,
            "loraflow.steps.gate",
            {"base_eval": Upstream("evaluate_base"), "tuned_eval": Upstream("evaluate_tuned")},
            GateConfig.from_spec(spec).wire(),
            # It also compares with the registry's current champion, which moves between runs
            # without any input changing: a cached decision could promote a model the champion beats.
            cacheable=False,
        ),
        StagePlan(
            "publish",
            ctl,
            "loraflow.steps.publish",
            {"model": Upstream("merge_adapter", fetch=False), "decision": Upstream("gate")},
            PublishConfig.from_spec(spec).wire(),
            cacheable=False,
        ),
        StagePlan(
            "report",
            ctl,
            "loraflow.steps.report",
            # Every input optional: the report also describes a run where a stage failed.
            {stage: Upstream(stage, fetch=False, optional=True) for stage in REPORTED},
            ReportConfig.from_spec(spec).wire(),
            cacheable=False,  # it reports this run: its cache hits, its publish outcome
        ),
    ]
    out: dict[str, StagePlan] = {}
    for p in plans:
        ups = tuple(dict.fromkeys(i.stage for i in p.inputs.values() if isinstance(i, Upstream)))
        # Nothing is converted or trained before the data contract holds.
        if p.stage == "convert_checkpoint":
            ups = ("validate_data",)
        # The report follows publish (and reads its outcome from the run's prefix) without
        # needing it: publish is skipped when the gate does not promote.
        if p.stage == "report":
            ups = (*ups, "publish")
        out[p.stage] = StagePlan(p.stage, p.env, p.module, p.inputs, p.config, p.cacheable, ups)
    return out


def output_prefix(spec: PipelineSpec, run_id: str, stage: str) -> str:
    return artifacts.stage_prefix(spec.artifact_root, spec.name, run_id, stage)


def describe(spec: PipelineSpec, run_id: str = "RUN_ID") -> dict[str, Any]:
    """The resolved plan as data: what ``loraflow plan`` prints."""
    stages = []
    for sp in stage_plans(spec).values():
        inputs = {
            name: ref.uri if isinstance(ref, Source) else artifacts.manifest_uri(output_prefix(spec, run_id, ref.stage))
            for name, ref in sp.inputs.items()
        }
        compute = spec.compute_for(sp.stage)
        identity = JobIdentity(spec.name, run_id, sp.stage, "CACHE_KEY")
        launcher = registry.launcher_for(compute, identity, output_prefix(spec, run_id, sp.stage))
        placeholders = {name: "FINGERPRINT" for name in inputs}
        python = launcher.python(sp.env, installed=False)
        argv = sp.argv(python, output_prefix(spec, run_id, sp.stage), inputs, "LOCK", "CACHE_KEY", placeholders)
        entry = {
            "stage": sp.stage,
            "after": list(sp.upstream),
            "environment": sp.env.name,
            "launcher": compute.model_dump(mode="json", exclude_defaults=True) or {"launcher": "local"},
            "output": output_prefix(spec, run_id, sp.stage),
            "cached": sp.cacheable,
            "argv": argv,
            **launcher.describe(argv),
        }
        stages.append(entry)
    described: dict[str, Any] = {
        "pipeline": spec.name,
        "run_id": run_id,
        "artifact_root": spec.artifact_root,
        "stages": stages,
    }
    if spec.handoff is not None:
        # Two control tasks around the stages (operators/handoff.py): not stages, they commit no
        # artifact; they claim the data team's dataset version and write the verdict beside it.
        from loraflow.data import handoff

        base = f"{spec.handoff.prefix}/{{version}}"
        described["handoff"] = {
            "first": {"task": handoff.PICK_TASK, "takes": f"{base}/ with {handoff.READY}, claims {handoff.CLAIM}"},
            "last": {
                "task": handoff.VERDICT_TASK,
                "writes": f"{base}/{handoff.RESULT}",
                "asset": handoff.verdict_asset_uri(spec.name),
            },
        }
    return described
