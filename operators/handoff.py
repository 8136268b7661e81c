"""The two hand-off tasks around a pipeline whose spec has a ``handoff`` section (loraflow/pipeline/handoff.py).

``pick_dataset`` (a setup task, first) takes one dataset version: the one the triggering Asset event
names, or the newest ready, unclaimed one; with nothing to take it skips, and so does the run.
``handoff_verdict`` (its teardown, last, runs whatever happened in between) writes ``_RESULT.json``
beside the version and announces the verdict as an event of the ``loraflow://<pipeline>/verdict``
Asset. Being a teardown, it does not decide the run's state: a rejected dataset still fails the run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset, BaseOperator, Context

from loraflow.pipeline import handoff
from loraflow.reporting import notify
from loraflow.reporting.urls import browser_url
from loraflow.storage import artifacts, gcs
from loraflow.storage.summaries import GateSummary, PublishSummary

if TYPE_CHECKING:
    from loraflow.spec.schema import PipelineSpec


def _spec(data: dict[str, Any]) -> PipelineSpec:
    from loraflow.spec.schema import validate_spec

    spec = validate_spec(data, f"pipeline {data.get('name')}")
    if spec.handoff is None:
        raise ValueError(f"pipeline {spec.name} has no handoff section")
    return spec


def triggering_extras(context: Context) -> list[dict[str, Any]]:
    """The extras of the Asset events that triggered this run, oldest first."""
    events = context.get("triggering_asset_events") or {}
    found = [event for asset in events for event in events[asset]]
    found.sort(key=lambda e: str(getattr(e, "timestamp", "")))
    return [dict(getattr(e, "extra", None) or {}) for e in found]


class PickDatasetOperator(BaseOperator):
    """Claims the dataset version this run trains; pushes its version and URIs to XCom."""

    ui_color = "#fef7e0"

    def __init__(self, *, spec: dict[str, Any], **kwargs: Any) -> None:
        kwargs.setdefault("task_id", handoff.PICK_TASK)
        super().__init__(**kwargs)
        self.spec = spec

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowSkipException

        from loraflow.spec.schema import check_trigger_keys

        spec = _spec(self.spec)
        assert spec.handoff is not None
        check_trigger_keys(spec, context["params"])  # before a dataset version is claimed
        requested = handoff.requested_version(triggering_extras(context))
        try:
            choice = handoff.pick(spec.handoff, self.dag_id, context["run_id"], requested)
        except handoff.HandoffError as exc:  # the data team's hand-off is incomplete: retrying cannot help
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(str(exc)) from exc
        for problem in choice.skipped:  # a bad marker costs its own version only; the verdict lists them too
            self.log.warning("skipped: %s", problem)
        if choice.version is None:
            skipped = (
                f" ({len(choice.skipped)} version(s) skipped for a bad marker, see above)" if choice.skipped else ""
            )
            raise AirflowSkipException(f"nothing to train: {choice.reason}{skipped}")
        self.log.info("training dataset version %s (%s)", choice.uri, choice.reason)
        return choice.to_xcom()


class HandoffVerdictOperator(BaseOperator):
    """Writes the run's verdict beside the dataset version and emits it as an Asset event."""

    ui_color = "#e6f4ea"

    def __init__(self, *, spec: dict[str, Any], **kwargs: Any) -> None:
        kwargs.setdefault("task_id", handoff.VERDICT_TASK)
        self.verdict_asset = Asset(handoff.verdict_asset_uri(spec["name"]))
        kwargs.setdefault("outlets", [self.verdict_asset])
        super().__init__(**kwargs)
        self.spec = spec

    def execute(self, context: Context) -> dict[str, Any]:
        spec = _spec(self.spec)
        ti, run_id = context["ti"], context["run_id"]
        picked = ti.xcom_pull(task_ids=handoff.PICK_TASK) or {}
        version = picked.get("version")
        if not version:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException("this run took no dataset version; nothing to report")
        states = self._task_states(context)
        run_prefix = gcs.join(spec.artifact_root, spec.name, artifacts.safe_run_id(run_id))
        decision = GateSummary.from_xcom(ti.xcom_pull(task_ids="gate"))
        published = PublishSummary.from_xcom(ti.xcom_pull(task_ids="publish"))
        verdict, reasons = handoff.judge(
            {t: s for t, s in states.items() if t != self.task_id},
            handoff.data_failures(run_prefix) if states.get("validate_data") == "failed" else [],
            decision,
            published,
        )
        report = ((ti.xcom_pull(task_ids="report") or {}).get("summary") or {}).get("report")
        report_url = browser_url(report, os.environ.get("STORAGE_EMULATOR_HOST")) if report else None
        document = handoff.result_document(
            spec,
            self.dag_id,
            run_id,
            version,
            verdict,
            reasons,
            published,
            decision,
            report,
            report_url,
            skipped=picked.get("skipped"),
        )
        result_uri = handoff.write_result(spec, version, document)
        context["outlet_events"][self.verdict_asset].extra = handoff.event_extra(document, result_uri)
        self.log.info("dataset %s %s; verdict written to %s", document["dataset"], verdict, result_uri)
        for reason in document["reasons"]:  # capped; a log line is plain text
            self.log.info("  %s", notify.plain_text(reason))
        model = document.get("model") or {}
        return {"result": result_uri, "verdict": verdict, "version": version, "model_version": model.get("version")}

    def _task_states(self, context: Context) -> dict[str, str | None]:
        """This run's task states (the verdict depends on all of them), through the Task SDK."""
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

        run_id = context["dag_run"].run_id
        states = RuntimeTaskInstance.get_task_states(dag_id=self.dag_id, run_ids=[run_id])
        return dict(states.get(run_id, {}))


def wrap_in_handoff(spec: dict[str, Any], stages: list[BaseOperator]) -> None:
    """Put the pipeline's stage tasks between pick_dataset (setup) and handoff_verdict (teardown).

    Call inside the DAG's context. The verdict waits for every stage, runs whatever their states,
    and is skipped when pick_dataset took nothing."""
    pick = PickDatasetOperator(spec=spec)
    verdict = HandoffVerdictOperator(spec=spec)
    for task in stages:
        if not task.upstream_task_ids:
            pick >> task
        task >> verdict
    verdict.as_teardown(setups=pick)
