"""The registry's maintenance DAG (``loraflow_registry``): list, promote or roll back a pipeline's
champion from Airflow's trigger form or its REST API.

One task, thin: the run's params (action, pipeline, version, reason) -> loraflow.registry.operations;
the listing or the move goes to the task log, a small summary to XCom. The actor recorded in the
audit trail is the user who triggered the run (Airflow's ``triggering_user_name``); a run nobody
triggered by hand is recorded as Airflow's run type. A refused operation fails the task at once
with the reason (no retry: a move decided from a stale read must be decided again by a person).
Parsing the DAG reads only the names of the spec files (the pipeline param's choices).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, BaseOperator, Context, Param

from loraflow.spec.locate import pipeline_names

DAG_ID = "loraflow_registry"
ACTIONS = ["list", "promote", "rollback"]  # loraflow.registry.operations.ACTIONS (not imported at parse)


class RegistryOperator(BaseOperator):
    """Runs the action the DAG run's params ask for on the named pipeline's registry."""

    ui_color = "#f4e1c1"

    def __init__(self, *, pipelines_dir: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipelines_dir = pipelines_dir

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        from loraflow.errors import LoraflowError

        try:
            return self.run_action(dict(context["params"]), context)
        except LoraflowError as exc:
            self.log.error("refused: %s", exc)  # in the task log as a line, not only in the exception's details
            raise AirflowFailException(str(exc)) from None

    def run_action(self, params: dict[str, Any], context: Context) -> dict[str, Any]:
        from loraflow.errors import excerpt
        from loraflow.registry import operations
        from loraflow.spec.locate import spec_named

        reg = operations.PipelineRegistry.for_spec(spec_named(str(params["pipeline"]), Path(self.pipelines_dir)))
        action = params["action"]
        if action == "list":
            listed = operations.listing(reg)
            self.log.info("\n%s", operations.render(listed))
            numbers = [v["version"] for v in listed["versions"]]
            champion = f"version {listed['champion']}" if listed["champion"] else "none"
            summary = f"{reg.pipeline}: champion {champion}; {len(numbers)} version(s); {len(listed['audit'])} move(s)"
            return {"summary": summary, "champion": listed["champion"], "versions": numbers[-50:]}
        run = context["dag_run"]
        actor = getattr(run, "triggering_user_name", None) or f"airflow ({run.run_type})"
        via = f"airflow {run.dag_id} run {run.run_id}"
        reason = str(params.get("reason") or "")
        if action == "promote":
            version = params.get("version")
            if not isinstance(version, int) or isinstance(version, bool) or version < 1:
                raise operations.RegistryOperationError(
                    f"promote needs the version to promote (a number from 1; got {excerpt(version)}): set the "
                    "'version' param (see the list action's log)"
                )
            done = operations.promote(reg, version, actor=actor, reason=reason, via=via)
        else:
            done = operations.rollback(reg, actor=actor, reason=reason, via=via)
        line = operations.summary_line(done)
        self.log.info("%s", line)
        return {"summary": line, **done}


def registry_dag(pipelines_dir: Path) -> DAG:
    """The maintenance DAG; its pipeline param offers the specs in ``pipelines_dir`` by name."""
    names = pipeline_names(pipelines_dir)
    choice: dict[str, Any] = {
        "type": "string",
        "title": "pipeline",
        "description": "the pipeline whose registry to see or change",
    }
    if names:
        choice["enum"] = names
    pipeline = Param(names[0] if names else "", **choice)
    with DAG(
        dag_id=DAG_ID,
        description="List a pipeline's registered models; promote one; roll the champion back (audited).",
        doc_md=__doc__,
        schedule=None,
        start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        catchup=False,
        tags=["loraflow", "maintenance"],
        default_args={"retries": 0},
        params={
            "action": Param(
                "list",
                type="string",
                enum=ACTIONS,
                title="action",
                description="list: versions, metrics, lineage, audit trail (in the task log); promote: make "
                "'version' the champion; rollback: move the champion back to the previous version",
            ),
            "pipeline": pipeline,
            "version": Param(
                None, type=["null", "integer"], minimum=1, title="version", description="the version to promote"
            ),
            "reason": Param(
                "",
                type="string",
                maxLength=1000,  # operations.MAX_REASON_CHARS (not imported at parse)
                title="reason",
                description="why (required to promote or roll back): recorded in the audit trail",
            ),
        },
    ) as dag:
        RegistryOperator(task_id="registry", pipelines_dir=str(pipelines_dir))
    return dag
