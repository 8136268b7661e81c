"""One operator per pipeline stage. Each is thin: spec + trigger params -> runner -> manifest URI.

The stage table (``loraflow/spec/stages.py``) gives every operator its traits (colour, trigger
rule, extra links). Operators with behaviour of their own are written here (validate_data, publish,
report); every other stage's class is made from its row (``ConvertCheckpointOperator``, ...), under
the same name in this module, so serialized DAGs and imports find it.
"""

from __future__ import annotations

import os
import types
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from airflow.sdk import BaseOperator, BaseOperatorLink, Context

from loraflow.pipeline import handoff
from loraflow.reporting.urls import browser_url, data_docs_uri, site_url
from loraflow.spec.stages import BY_NAME, REPORT_HTML, STAGE_TABLE, Link
from loraflow.storage import artifacts, gcs
from operators.links import ArtifactsLink, DataDocsLink, ExperimentLink, ReportLink, WorkloadLink, artifacts_url

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage

    from loraflow.launchers.base import Launcher, Workload
    from loraflow.launchers.local import KillSwitch
    from loraflow.pipeline import runner
    from loraflow.spec.schema import PipelineSpec

# The spec models, the planner, the launchers, the runner and the clients they use are imported
# where a task runs, not at DAG parse time (docs/benchmarks.md, section 1).

# The stage table's names of the extra links (operators/links.py).
LINKS: dict[Link, type[BaseOperatorLink]] = {
    "data_docs": DataDocsLink,
    "workload": WorkloadLink,
    "artifacts": ArtifactsLink,
    "report": ReportLink,
    "experiment": ExperimentLink,
}


def resolve_spec(spec: dict[str, Any], params: dict[str, Any]) -> PipelineSpec:
    """The spec as this run sees it: the DAG's spec with the trigger form's values applied. A key of
    ``params`` that is no declared param (a typo in the run's conf) fails the task, naming the key and
    the nearest declared one, and so does a value its param's declaration refuses (type, minimum,
    maximum, enum: Airflow checks them on a trigger, but not on every way a task can be run), before
    the stage does anything."""
    from loraflow.spec.schema import check_trigger_keys, check_trigger_values, param_name, validate_spec, with_overrides

    base = validate_spec(spec, f"pipeline {spec.get('name')}")
    check_trigger_keys(base, params)
    check_trigger_values(base, params)
    overrides = {p.path: params[param_name(p.path)] for p in base.params if param_name(p.path) in params}
    return with_overrides(base, overrides) if overrides else base


def run_spec(spec: dict[str, Any], context: Context) -> PipelineSpec:
    """``resolve_spec`` for the running task; a hand-off pipeline also reads the dataset version
    its pick_dataset task took (operators/handoff.py)."""
    resolved = resolve_spec(spec, dict(context["params"]))
    if resolved.handoff is None:
        return resolved
    picked = context["ti"].xcom_pull(task_ids=handoff.PICK_TASK) or {}
    if not picked.get("version"):
        raise handoff.HandoffError(f"{handoff.PICK_TASK} took no dataset version in this run; run the whole DAG")
    return handoff.apply_version(resolved, str(picked["version"]))


