"""One operator per pipeline stage. Each is thin: spec + trigger params -> runner -> manifest URI."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

from airflow.sdk import BaseOperator, BaseOperatorLink, Context

from loraflow import gcs, runner
from loraflow.launch import KillSwitch
from loraflow.plan import stage_plans
from loraflow.report import browser_url
from loraflow.spec import PipelineSpec, param_name, validate_spec, with_overrides

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey


def resolve_spec(spec: dict[str, Any], params: dict[str, Any]) -> PipelineSpec:
    """The spec as this run sees it: the DAG's spec with the trigger form's values applied."""
    base = validate_spec(spec, f"pipeline {spec.get('name')}")
    overrides = {p.path: params[param_name(p.path)] for p in base.params if param_name(p.path) in params}
    return with_overrides(base, overrides) if overrides else base


class LoraflowStageOperator(BaseOperator):
    """Runs one stage's step program and pushes its manifest URI (never its data) to XCom."""

    stage: ClassVar[str]
    ui_color = "#e8f0fe"

    def __init__(self, *, spec: dict[str, Any], **kwargs: Any) -> None:
        kwargs.setdefault("task_id", self.stage)
        super().__init__(**kwargs)
        self.spec = spec
        self._kill_switch: KillSwitch | None = None  # made in execute(): operators get deep-copied

    def upstream_manifests(self, context: Context, spec: PipelineSpec) -> dict[str, str]:
        ti = context["ti"]
        out = {}
        for stage in stage_plans(spec)[self.stage].upstream:
            result = ti.xcom_pull(task_ids=stage)
            if result is not None:
                out[stage] = result["manifest"]
        return out

    def execute(self, context: Context) -> dict[str, Any]:
        spec = resolve_spec(self.spec, dict(context["params"]))
        self._kill_switch = KillSwitch()
        result = runner.run_stage(
            spec,
            self.stage,
            context["run_id"],
            self.upstream_manifests(context, spec),
            self.log.info,
            self._kill_switch,
        )
        self.log.info("%s %s: %s", self.stage, "reused" if result.cached else "committed", result.manifest)
        for key, value in result.summary.items():
            self.log.info("  %s = %s", key, value)
        return result.to_xcom()

    def on_kill(self) -> None:
        if self._kill_switch is not None:
            self._kill_switch.kill()


class ValidateDataOperator(LoraflowStageOperator):
    stage = "validate_data"


class ConvertCheckpointOperator(LoraflowStageOperator):
    stage = "convert_checkpoint"


class EvaluateBaseOperator(LoraflowStageOperator):
    stage = "evaluate_base"


class LoraSftOperator(LoraflowStageOperator):
    stage = "lora_sft"
    ui_color = "#fce8e6"


class MergeAdapterOperator(LoraflowStageOperator):
    stage = "merge_adapter"


class EvaluateTunedOperator(LoraflowStageOperator):
    stage = "evaluate_tuned"


class GateOperator(LoraflowStageOperator):
    stage = "gate"


class PublishOperator(LoraflowStageOperator):
    """Publishes only what the gate promoted; otherwise the task is skipped with the gate's reason."""

    stage = "publish"

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.exceptions import AirflowSkipException

        decision = context["ti"].xcom_pull(task_ids="gate") or {}
        summary = decision.get("summary", {})
        if not summary.get("promote"):
            raise AirflowSkipException(
                f"not published: the gate did not promote ({summary.get('reason', 'no decision')})"
            )
        return super().execute(context)


class ReportLink(BaseOperatorLink):
    """'Run report' on the report task: opens the run's report.html in the browser.

    The URL is decided when the report is committed (the GCS emulator's download URL locally,
    the Cloud console's in GCP) and kept in XCom; Airflow shows it from there.
    """

    name = "Run report"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.bases.xcom import BaseXCom

        url = BaseXCom.get_value(ti_key=ti_key, key=self.xcom_key)  # type: ignore[arg-type]
        return url if isinstance(url, str) else ""


class ReportOperator(LoraflowStageOperator):
    """Writes the run report after publish, also for a run the gate did not promote (publish skipped)."""

    stage = "report"
    ui_color = "#e6f4ea"
    operator_extra_links = (ReportLink(),)

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", "none_failed_min_one_success")
        super().__init__(**kwargs)

    def execute(self, context: Context) -> dict[str, Any]:
        result = super().execute(context)
        uri = result["summary"].get("report") or gcs.join(result["manifest"].rsplit("/", 1)[0], "report.html")
        url = browser_url(uri, os.environ.get("STORAGE_EMULATOR_HOST"))
        context["ti"].xcom_push(key=ReportLink().xcom_key, value=url)
        self.log.info("run report: %s (%s)", url, uri)
        return result


OPERATORS: dict[str, type[LoraflowStageOperator]] = {
    op.stage: op
    for op in (
        ValidateDataOperator,
        ConvertCheckpointOperator,
        EvaluateBaseOperator,
        LoraSftOperator,
        MergeAdapterOperator,
        EvaluateTunedOperator,
        GateOperator,
        PublishOperator,
        ReportOperator,
    )
}
