"""Build one Airflow DAG per pipeline spec. Imports nothing heavy; an unchanged spec is read back
from the spec cache (loraflow/spec/cache.py) as plain data, without validating it again."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from airflow.sdk import DAG, Asset, Param

from loraflow.errors import SpecError
from loraflow.spec.cache import CompiledSpec, compiled, discover
from operators.handoff import wrap_in_handoff
from operators.notifiers import attach_notifiers
from operators.stages import OPERATORS


def trigger_params(fields: dict[str, dict[str, Any]]) -> dict[str, Param]:
    """The spec's overridable settings as Airflow Params (the trigger form shows and checks them)."""
    return {name: Param(**field) for name, field in fields.items()}


# Failures a retry cannot fix: the step refused its input, the spec or trigger parameters are invalid.
_NOT_RETRIED: list[type[BaseException] | str] = [
    "loraflow.launchers.local.StepRefused",
    "loraflow.errors.SpecError",
    "loraflow.errors.DataValidationError",
]


def retry_args(retry: dict[str, Any]) -> dict[str, Any]:
    """Every task's retries from the spec's ``retry`` section: crashes are retried with exponential
    backoff, refused input fails at once."""
    from airflow.sdk.definitions.retry_policy import ExceptionRetryPolicy, RetryAction, RetryRule

    return {
        "retries": retry["retries"],
        "retry_delay": dt.timedelta(seconds=retry["delay_seconds"]),
        "retry_exponential_backoff": retry["backoff"] if retry["backoff"] > 1 else 0,
        "max_retry_delay": dt.timedelta(seconds=retry["max_delay_seconds"]),
        "retry_policy": ExceptionRetryPolicy(
            [RetryRule(exception=_NOT_RETRIED, action=RetryAction.FAIL, reason="refused input: a retry cannot help")]
        ),
    }


def _schedule(spec: dict[str, Any]) -> Any:
    if isinstance(spec["schedule"], dict):
        return [Asset(spec["schedule"]["asset"])]
    return spec["schedule"]


def build_dag(pipeline: CompiledSpec, source: Path) -> DAG:
    spec = pipeline.spec
    doc = f"### {spec['name']}\n\n{spec['description']}\n\nSpec: `{source.name}`. Run `loraflow plan {source}` to see every step."
    with DAG(
        dag_id=spec["name"],
        description=(spec["description"].splitlines() or [""])[0][:200],
        doc_md=doc,
        schedule=_schedule(spec),
        start_date=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        catchup=False,
        max_active_runs=4,
        tags=["loraflow", *spec["tags"]],
        default_args=retry_args(spec["retry"]),
        auto_register=False,  # a DAG reaches the DagBag only whole, through load_pipelines
    ) as dag:
        tasks = {stage: OPERATORS[stage].for_spec(spec) for stage in pipeline.upstream}
        for stage, upstream in pipeline.upstream.items():
            tasks[stage].set_upstream([tasks[u] for u in upstream])
        if spec["handoff"] is not None:
            wrap_in_handoff(spec, list(tasks.values()))
        attach_notifiers(spec, dag)
    # The trigger form's Params go on the DAG after its tasks exist: Airflow deep-copies the DAG's
    # params into every task it constructs (most of the parse time with 50 specs), and a task reads
    # them from its DAG at run time anyway. Assigning runs the DAG's own conversion and validation.
    dag.params = trigger_params(pipeline.params)  # type: ignore[assignment]
    return dag


class InvalidSpecs(DAG):
    """Stands in for the specs that failed validation: Airflow records its validate() error as the
    file's import error (naming each spec and its problems) while every valid spec's DAG loads."""

    def validate(self) -> None:
        raise InvalidSpecsError(self.doc_md or "")


class InvalidSpecsError(Exception):
    """The import error Airflow shows for the invalid specs."""


def load_pipelines(folder: Path) -> dict[str, DAG]:
    dags: dict[str, DAG] = {}
    errors: list[str] = []
    for path in discover(folder):
        try:
            pipeline = compiled(path)
        except SpecError as exc:
            errors.append(str(exc))
            continue
        except Exception as exc:  # whatever a hostile spec does, the other pipelines' DAGs still load
            errors.append(f"{path}: cannot be loaded ({type(exc).__name__}: {exc}); run `loraflow validate {path}`")
            continue
        if pipeline.name in dags:
            errors.append(f"{path}: pipeline name {pipeline.name!r} is used by another spec; names must be unique")
            continue
        try:
            dags[pipeline.name] = build_dag(pipeline, path)
        except Exception as exc:  # a value the schema let through that Airflow refuses: a bug, but this spec's alone
            errors.append(
                f"{path}: its DAG cannot be built ({type(exc).__name__}: {exc}); the spec passed validation, "
                "so this is a loraflow bug: report it with the spec"
            )
    if errors:
        message = "invalid pipeline spec(s); their DAGs are not loaded, the others are:\n" + "\n".join(errors)
        dags["_loraflow_invalid_specs"] = InvalidSpecs(dag_id="_loraflow_invalid_specs", doc_md=message, schedule=None)
    return dags