class LoraflowStageOperator(BaseOperator):
    """Runs one stage's step program and pushes its manifest URI (never its data) to XCom."""

    stage: ClassVar[str]
    default_trigger_rule: ClassVar[str]
    operator_extra_links: tuple[BaseOperatorLink, ...]
    spec: dict[str, Any]  # the pipeline spec as JSON data, attached by for_spec()
    _kill_switch: KillSwitch | None = None  # made in execute(): operators get deep-copied
    _finished: dict[str, Any] | None = None  # the XCom value of this try's execute: its lineage (done())

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A stage's operator (a subclass that sets ``stage``) takes its traits from the stage table."""
        super().__init_subclass__(**kwargs)
        if "stage" in vars(cls):
            row = BY_NAME[cls.stage]
            cls.ui_color = row.ui_color
            cls.default_trigger_rule = row.trigger_rule
            cls.operator_extra_links = tuple(LINKS[link]() for link in row.links)

    # No __init__ here (nor in subclasses): Airflow wraps every __init__ in the class hierarchy and
    # deep-copies the DAG's params once per wrapped level, which made DAG parsing slow.
    @classmethod
    def for_spec(cls, spec: dict[str, Any], **kwargs: Any) -> LoraflowStageOperator:
        """This stage's task for a pipeline spec (JSON data), in the DAG being defined."""
        kwargs.setdefault("task_id", cls.stage)
        kwargs.setdefault("trigger_rule", cls.default_trigger_rule)
        op = cls(**kwargs)
        op.spec = spec
        return op

    def upstream_manifests(self, context: Context, spec: PipelineSpec) -> dict[str, str]:
        from loraflow.pipeline.plan import stage_plans

        ti = context["ti"]
        out = {}
        for stage in stage_plans(spec)[self.stage].upstream:
            result = ti.xcom_pull(task_ids=stage)
            if result is not None:
                out[stage] = result["manifest"]
        return out

    def execute(self, context: Context) -> dict[str, Any]:
        from loraflow.launchers.local import KillSwitch
        from loraflow.pipeline import runner
        from operators.connections import resolve_secrets

        spec = run_spec(self.spec, context)
        secrets = resolve_secrets(spec, self.stage)
        prepared = runner.prepare_stage(
            spec, self.stage, context["run_id"], self.upstream_manifests(context, spec), self.log.info
        )
        if isinstance(prepared, runner.StageResult):  # a cache hit: nothing to launch
            return self.done(context, spec, prepared)
        launcher = runner.launcher_for(
            spec, self.stage, context["run_id"], prepared.cache_key, prepared.prefix, self.dag_id
        )
        self._kill_switch = KillSwitch()  # also pulled before a deferral: the launcher cancels its job
        self._kill_switch.arm(launcher)
        if launcher.deferrable and not secrets:
            return self.defer_to_triggerer(context, prepared, launcher)
        runner.launch(
            prepared, launcher, self.log.info, secrets, lambda workload: self.link_workload(context, workload)
        )
        return self.done(context, spec, runner.finish_stage(spec, self.stage, prepared.prefix, prepared.cache_key))

    def link_workload(self, context: Context, workload: Workload) -> None:
        """The task's 'Remote job' link: pushed as soon as a remote job exists, on every path."""
        context["ti"].xcom_push(key=WorkloadLink().xcom_key, value=workload.link)

    def done(self, context: Context, spec: PipelineSpec, result: runner.StageResult) -> dict[str, Any]:
        """Log the result, declare lineage, link the artifacts; the XCom value (both paths end here)."""
        self.log.info("%s %s: %s", self.stage, "reused" if result.cached else "committed", result.manifest)
        for key, value in result.summary.items():
            self.log.info("  %s = %s", key, value)
        self.declare_lineage(spec, self.upstream_manifests(context, spec), result.manifest)
        prefix = result.manifest.rsplit("/", 1)[0]
        url = artifacts_url(prefix, os.environ.get("STORAGE_EMULATOR_HOST"))
        context["ti"].xcom_push(key=ArtifactsLink().xcom_key, value=url)
        self._finished = result.to_xcom()
        return self._finished

    def declare_lineage(self, spec: PipelineSpec, upstream: dict[str, str], manifest: str) -> None:
        """Inlets: the stage's inputs (sources, upstream stages' prefixes); outlet: its committed prefix."""
        from airflow.sdk import Asset

        from loraflow.pipeline import runner
        from loraflow.pipeline.plan import stage_plans

        inputs = runner.resolve_inputs(stage_plans(spec)[self.stage], upstream)
        uris = [uri.rsplit("/", 1)[0] if uri.endswith("/" + artifacts.MANIFEST) else uri for uri in inputs.values()]
        self.inlets = [Asset(uri) for uri in dict.fromkeys(uris)]
        self.outlets = [Asset(manifest.rsplit("/", 1)[0])]

    def get_openlineage_facets_on_start(self) -> OperatorLineage:
        """No datasets yet (the OpenLineage provider's hook, called only when ``[openlineage]`` is configured):
        execute resolves the run's inputs (trigger params, the hand-off version, the upstream commits) and
        the output exists once committed; the COMPLETE event reports both."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        return OperatorLineage()

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """What this try's commit read and wrote, with its facets (operators/lineage.py), from its manifest;
        no datasets when execute did not reach a commit (the FAIL event of a stage that failed calls this too)."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        from operators.lineage import finished_stage

        if self._finished is None:
            return OperatorLineage()
        manifest = artifacts.read_manifest(self._finished["manifest"])
        handoff_prefix = (self.spec.get("handoff") or {}).get("prefix")
        return finished_stage(manifest.data, bool(self._finished["cached"]), handoff_prefix)

    def defer_to_triggerer(
        self, context: Context, prepared: runner.PreparedStage, launcher: Launcher
    ) -> dict[str, Any]:
        """Submit (or reattach to) the stage's remote job, then wait in the triggerer, not in this worker slot."""
        from operators.triggers import trigger_for

        plan = prepared.plan
        self.log.info("launching %s %s, output %s", plan.module, launcher.summary(plan.env), prepared.prefix)
        workload = launcher.submit(prepared.argv(launcher.python(plan.env)), self.log.info, prepared.compute.env)
        self.link_workload(context, workload)
        resume = {"job_name": workload.name, "prefix": prepared.prefix, "cache_key": prepared.cache_key}
        if workload.succeeded:  # reattached to a job that already succeeded
            return self.execute_complete(context, {"status": "success", "state": "succeeded"}, **resume)
        self.log.info("deferring: the triggerer polls %s every %.0fs", workload.name, workload.poll_seconds)
        self.defer(trigger=trigger_for(launcher.name, workload), method_name="execute_complete", kwargs=resume)

    def execute_complete(
        self, context: Context, event: dict[str, Any], job_name: str, prefix: str, cache_key: str
    ) -> dict[str, Any]:
        """Back from the trigger: the workload's outcome. Success: verify the manifest, fill the cache."""
        from loraflow.pipeline import runner

        spec = run_spec(self.spec, context)
        if event.get("status") != "success":
            self.fail_workload(context, spec, event, job_name, prefix, cache_key)
        self.log.info("%s succeeded", job_name)
        return self.done(context, spec, runner.finish_stage(spec, self.stage, prefix, cache_key))

    def fail_workload(
        self, context: Context, spec: PipelineSpec, event: dict[str, Any], job_name: str, prefix: str, cache_key: str
    ) -> NoReturn:
        """Raise the job's own error: ``AirflowFailException`` (no retry) when it is the user's to fix,
        ``StepError`` (retried) otherwise."""
        from airflow.sdk.exceptions import AirflowFailException

        from loraflow.pipeline import runner

        launcher = runner.launcher_for(spec, self.stage, context["run_id"], cache_key, prefix, self.dag_id)
        failure = launcher.failure({**event, "job_name": job_name})
        self.log.error("%s", failure.error)
        if failure.users:  # retrying the same request cannot help: fail without using up retries
            raise AirflowFailException(str(failure.error))
        raise failure.error

    def on_kill(self) -> None:
        if self._kill_switch is not None:
            self._kill_switch.kill()


class ValidateDataOperator(LoraflowStageOperator):
    stage = "validate_data"

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            return super().execute(context)
        except Exception:
            try:
                self.link_data_docs(context, committed=None)
            except Exception as exc:  # the link is a convenience: never hide the stage's own error
                self.log.warning("no data docs link: %s", exc)
            raise

    def done(self, context: Context, spec: PipelineSpec, result: runner.StageResult) -> dict[str, Any]:
        out = super().done(context, spec, result)
        self.link_data_docs(context, committed=result.manifest.rsplit("/", 1)[0])
        return out

    def link_data_docs(self, context: Context, committed: str | None) -> None:
        """Point the 'Data docs' link at the committed artifact's data docs, or the rejected data's."""
        if committed is None:
            from loraflow.pipeline.plan import output_prefix

            prefix = output_prefix(run_spec(self.spec, context), context["run_id"], self.stage)
            uri = data_docs_uri(prefix, rejected=True)
            bucket, path = gcs.split_uri(uri)
            if not gcs.client().bucket(bucket).blob(path).exists():
                return  # the files could not be read: GX never ran, the task log says why
        else:
            uri = data_docs_uri(committed)
        url = site_url(uri, os.environ.get("STORAGE_EMULATOR_HOST"))
        context["ti"].xcom_push(key=DataDocsLink().xcom_key, value=url)
        self.log.info("Great Expectations data docs: %s (%s)", url, uri)


class PublishOperator(LoraflowStageOperator):
    """Publishes only what the gate promoted; otherwise the task is skipped with the gate's reason."""

    stage = "publish"

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.exceptions import AirflowSkipException

        from loraflow.storage.summaries import GateSummary

        decision = GateSummary.from_xcom(context["ti"].xcom_pull(task_ids="gate"))
        if decision is None:
            raise AirflowSkipException("not published: the gate did not promote (no decision)")
        if not decision.promote:
            raise AirflowSkipException(f"not published: the gate did not promote ({decision.reason})")
        return super().execute(context)


class ReportOperator(LoraflowStageOperator):
    """Writes the run report after every other task ended, however it ended: after publish, after a
    gate that did not promote (publish skipped), and after a failed stage (it says what failed and
    why). When a stage failed, the report task fails too once the report is written, so the run
    stays failed in Airflow (its state follows its last task)."""

    stage = "report"

    def execute(self, context: Context) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        result = super().execute(context)
        uri = result["summary"].get("report") or gcs.join(result["manifest"].rsplit("/", 1)[0], REPORT_HTML)
        url = browser_url(uri, os.environ.get("STORAGE_EMULATOR_HOST"))
        context["ti"].xcom_push(key=ReportLink().xcom_key, value=url)
        self.log.info("run report: %s (%s)", url, uri)
        experiment = result["summary"].get("vertex_experiment_url")
        if experiment:  # tracking.vertex: the run's page in Vertex AI Experiments
            context["ti"].xcom_push(key=ExperimentLink().xcom_key, value=experiment)
            self.log.info("Vertex AI experiment run: %s", experiment)
        failed = self.failed_tasks(context)
        if failed:
            raise AirflowFailException(
                f"the run failed ({', '.join(failed)} did not succeed); the report says what failed and why: {url}"
            )
        return result

    def failed_tasks(self, context: Context) -> list[str]:
        """The run's tasks that failed (or could not run because an upstream failed)."""
        ti = context["ti"]
        states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id])
        per_task = states.get(ti.run_id) or {}  # {run_id: {task_id: state}}
        return sorted(t for t, state in per_task.items() if state in ("failed", "upstream_failed") and t != ti.task_id)


def _stage_operator(stage: str) -> type[LoraflowStageOperator]:
    """The operator of a stage with no behaviour of its own: its row of the stage table, nothing else."""
    name = BY_NAME[stage].operator_name

    def body(namespace: dict[str, Any]) -> None:
        namespace.update(__module__=__name__, __qualname__=name, stage=stage)
        namespace["__doc__"] = f"Runs the {stage} stage (its row of loraflow/spec/stages.py)."

    return types.new_class(name, (LoraflowStageOperator,), exec_body=body)


_WRITTEN: dict[str, type[LoraflowStageOperator]] = {
    op.stage: op for op in (ValidateDataOperator, PublishOperator, ReportOperator)
}
OPERATORS: dict[str, type[LoraflowStageOperator]] = {
    row.name: _WRITTEN.get(row.name) or _stage_operator(row.name) for row in STAGE_TABLE
}
globals().update({op.__name__: op for op in OPERATORS.values() if op.stage not in _WRITTEN})
